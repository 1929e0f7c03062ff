"""Stage 5: the names inside a root, writing a checkpoint, reading it back without a model."""

from torchrec_cnr.storage.backend import ANY, PreconditionFailed, Storage
from torchrec_cnr.storage.layout import MANIFEST_NAME, checkpoint_id
from torchrec_cnr.storage.reader import SnapshotReader
from torchrec_cnr.storage.root import as_storage, open_storage
from torchrec_cnr.storage.writer import RankWrite, write_checkpoint

__all__ = [
    "ANY",
    "MANIFEST_NAME",
    "PreconditionFailed",
    "RankWrite",
    "SnapshotReader",
    "Storage",
    "as_storage",
    "checkpoint_id",
    "open_storage",
    "write_checkpoint",
]
