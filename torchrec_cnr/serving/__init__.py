"""Stage 10: serving from checkpoints; a follower keeps an inference model at the latest committed
step of a root, reading only the rows that changed.

:class:`FollowerOptions` (``options``) says how a follower reads, checks and applies
updates. An update, in the order it runs:

- ``plan``: which rows changed between two committed checkpoints;
- ``locate``: which checkpoint of the chain each of those rows is read from, and the
  reads; ``fetch``: the whole update read and ready (``spill``: over the memory budget,
  piece by piece into mapped files);
- ``gate``: the accept gate that sees it before it is served;
- ``apply``: the lock serving shares with updates, and the writes (copy or swap mode);
- ``rows`` carries rows as stored and as prepared, ``targets`` holds the serving models
  they are written into (the fp32 model, :class:`FloatTarget`, and TorchRec's quantized
  inference model, :class:`QuantizedTarget`);
- ``follower``: the façade that sequences them, with ``poller`` (its polling thread with
  back-off) and ``counters`` (what it reports); ``metrics`` exposes those to Prometheus.
"""

from torchrec_cnr.serving.counters import UpdateReport
from torchrec_cnr.serving.follower import Follower
from torchrec_cnr.serving.gate import PendingUpdate, RefusedUpdate, finite_rows
from torchrec_cnr.serving.options import FollowerOptions
from torchrec_cnr.serving.rows import PreparedRows, StoredRows
from torchrec_cnr.serving.targets import (
    FloatTarget,
    QuantizedTarget,
    ServingFormat,
    ServingTarget,
    TableSlot,
)

__all__ = [
    "FloatTarget",
    "Follower",
    "FollowerOptions",
    "PendingUpdate",
    "RefusedUpdate",
    "PreparedRows",
    "QuantizedTarget",
    "ServingFormat",
    "StoredRows",
    "TableSlot",
    "ServingTarget",
    "UpdateReport",
    "finite_rows",
]
