"""Stage 1: which rows changed. Bitmaps, kernel hooks, drop-in sharders, CPR's MFU/SSU."""

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
