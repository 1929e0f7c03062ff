"""torchrec_cnr: Check-N-Run and CPR checkpointing for TorchRec sharded embeddings.

The package follows a checkpoint through its stages, numbered here once (each stage's
docstring and ``docs/design.md`` say the same; ``tests/unit/test_layers.py`` checks it):

1. ``tracking``: which rows changed (bitmaps, kernel hooks, sharders, MFU/SSU priority);
2. ``selection``: which rows a checkpoint holds (policies, baseline rules, CPR's priority);
3. ``staging``: the copy to host memory, the only stall (the stager chooses, per shard,
   copy-on-write or an eager copy);
4. ``encoding``: formats, per-row quantization (``quantization``) and the shard writer;
5. ``commit``: the commit that makes a checkpoint exist, this job's fence on the root
   (lease, generation), retention, the background writer;
6. ``read``: committed checkpoints read back for every use (the chain reader, where saved
   rows land, a table's rows without a model, the retry);
7. ``restore``: a chain loaded into the live model (compatibility, partial recovery,
   verification);
8. ``compaction``: a chain merged into one full checkpoint;
9. ``offline``: checkpoints used outside training (the catalog, tables, export);
10. ``serving``: an inference model kept fresh from a root (the follower).

Beneath the stages: ``schema`` is the on-disk contract (every persisted type and name);
``storage`` the backends (file systems, S3, fsspec) and ``snapshot`` one checkpoint
directory's tensors; ``manifest`` the root's index of checkpoints, as plain records, that
the commit writes and every reader reads; ``iocontext`` the I/O options and the thread
pools every reader and writer runs on. Beside them: ``recovery`` CPR's interval choice and
the save schedule; ``writer_process`` the writer in a process of its own; ``interop``
PyTorch's DCP format (import, export, the stager); ``manager`` only sequences the stages.

``__all__`` holds what a training or serving job imports: the manager, its configuration,
the sharders, the follower, the offline restores and the errors to catch. The rest is
imported from its subpackage (``torchrec_cnr.offline``, ``torchrec_cnr.interop``, ...).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING

from torchrec_cnr.lazy import exports, listing
from torchrec_cnr.versions import warn_unsupported

if TYPE_CHECKING:
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
        CnrError,
        ManifestError,
        ModelMismatchError,
    )
    from torchrec_cnr.interop import export_dcp
    from torchrec_cnr.manager import CheckpointManager
    from torchrec_cnr.offline import export_state_dict, read_table
    from torchrec_cnr.serving import FloatTarget, Follower, FollowerOptions, QuantizedTarget
    from torchrec_cnr.tracking import tracking_sharders

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointReadError",
    "CnrError",
    "FloatTarget",
    "Follower",
    "FollowerOptions",
    "IOOptions",
    "ManifestError",
    "ModelMismatchError",
    "QuantizeConfig",
    "QuantizedTarget",
    "RecoveryConfig",
    "Timeouts",
    "export_dcp",
    "export_state_dict",
    "read_table",
    "tracking_sharders",
]

_MOVED = {
    "ChecksumError": "torchrec_cnr.errors:ChecksumError",
    "UnsafeObjectError": "torchrec_cnr.errors:UnsafeObjectError",
    "DcpStager": "torchrec_cnr.interop:DcpStager",
    "ExportOptions": "torchrec_cnr.interop:ExportOptions",
    "CheckpointInfo": "torchrec_cnr.offline:CheckpointInfo",
    "RootInfo": "torchrec_cnr.offline:RootInfo",
    "TableInfo": "torchrec_cnr.offline:TableInfo",
    "checkpoint_info": "torchrec_cnr.offline:checkpoint_info",
    "list_checkpoints": "torchrec_cnr.offline:list_checkpoints",
    "read_optimizer_state": "torchrec_cnr.offline:read_optimizer_state",
    "root_info": "torchrec_cnr.offline:root_info",
    "QuantizedRows": "torchrec_cnr.quantization:QuantizedRows",
    "quantize": "torchrec_cnr.quantization:quantize",
    "write_rows": "torchrec_cnr.tracking:write_rows",
}
"""Names this package exported before they left ``__all__`` -> ``"module:name"``: they
import for one more release, with a ``DeprecationWarning`` that names the new spelling."""


_lazy = exports(
    globals(),
    {
        "torchrec_cnr.config": (
            "CheckpointConfig", "IOOptions", "QuantizeConfig", "RecoveryConfig", "Timeouts",
        ),
        "torchrec_cnr.errors": (
            "CheckpointError", "CheckpointReadError", "CnrError", "ManifestError",
            "ModelMismatchError",
        ),
        "torchrec_cnr.serving": ("FloatTarget", "Follower", "FollowerOptions", "QuantizedTarget"),
        "torchrec_cnr.manager": ("CheckpointManager",),
        "torchrec_cnr.interop": ("export_dcp",),
        "torchrec_cnr.offline": ("export_state_dict", "read_table"),
        "torchrec_cnr.tracking": ("tracking_sharders",),
    },
)  # fmt: skip
"""Each name of ``__all__`` imports on first use (:mod:`torchrec_cnr.lazy`)."""
__dir__ = listing(globals())


def __getattr__(name: str) -> object:
    if name in __all__:
        return _lazy(name)
    moved = _MOVED.get(name)
    if moved is None:
        raise AttributeError(f"module 'torchrec_cnr' has no attribute {name!r}")
    module, attr = moved.split(":")
    warnings.warn(
        f"torchrec_cnr.{name} is deprecated and leaves torchrec_cnr in the next release;"
        f" use 'from {module} import {attr}'",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), attr)


warn_unsupported()
