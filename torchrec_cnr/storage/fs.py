"""Durability on a local or shared POSIX file system.

torchsnapshot's fs plugin never fsyncs; a checkpoint is durable only once every file
and directory under it is.
"""

from __future__ import annotations

import os

__all__ = ["fsync_dir", "fsync_tree", "tree_bytes"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsyncs every file and directory under ``path``."""
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def tree_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of every file under ``path``."""
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)
