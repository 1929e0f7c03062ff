"""Stage 5: the names inside a root, writing a checkpoint, reading it back without a model."""

from torchrec_cnr.storage.layout import MANIFEST_NAME, checkpoint_id
from torchrec_cnr.storage.reader import SnapshotReader
from torchrec_cnr.storage.writer import RankWrite, write_checkpoint

__all__ = ["MANIFEST_NAME", "RankWrite", "SnapshotReader", "checkpoint_id", "write_checkpoint"]
