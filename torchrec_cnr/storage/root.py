"""Opening a checkpoint root from the path or URL a user gives."""

from __future__ import annotations

import os

from torchrec_cnr.iocontext import IOOptions
from torchrec_cnr.storage.backend import Storage
from torchrec_cnr.storage.fs import FsStorage
from torchrec_cnr.storage.s3 import S3Storage, split_url

__all__ = ["Root", "as_storage", "check_root", "open_storage"]

Root = Storage | str | os.PathLike[str]
"""A checkpoint root as callers give it: a path, an ``s3://bucket/prefix`` URL or a :class:`Storage`."""


def as_storage(root: Root, options: IOOptions | None = None) -> Storage:
    """``root`` itself if it is a :class:`Storage`, else :func:`open_storage` of it."""
    return root if isinstance(root, Storage) else open_storage(os.fspath(root), options)


def check_root(url: str) -> None:
    """Refuses a root that no backend opens, before anything is opened.

    Raises:
        ValueError: an unsupported URL scheme, or an S3 URL without a bucket or prefix.
    """
    scheme, sep, _ = url.partition("://")
    if not sep or scheme == "file":
        return
    if scheme != "s3":
        raise ValueError(
            f"checkpoint path {url!r}: supported roots are local or shared file system paths "
            "and s3://bucket/prefix URLs (any S3-compatible store through AWS_ENDPOINT_URL)"
        )
    split_url(url)


def open_storage(url: str, options: IOOptions | None = None) -> Storage:
    """The :class:`Storage` of a root: ``s3://bucket/prefix``, or a local or shared path,
    doing its I/O as ``options`` say (the environment's :class:`IOOptions` if ``None``).

    Raises:
        ValueError: as :func:`check_root`.
    """
    check_root(url)
    scheme, sep, rest = url.partition("://")
    if scheme == "s3":
        return S3Storage(url)
    io = options if options is not None else IOOptions()
    return FsStorage(rest if sep else url, io.direct_writes, io.direct_reads)
