"""Using checkpoints outside training: reading tables without a model, exporting the
unsharded model's state dict, and compacting chains."""

from torchrec_cnr.offline.catalog import (
    CheckpointInfo,
    TableInfo,
    checkpoint_info,
    list_checkpoints,
)
from torchrec_cnr.offline.compact import compact, compact_entry
from torchrec_cnr.offline.export import EXPORT_FORMATS, export_state_dict, save_export
from torchrec_cnr.offline.tables import ChainReader, read_optimizer_state, read_table

__all__ = [
    "CheckpointInfo",
    "TableInfo",
    "checkpoint_info",
    "list_checkpoints",
    "EXPORT_FORMATS",
    "ChainReader",
    "compact",
    "compact_entry",
    "export_state_dict",
    "read_optimizer_state",
    "read_table",
    "save_export",
]
