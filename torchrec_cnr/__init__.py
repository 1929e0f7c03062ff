"""torchrec_cnr: Check-N-Run and CPR checkpointing for TorchRec sharded embeddings.

The package follows a checkpoint through its stages:

1. ``tracking``: which rows changed (bitmaps, kernel hooks, sharders, MFU/SSU priority);
2. ``selection``: which rows a checkpoint holds (policies, baseline rules, CPR's priority);
3. ``staging``: the copy to host memory, the only stall;
4. ``encoding``: formats, per-row quantization (``quantization``), checksums;
5. ``storage``: names in a root, the writer, the model-free reader;
6. ``commit``: the typed manifest, the commit, retention;
7. ``restore``: applying a chain, compatibility, partial recovery, verification.

``offline`` uses checkpoints outside training (reading tables, export, compaction);
``recovery`` holds CPR's interval choice; ``manager`` sequences the stages.
"""

from torchrec_cnr.config import CheckpointConfig, QuantizeConfig, RecoveryConfig
from torchrec_cnr.errors import (
    CheckpointError,
    CheckpointReadError,
    ChecksumError,
    ManifestError,
    ModelMismatchError,
)
from torchrec_cnr.manager import CheckpointManager
from torchrec_cnr.offline import export_state_dict, read_optimizer_state, read_table
from torchrec_cnr.quantization import QuantizedRows, quantize
from torchrec_cnr.tracking import tracking_sharders

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointReadError",
    "ChecksumError",
    "ManifestError",
    "ModelMismatchError",
    "QuantizeConfig",
    "QuantizedRows",
    "RecoveryConfig",
    "export_state_dict",
    "quantize",
    "read_optimizer_state",
    "read_table",
    "tracking_sharders",
]
