"""Serving from checkpoints: a follower keeps an inference model at the latest committed
step of a root, reading only the rows that changed.

``plan`` says which rows changed between two committed checkpoints, ``rows`` carries
them as stored and as prepared, ``targets`` holds the serving models rows are written into (the fp32 model, :class:`FloatTarget`, and TorchRec's
quantized inference model, :class:`QuantizedTarget`), and ``follower`` reads and applies.
"""

from torchrec_cnr.serving.follower import (
    Follower,
    PendingUpdate,
    RefusedUpdate,
    UpdateReport,
    finite_rows,
)
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
