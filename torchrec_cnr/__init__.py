"""torchrec_cnr: Check-N-Run and CPR checkpointing for TorchRec sharded embeddings.

The package follows a checkpoint through its stages:

1. ``tracking``: which rows changed (bitmaps, kernel hooks, sharders, MFU/SSU priority);
2. ``selection``: which rows a checkpoint holds (policies, baseline rules, CPR's priority);
3. ``staging``: the copy to host memory, the only stall;
4. ``encoding``: formats, per-row quantization (``quantization``) and
   the shard writer;
5. ``storage`` (backends: file systems, S3) and ``snapshot`` (the on-disk format: names
   in a root, torchsnapshot's index, the parallel writer and reader, checksums);
6. ``commit``: the typed manifest, the commit, the lease, retention;
7. ``restore``: shard geometry, the chain reader, applying a chain, compatibility,
   partial recovery, verification.

``offline`` uses checkpoints outside training (the catalog, reading tables, export,
compaction); ``serving`` keeps an inference model fresh from a root (the follower);
``recovery`` holds CPR's interval choice; ``manager`` sequences the stages and owns the
threads and buffers (``executors``, ``staging``).
"""

from torchrec_cnr.config import CheckpointConfig, IOOptions, QuantizeConfig, RecoveryConfig
from torchrec_cnr.errors import (
    CheckpointError,
    CheckpointReadError,
    ChecksumError,
    CnrError,
    ManifestError,
    ModelMismatchError,
    UnsafeObjectError,
)
from torchrec_cnr.manager import CheckpointManager
from torchrec_cnr.offline import (
    CheckpointInfo,
    RootInfo,
    TableInfo,
    checkpoint_info,
    export_state_dict,
    list_checkpoints,
    read_optimizer_state,
    read_table,
    root_info,
)
from torchrec_cnr.quantization import QuantizedRows, quantize
from torchrec_cnr.serving import FloatTarget, Follower, QuantizedTarget
from torchrec_cnr.tracking import tracking_sharders

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointReadError",
    "ChecksumError",
    "CnrError",
    "FloatTarget",
    "Follower",
    "IOOptions",
    "ManifestError",
    "ModelMismatchError",
    "UnsafeObjectError",
    "QuantizeConfig",
    "QuantizedTarget",
    "QuantizedRows",
    "RecoveryConfig",
    "RootInfo",
    "TableInfo",
    "checkpoint_info",
    "export_state_dict",
    "list_checkpoints",
    "quantize",
    "read_optimizer_state",
    "read_table",
    "root_info",
    "tracking_sharders",
]
