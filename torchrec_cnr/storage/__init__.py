"""Stage 5: the names inside a root, writing a checkpoint, reading it back without a model."""

from torchrec_cnr.storage.backend import ANY, PreconditionFailed, Storage
from torchrec_cnr.storage.layout import MANIFEST_NAME, checkpoint_id
from torchrec_cnr.storage.reader import SnapshotReader
from torchrec_cnr.storage.root import as_storage, open_storage
from torchrec_cnr.storage.snapshot import SnapshotWriter, io_pool, write_index
from torchrec_cnr.storage.writer import RankWrite, ShardWriter

__all__ = [
    "ANY",
    "MANIFEST_NAME",
    "PreconditionFailed",
    "RankWrite",
    "ShardWriter",
    "SnapshotReader",
    "SnapshotWriter",
    "Storage",
    "as_storage",
    "checkpoint_id",
    "io_pool",
    "open_storage",
    "write_index",
]
