"""Stage 9: checkpoints used outside training, read-only: the catalog of a root, reading tables
without a model, and exporting the unsharded model's state dict. (Compaction, which
writes, is :mod:`torchrec_cnr.compaction`.)"""

from torchrec_cnr.offline.catalog import (
    CheckpointInfo,
    RootInfo,
    TableInfo,
    checkpoint_info,
    list_checkpoints,
    root_info,
)
from torchrec_cnr.offline.export import EXPORT_FORMATS, export_state_dict, save_export
from torchrec_cnr.read.tables import read_optimizer_state, read_table

__all__ = [
    "EXPORT_FORMATS",
    "CheckpointInfo",
    "RootInfo",
    "TableInfo",
    "checkpoint_info",
    "export_state_dict",
    "list_checkpoints",
    "read_optimizer_state",
    "read_table",
    "root_info",
    "save_export",
]
