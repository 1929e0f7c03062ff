"""torchrec_cnr: Check-N-Run and CPR checkpointing for TorchRec sharded embeddings.

The package follows a checkpoint through its stages, numbered here once (each stage's
docstring and ``docs/design.md`` say the same; ``tests/unit/test_layers.py`` checks it):

1. ``tracking``: which rows changed (bitmaps, kernel hooks, sharders, MFU/SSU priority);
2. ``selection``: which rows a checkpoint holds (policies, baseline rules, CPR's priority);
3. ``staging``: the copy to host memory, the only stall (the stager chooses, per shard,
   copy-on-write or an eager copy);
4. ``encoding``: formats, per-row quantization (``quantization``) and the shard writer;
5. ``commit``: the manifest, the commit, this job's fence on the root (lease,
   generation), retention, the background writer;
6. ``read``: committed checkpoints read back for every use (the chain reader, where saved
   rows land, a table's rows without a model, the retry);
7. ``restore``: a chain loaded into the live model (compatibility, partial recovery,
   verification);
8. ``compaction``: a chain merged into one full checkpoint;
9. ``offline``: checkpoints used outside training (the catalog, tables, export);
10. ``serving``: an inference model kept fresh from a root (the follower).

Beneath the stages: ``schema`` is the on-disk contract (every persisted type and name);
``storage`` the backends (file systems, S3, fsspec) and ``snapshot`` one checkpoint
directory's tensors; ``iocontext`` the I/O options and the thread pools every reader and
writer runs on. Beside them: ``recovery`` CPR's interval choice and the save schedule;
``writer_process`` the writer in a process of its own; ``interop`` PyTorch's DCP format (import,
export, the stager); ``manager`` only sequences the stages.
"""

from torchrec_cnr.config import (
    CheckpointConfig,
    IOOptions,
    QuantizeConfig,
    RecoveryConfig,
    Timeouts,
)
from torchrec_cnr.errors import (
    CheckpointError,
    CheckpointReadError,
    ChecksumError,
    CnrError,
    ManifestError,
    ModelMismatchError,
    UnsafeObjectError,
)
from torchrec_cnr.interop import DcpStager, ExportOptions, export_dcp
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
from torchrec_cnr.serving import FloatTarget, Follower, FollowerOptions, QuantizedTarget
from torchrec_cnr.tracking import tracking_sharders, write_rows
from torchrec_cnr.versions import warn_unsupported

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointReadError",
    "ChecksumError",
    "CnrError",
    "DcpStager",
    "ExportOptions",
    "FloatTarget",
    "Follower",
    "FollowerOptions",
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
    "Timeouts",
    "checkpoint_info",
    "export_dcp",
    "export_state_dict",
    "list_checkpoints",
    "quantize",
    "read_optimizer_state",
    "read_table",
    "root_info",
    "tracking_sharders",
    "write_rows",
]

warn_unsupported()
