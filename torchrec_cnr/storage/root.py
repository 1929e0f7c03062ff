"""Opening a checkpoint root from the path or URL a user gives."""

from __future__ import annotations

import os
from typing import Any

from torchrec_cnr.iocontext import IOOptions, storage_defaults
from torchrec_cnr.storage.backend import Storage
from torchrec_cnr.storage.fs import FsStorage
from torchrec_cnr.storage.remote import FsspecStorage, check_protocol, fsspec_url
from torchrec_cnr.storage.s3 import S3Storage, split_url

__all__ = ["Root", "as_storage", "check_root", "open_storage"]

Root = Storage | str | os.PathLike[str]
"""A checkpoint root as callers give it: a path, a URL (``s3://``, or any fsspec
protocol: ``gs://``, ``az://``, ...) or a :class:`Storage`."""


def as_storage(
    root: Root, options: IOOptions | None = None, storage_options: dict[str, Any] | None = None
) -> Storage:
    """``root`` itself if it is a :class:`Storage`, else :func:`open_storage` of it."""
    if isinstance(root, Storage):
        return root
    return open_storage(os.fspath(root), options, storage_options)


def _through_fsspec(url: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether fsspec opens ``url``: another protocol than a path's and ``s3://``, or
    ``s3://`` given ``storage_options`` (s3fs then, not boto3)."""
    return fsspec_url(url) or (url.startswith("s3://") and storage_options is not None)


def check_root(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Refuses a root that no backend opens, before anything is opened.

    Raises:
        ValueError: a URL without a bucket or prefix, or a protocol fsspec does not know
            or whose package is not installed (naming the extra to install).
    """
    if storage_options is not None and not isinstance(storage_options, dict):
        raise ValueError(f"storage_options must be a dict, got {storage_options!r}")
    scheme, sep, _ = url.partition("://")
    if scheme == "s3":
        split_url(url)
    if _through_fsspec(url, storage_options):
        check_protocol(url)
        if "/" not in url.partition("://")[2].strip("/"):
            # clear() and retention delete under the root: never a whole bucket
            raise ValueError(f"checkpoint path {url!r} must look like {scheme}://bucket/prefix")
    elif storage_options:
        raise ValueError(
            f"checkpoint path {url!r}: storage_options are for fsspec URLs (gs://, az://, "
            "s3:// through s3fs, ...); a file system path takes none"
        )


def open_storage(
    url: str,
    options: IOOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    single_writer: bool = False,
) -> Storage:
    """The :class:`Storage` of a root, doing its I/O as ``options`` say (the environment's
    :class:`IOOptions` if ``None``): a local or shared path; ``s3://bucket/prefix`` through
    boto3, or through s3fs when ``storage_options`` are given; any other fsspec URL
    through fsspec, with ``storage_options`` (``single_writer``: see
    :class:`~torchrec_cnr.storage.remote.FsspecStorage`).

    An fsspec URL given no ``storage_options`` opens with :func:`~torchrec_cnr.iocontext.storage_defaults`.

    Raises:
        ValueError: as :func:`check_root`.
    """
    check_root(url, storage_options)
    scheme, sep, rest = url.partition("://")
    if _through_fsspec(url, storage_options):
        env_options, env_single = storage_defaults()
        if storage_options is None:
            storage_options = env_options
        single_writer = single_writer or env_single
        return FsspecStorage(url, storage_options, single_writer)
    if scheme == "s3":
        return S3Storage(url)
    io = options if options is not None else IOOptions()
    return FsStorage(rest if sep else url, io.direct_writes, io.direct_reads)
