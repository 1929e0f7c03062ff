"""torchrec_cnr: Check-N-Run and CPR checkpointing for TorchRec sharded embeddings."""

from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.manager import CheckpointManager
from torchrec_cnr.tracking import tracking_sharders

__all__ = ["CheckpointConfig", "CheckpointManager", "tracking_sharders"]
