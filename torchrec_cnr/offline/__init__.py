"""Using checkpoints outside training: the catalog of a root, reading tables without a
model, exporting the unsharded model's state dict, and compacting chains."""

from torchrec_cnr.offline.catalog import (
    CheckpointInfo,
    RootInfo,
    TableInfo,
    checkpoint_info,
    list_checkpoints,
    root_info,
)
from torchrec_cnr.offline.compact import compact, compact_entry
from torchrec_cnr.offline.export import EXPORT_FORMATS, export_state_dict, save_export
from torchrec_cnr.offline.tables import read_optimizer_state, read_table

__all__ = [
    "EXPORT_FORMATS",
    "CheckpointInfo",
    "RootInfo",
    "TableInfo",
    "checkpoint_info",
    "compact",
    "compact_entry",
    "export_state_dict",
    "list_checkpoints",
    "read_optimizer_state",
    "read_table",
    "root_info",
    "save_export",
]
