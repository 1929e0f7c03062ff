"""Everything the library does to a checkpoint root, behind one small interface.

A root is a local or shared file system path, or an object store URL (``s3://bucket/prefix``).
The :class:`Storage` holds checkpoint data objects (written once, in parallel), the
manifest and lease objects (with conditional writes, so that a stale writer's commit fails
instead of overwriting), and does listing, deleting, sizes, and durability where it means
something.

Names are relative to the root and use ``/``.
"""

from __future__ import annotations

import abc
from typing import Final

__all__ = ["ANY", "PreconditionFailed", "Storage", "truncated"]


class _Any:
    def __repr__(self) -> str:
        return "ANY"


ANY: Final = _Any()
"""``write(..., expect=ANY)``: write whatever the object holds now."""


class PreconditionFailed(Exception):
    """A conditional write found another version than the one it expected."""


def truncated(path: str, size: int, offset: int, end: int) -> OSError:
    """The error of a read of bytes ``offset`` to ``end`` of object ``path``, which holds
    only ``size`` bytes."""
    return OSError(
        f"{path} holds {size} bytes, fewer than the {end} this read needs "
        f"(bytes {offset} to {end}): truncated"
    )


class Storage(abc.ABC):
    """The operations on a checkpoint root.

    Versions are opaque strings (an ETag on an object store, a content digest on a file
    system) that change whenever an object is replaced.
    """

    url: str
    """The root as the user gave it, e.g. ``/ckpt/run1`` or ``s3://bucket/run1``."""

    request_bytes: int = 128 * 1024
    """About as many bytes as one more request costs to read (a local disk's request
    costs about 0.1 ms, the time to read 100-200 KB here)."""
    many_requests: int = 1024
    """Requests for one tensor's rows beyond which a read of some rows also reads the gaps
    between them up to :attr:`request_bytes`, rather than make those requests (about
    0.1 s of requests)."""

    @abc.abstractmethod
    def path(self, name: str) -> str:
        """The URL or path of ``name`` under the root, for messages."""

    @abc.abstractmethod
    def read(self, name: str) -> tuple[bytes, str] | None:
        """The bytes of object ``name`` and their version; ``None`` if it does not exist."""

    def stamp(self, name: str) -> str | None:
        """A token that changes whenever object ``name`` is replaced, found without reading
        it where the store allows (a stat, a HEAD request); ``None`` if it does not exist.
        Not a :meth:`read` version: only compare stamps with stamps."""
        got = self.read(name)
        return None if got is None else got[1]

    @abc.abstractmethod
    def read_into(self, name: str, offset: int, out: memoryview, cached: bool = False) -> None:
        """Fills ``out`` with the bytes of object ``name`` from ``offset`` on; ``cached``:
        through the host's cache where the store has one, for bytes read again soon (a
        restore's verify pass, see ``restore.apply``).

        Raises:
            OSError: the object is missing or shorter than ``offset + len(out)``.
        """

    @abc.abstractmethod
    def write(self, name: str, data: bytes, expect: str | None | _Any = ANY) -> str:
        """Replaces object ``name`` with ``data`` as one atomic step; returns the new version.

        Args:
            expect: the version the object must have now (a compare-and-swap), ``None`` if
                it must not exist yet, or :data:`ANY`.

        Raises:
            PreconditionFailed: the object is not at ``expect``; nothing was written.
        """

    @abc.abstractmethod
    def write_object(self, name: str, data: memoryview) -> None:
        """Writes a data object of a checkpoint directory that is not committed yet.

        Durable once :meth:`make_durable` of its folder returns (a PUT is durable when
        it returns; a file is fsynced there), and not atomic: a crash may leave part of
        it, which is harmless in a directory that no committed manifest names. Called
        from many threads at once.
        """

    @abc.abstractmethod
    def exists(self, name: str) -> bool:
        """Whether object ``name`` exists."""

    @abc.abstractmethod
    def children(self) -> list[str]:
        """Names of the folders (checkpoint directories) directly under the root."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Deletes object ``name`` if it exists."""

    @abc.abstractmethod
    def delete_tree(self, name: str) -> None:
        """Deletes the folder ``name`` and everything under it, if it exists."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Deletes everything under the root."""

    @abc.abstractmethod
    def tree_bytes(self, name: str) -> int:
        """Bytes of every object under folder ``name``."""

    @abc.abstractmethod
    def make_durable(self, name: str) -> None:
        """Makes everything this process wrote under folder ``name`` survive a crash of
        this host: its data objects and the entries that name them."""

    def create(self) -> None:  # noqa: B027 - most backends need nothing
        """Creates the root if the backend needs it to exist."""
