"""Storage that wraps another: one pass-through, for whoever needs to watch or refuse
operations (a read-only follower counting its bytes; the tests' fault injection).

:class:`StorageWrapper` passes every :class:`~torchrec_cnr.storage.Storage` operation to
the wrapped one, calling :meth:`StorageWrapper.before` first with the operation's name
and object; a subclass overrides ``before`` (and nothing else, usually).
"""

from __future__ import annotations

import threading
from typing import Any

from torchrec_cnr.errors import CnrError
from torchrec_cnr.storage.backend import ANY, Storage, _Any

__all__ = ["CountingStorage", "StorageWrapper"]

WRITES = frozenset({"write", "write_object", "delete", "delete_tree", "clear", "make_durable"})
"""The operations that change a root."""


class StorageWrapper(Storage):
    """Passes every operation to ``inner``, after :meth:`before`."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.request_bytes = inner.request_bytes
        self.many_requests = inner.many_requests

    def before(self, op: str, name: str) -> None:
        """Called before each operation ``op`` (a :class:`Storage` method) on ``name``."""

    def path(self, name: str) -> str:
        return self.inner.path(name)

    def read(self, name: str) -> tuple[bytes, str] | None:
        self.before("read", name)
        return self.inner.read(name)

    def stamp(self, name: str) -> str | None:
        self.before("stamp", name)
        return self.inner.stamp(name)

    def read_into(self, name: str, offset: int, out: memoryview, cached: bool = False) -> None:
        self.before("read_into", name)
        self.inner.read_into(name, offset, out, cached)

    def write(self, name: str, data: bytes, expect: str | None | _Any = ANY) -> str:
        self.before("write", name)
        return self.inner.write(name, data, expect)

    def write_object(self, name: str, data: memoryview) -> None:
        self.before("write_object", name)
        self.inner.write_object(name, data)

    def exists(self, name: str) -> bool:
        self.before("exists", name)
        return self.inner.exists(name)

    def children(self) -> list[str]:
        self.before("children", "")
        return self.inner.children()

    def delete(self, name: str) -> None:
        self.before("delete", name)
        self.inner.delete(name)

    def delete_tree(self, name: str) -> None:
        self.before("delete_tree", name)
        self.inner.delete_tree(name)

    def clear(self) -> None:
        self.before("clear", "")
        self.inner.clear()

    def tree_bytes(self, name: str) -> int:
        self.before("tree_bytes", name)
        return self.inner.tree_bytes(name)

    def make_durable(self, name: str) -> None:
        self.before("make_durable", name)
        self.inner.make_durable(name)

    def create(self) -> None:
        self.before("create", "")
        self.inner.create()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class CountingStorage(StorageWrapper):
    """Counts the requests made, the bytes read and the bytes of the small objects written
    whole (:meth:`Storage.write`: the manifest, records, segments, the lease; not the
    tensors' data objects); refuses writes if ``read_only``."""

    def __init__(self, inner: Storage, read_only: bool = False) -> None:
        super().__init__(inner)
        self.read_only = read_only
        self.requests = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self._lock = threading.Lock()

    def before(self, op: str, name: str) -> None:
        if self.read_only and op in WRITES:
            raise CnrError(f"{self.url} is opened read-only: no {op} of {name!r}")
        with self._lock:
            self.requests += 1

    def read(self, name: str) -> tuple[bytes, str] | None:
        got = super().read(name)
        with self._lock:
            self.bytes_read += 0 if got is None else len(got[0])
        return got

    def read_into(self, name: str, offset: int, out: memoryview, cached: bool = False) -> None:
        super().read_into(name, offset, out, cached)
        with self._lock:
            self.bytes_read += len(out)

    def write(self, name: str, data: bytes, expect: str | None | _Any = ANY) -> str:
        version = super().write(name, data, expect)
        with self._lock:
            self.bytes_written += len(data)
        return version
