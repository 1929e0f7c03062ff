"""Stage 1: which rows changed. Bitmaps, kernel hooks, drop-in sharders, CPR's MFU/SSU.

Its names import on first use (:mod:`torchrec_cnr.lazy`): the row bitmaps and the shard
types need no TorchRec, the sharders and the model's state do."""

from typing import TYPE_CHECKING

from torchrec_cnr.lazy import exports, listing

if TYPE_CHECKING:
    from torchrec_cnr.tracking.model_state import write_rows
    from torchrec_cnr.tracking.shard import LocalShard, ShardSpec
    from torchrec_cnr.tracking.sharders import tracking_sharders
    from torchrec_cnr.tracking.tracker import TRACKER_ATTR, TRACKING_MODES, RowTracker

__all__ = [
    "TRACKER_ATTR",
    "TRACKING_MODES",
    "LocalShard",
    "RowTracker",
    "ShardSpec",
    "tracking_sharders",
    "write_rows",
]

__getattr__ = exports(
    globals(),
    {
        ".model_state": ("write_rows",),
        ".shard": ("LocalShard", "ShardSpec"),
        ".sharders": ("tracking_sharders",),
        ".tracker": ("TRACKER_ATTR", "TRACKING_MODES", "RowTracker"),
    },
)
__dir__ = listing(globals())
