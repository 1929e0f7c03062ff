"""Tracking: which rows of each local shard changed since the bits were cleared."""

from torchrec_cnr.tracking.sharders import tracking_sharders
from torchrec_cnr.tracking.tracker import TRACKER_ATTR, LocalShard, RowTracker, ShardSpec

__all__ = ["LocalShard", "RowTracker", "ShardSpec", "TRACKER_ATTR", "tracking_sharders"]
