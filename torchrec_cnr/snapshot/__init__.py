"""The on-disk format of one checkpoint: a torchsnapshot snapshot per checkpoint directory.

:mod:`torchrec_cnr.schema` names what lies where in a root; ``writer`` writes one writer's (rank's) part
of a directory and its index, ``reader`` reads tensors back without a model (``buffers``:
memory it reads into again and again, for readers that read as much each time), ``index`` is
the index's format (torchsnapshot's, without its package), and ``checksum`` is the CRC32
every stored tensor carries. Storage itself (files, objects) is :mod:`torchrec_cnr.storage`'s.
"""

from torchrec_cnr.schema import (
    LEASE_NAME,
    MANIFEST_NAME,
    PREVIOUS_MANIFEST_NAME,
    SNAPSHOT_MARKER,
    CheckpointName,
    app_path,
    checkpoint_id,
    dense_path,
    parse_checkpoint_id,
    rows_path,
    stored_ids,
    stored_part,
    stored_recent,
    stored_state,
    stored_weight,
)
from torchrec_cnr.snapshot.buffers import Buffers
from torchrec_cnr.snapshot.checksum import as_bytes, check, crc32, crc32_combine, mismatch
from torchrec_cnr.snapshot.index import IndexPart
from torchrec_cnr.snapshot.reader import SnapshotReader, page_aligned
from torchrec_cnr.snapshot.writer import RankPart, SnapshotWriter, write_index

__all__ = [
    "Buffers",
    "LEASE_NAME",
    "MANIFEST_NAME",
    "PREVIOUS_MANIFEST_NAME",
    "SNAPSHOT_MARKER",
    "CheckpointName",
    "IndexPart",
    "RankPart",
    "SnapshotReader",
    "SnapshotWriter",
    "app_path",
    "as_bytes",
    "check",
    "checkpoint_id",
    "crc32",
    "crc32_combine",
    "dense_path",
    "mismatch",
    "page_aligned",
    "parse_checkpoint_id",
    "rows_path",
    "stored_ids",
    "stored_part",
    "stored_recent",
    "stored_state",
    "stored_weight",
    "write_index",
]
