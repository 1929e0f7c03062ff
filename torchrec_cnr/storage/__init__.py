"""Storage backends: the operations on a checkpoint root, and nothing about the format.

A root is a local or shared file system path (:class:`~torchrec_cnr.storage.fs.FsStorage`),
an S3-compatible object store through boto3 (:class:`~torchrec_cnr.storage.s3.S3Storage`)
or any store fsspec opens (:class:`~torchrec_cnr.storage.remote.FsspecStorage`: GCS,
Azure, HDFS, S3 through s3fs); each implements :class:`Storage`, and :class:`StorageWrapper` watches one (counting requests and
bytes, refusing writes, or failing on cue in the tests). What the objects hold is :mod:`torchrec_cnr.snapshot`'s business.
"""

from torchrec_cnr.storage.backend import ANY, PreconditionFailed, Storage
from torchrec_cnr.storage.fs import DIRECT_ALIGN, DIRECT_MIN_BYTES
from torchrec_cnr.storage.remote import FsspecStorage
from torchrec_cnr.storage.root import Root, as_storage, check_root, open_storage
from torchrec_cnr.storage.wrapper import CountingStorage, StorageWrapper

__all__ = [
    "ANY",
    "CountingStorage",
    "DIRECT_ALIGN",
    "DIRECT_MIN_BYTES",
    "FsspecStorage",
    "PreconditionFailed",
    "Root",
    "Storage",
    "StorageWrapper",
    "as_storage",
    "check_root",
    "open_storage",
]
