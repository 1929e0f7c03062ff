"""torchrec_cnr: Check-N-Run checkpointing for TorchRec sharded embeddings."""

from torchrec_cnr.config import CheckpointConfig, QuantizeConfig
from torchrec_cnr.manager import CheckpointError, CheckpointManager
from torchrec_cnr.quantization import QuantizedRows, quantize
from torchrec_cnr.tracking import tracking_sharders

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "QuantizeConfig",
    "QuantizedRows",
    "quantize",
    "tracking_sharders",
]
