"""A checkpoint root in any store fsspec reaches: ``gs://``, ``az://``/``abfs://``,
``hdfs://``, ``memory://``, and ``s3://`` through s3fs when ``storage_options`` are given.

The options (credentials, an endpoint, a project) go to the file system's constructor as
:func:`fsspec.core.url_to_fs` passes them. Data objects are plain PUTs and ranged GETs.

The manifest and the lease need conditional writes (a compare-and-swap, see
:class:`~torchrec_cnr.storage.Storage`). Each store that has them uses its own:

=================  =======================  =====================================
store              create only              compare-and-swap
=================  =======================  =====================================
S3 (s3fs)          ``If-None-Match: *``     ``If-Match`` on the ETag
GCS (gcsfs)        ``ifGenerationMatch=0``  ``ifGenerationMatch`` on the generation
Azure (adlfs)      ``overwrite=False``      ``If-Match`` on the ETag
``memory://``      a lock of this process (the store lives in one process)
=================  =======================  =====================================

A version, as :meth:`FsspecStorage.read` returns it, is a digest of the bytes, so it is
exact whatever the store reports; the store's own token (ETag, generation) guards the
write. Before its first conditional write a writer checks that the store honours the
condition (it creates one probe object twice: the second must be refused); a store that
does not (HDFS, most emulators, a gateway that drops the headers) is refused with
:class:`~torchrec_cnr.errors.CheckpointError`, unless ``single_writer=True`` declares that
one job at a time writes the root: then the lease is still written and read, and still
names a live holder to a second job, but two jobs claiming in the same instant are not
told apart.
"""

from __future__ import annotations

import hashlib
import importlib.util
import threading
import uuid
from typing import Any

from torchrec_cnr.errors import CheckpointError
from torchrec_cnr.storage.backend import ANY, PreconditionFailed, Storage, _Any, truncated

__all__ = ["EXTRAS", "FsspecStorage", "check_protocol", "fsspec_url"]

EXTRAS = {
    "gs": ("gcs", "gcsfs"),
    "gcs": ("gcs", "gcsfs"),
    "az": ("azure", "adlfs"),
    "abfs": ("azure", "adlfs"),
    "abfss": ("azure", "adlfs"),
    "s3": ("s3", "s3fs"),
    "s3a": ("s3", "s3fs"),
    "hdfs": ("hdfs", "pyarrow"),
}
"""Each protocol's ``torchrec_cnr[...]`` extra, and the package it installs."""

_MEMORY_LOCK = threading.Lock()


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fsspec_url(url: str) -> bool:
    """Whether ``url`` names a protocol that only fsspec opens (not a path, ``file://`` or ``s3://``)."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme not in ("file", "s3")


def _refused(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a store refusing a conditional write."""
    seen: BaseException | None = error
    for _ in range(4):
        if seen is None:
            return False
        if isinstance(seen, FileExistsError):
            return True
        if type(seen).__name__ in ("ResourceModifiedError", "ResourceExistsError"):
            return True  # Azure: If-Match failed, or the blob exists
        if getattr(seen, "code", None) == 412 or getattr(seen, "status_code", None) == 412:
            return True  # GCS, Azure
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            error_part = response.get("Error", {})
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if error_part.get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                return True
            if status in (409, 412):
                return True  # S3: If-Match failed, or a write raced this one
        seen = seen.__cause__ or seen.__context__
    return False


class _Conditions:
    """How one kind of store writes an object only if it is at a known version."""

    token_key: str = ""
    """The field of ``fs.info()`` that changes whenever the object is replaced."""

    def put(self, fs: Any, path: str, data: bytes, token: Any) -> None:
        """Writes ``data`` to ``path`` if the object is at ``token`` (``None``: if it does
        not exist); raises :class:`PreconditionFailed` otherwise."""
        try:
            self._put(fs, path, data, token)
        except Exception as e:
            if _refused(e):
                raise PreconditionFailed(f"{path}: the store refused the conditional write") from e
            raise

    def _put(self, fs: Any, path: str, data: bytes, token: Any) -> None:
        raise NotImplementedError


class _S3(_Conditions):
    token_key = "ETag"

    def _put(self, fs: Any, path: str, data: bytes, token: Any) -> None:
        if token is None:
            fs.pipe_file(path, data, mode="create")
        else:
            fs.pipe_file(path, data, IfMatch=token)


class _Azure(_Conditions):
    token_key = "etag"

    def _put(self, fs: Any, path: str, data: bytes, token: Any) -> None:
        if token is None:
            fs.pipe_file(path, data, overwrite=False)
        else:
            from azure.core import MatchConditions

            fs.pipe_file(
                path,
                data,
                overwrite=True,
                etag=token,
                match_condition=MatchConditions.IfNotModified,
            )


class _Gcs(_Conditions):
    token_key = "generation"

    def _put(self, fs: Any, path: str, data: bytes, token: Any) -> None:
        if token is None:
            fs.pipe_file(path, data, mode="create")
            return
        bucket, key, _ = fs.split_path(path)
        # gcsfs's pipe_file takes no generation: a media upload of the JSON API does.
        fs.call(
            "POST",
            f"{fs._location}/upload/storage/v1/b/{bucket}/o",
            uploadType="media",
            name=key,
            ifGenerationMatch=str(token),
            headers={"Content-Type": "application/octet-stream"},
            data=data,
            json_out=True,
        )
        fs.invalidate_cache(path)


class _Memory(_Conditions):
    """``memory://`` lives in one process: its lock is the whole condition."""

    token_key = ""

    def _put(self, fs: Any, path: str, data: bytes, token: Any) -> None:
        fs.pipe_file(path, data)


_CONDITIONS: dict[str, type[_Conditions]] = {
    "s3": _S3,
    "s3a": _S3,
    "gs": _Gcs,
    "gcs": _Gcs,
    "az": _Azure,
    "abfs": _Azure,
    "abfss": _Azure,
    "memory": _Memory,
}


def check_protocol(url: str) -> None:
    """Refuses ``url`` if fsspec does not know its protocol or its package is missing.

    Raises:
        ValueError: naming the extra that installs the package.
    """
    import fsspec  # torchsnapshot installs it

    scheme = url.partition("://")[0]
    extra, package = EXTRAS.get(scheme, (None, None))
    try:
        fsspec.get_filesystem_class(scheme)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ImportError(f"{package} is not installed")
    except (ImportError, ValueError) as e:
        install = f"pip install 'torchrec_cnr[{extra}]'" if extra else "install its fsspec package"
        raise ValueError(
            f"checkpoint path {url!r}: fsspec cannot open {scheme}:// here ({e}); {install}"
        ) from e


def _open(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """The fsspec file system of ``url`` and the root's path in it (as :func:`check_protocol`)."""
    import fsspec.core

    check_protocol(url)
    options = {"use_listings_cache": False, **storage_options}
    return fsspec.core.url_to_fs(url, **options)  # type: ignore[no-any-return]


class FsspecStorage(Storage):
    """A folder in a store fsspec opens.

    Args:
        url: the root, e.g. ``gs://bucket/run1`` or ``az://container/run1``.
        storage_options: keyword arguments of the store's file system (credentials, an
            endpoint...), as fsspec takes them.
        single_writer: allow a store without conditional writes (see the module).

    Raises:
        ValueError: as :func:`check_protocol`.
    """

    request_bytes = 2 * 2**20
    """A request costs milliseconds, as on S3."""
    many_requests = 32

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, single_writer: bool = False
    ) -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.single_writer = single_writer
        self.protocol = url.partition("://")[0]
        self.fs, root = _open(url, self.storage_options)
        self.root = root.rstrip("/")
        kind = _CONDITIONS.get(self.protocol)
        self._conditions = kind() if kind is not None else None
        self._checked = False
        self._lock = _MEMORY_LOCK if self.protocol == "memory" else threading.Lock()

    def __reduce__(self) -> Any:  # a writer process opens its own
        return (FsspecStorage, (self.url, self.storage_options, self.single_writer))

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def path(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    def _token(self, path: str) -> Any:
        self.fs.invalidate_cache(path)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        if self._conditions is None or not self._conditions.token_key:
            return True  # exists; the lock or the single writer stands in for a version
        return info.get(self._conditions.token_key)

    def read(self, name: str) -> tuple[bytes, str] | None:
        try:
            data = self.fs.cat_file(self._path(name))
        except FileNotFoundError:
            return None
        return data, _digest(data)

    def _read_at_token(self, path: str) -> tuple[bytes | None, Any]:
        """The object's bytes and the store's token of those very bytes (``None, None`` if
        it does not exist): the token is read before and after, until both agree."""
        for _ in range(10):
            token = self._token(path)
            if token is None:
                return None, None
            try:
                data = self.fs.cat_file(path)
            except FileNotFoundError:
                continue
            if self._token(path) == token:
                return data, token
        raise PreconditionFailed(f"{path}: the object keeps changing")

    def read_into(self, name: str, offset: int, out: memoryview, cached: bool = False) -> None:
        if not len(out):
            return
        end = offset + len(out)
        path = self._path(name)
        try:
            data = self.fs.cat_file(path, start=offset, end=end)
        except FileNotFoundError:
            raise
        except Exception as e:  # a range past the end: each store says it its own way
            size = int(self.fs.info(path)["size"])
            if size >= end:
                raise
            raise truncated(self.path(name), size, offset, end) from e
        if len(data) != len(out):
            raise truncated(self.path(name), int(self.fs.info(path)["size"]), offset, end)
        out[:] = data

    def check_conditions(self) -> None:
        """Checks once that the store refuses a conditional write it should refuse.

        Raises:
            CheckpointError: it does not (or has none) and ``single_writer`` is not set.
        """
        if self._checked or self.single_writer:
            return
        why = None
        if self._conditions is None:
            why = f"{self.protocol}:// has no conditional writes that this library knows"
        elif self.protocol != "memory":
            probe = self._path(f".cnr-probe-{uuid.uuid4().hex}")
            try:
                self._conditions.put(self.fs, probe, b"1", None)
                try:
                    self._conditions.put(self.fs, probe, b"2", None)
                    why = f"the store behind {self.url} ignores conditional writes (a create-only write replaced an object)"
                except PreconditionFailed:
                    pass
            finally:
                try:
                    self.fs.rm_file(probe)
                except FileNotFoundError:
                    pass
        if why is not None:
            raise CheckpointError(
                f"{why}, so two jobs writing {self.url} at once could overwrite each "
                "other's commits; if only one job at a time writes this root, say so with "
                "CheckpointConfig(single_writer=True)"
            )
        self._checked = True

    def write(self, name: str, data: bytes, expect: str | None | _Any = ANY) -> str:
        path = self._path(name)
        if expect is ANY:
            self.fs.pipe_file(path, data)
            return _digest(data)
        self.check_conditions()
        with self._lock:
            current, token = self._read_at_token(path)
            found = None if current is None else _digest(current)
            if found != expect:
                raise PreconditionFailed(
                    f"{self.path(name)}: expected version {expect}, found {found or 'no object'}"
                )
            if self._conditions is None:  # single_writer
                self.fs.pipe_file(path, data)
            else:
                self._conditions.put(self.fs, path, data, token)
        return _digest(data)

    def write_object(self, name: str, data: memoryview) -> None:
        self.fs.pipe_file(self._path(name), bytes(data))

    def stamp(self, name: str) -> str | None:
        token = self._token(self._path(name))
        if token is None or token is True:
            got = self.read(name)  # no token: the digest
            return None if got is None else got[1]
        return str(token)

    def exists(self, name: str) -> bool:
        return self._token(self._path(name)) is not None

    def children(self) -> list[str]:
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return sorted(
            e["name"].rstrip("/").rpartition("/")[2] for e in entries if e["type"] == "directory"
        )

    def _files(self, name: str) -> dict[str, dict[str, Any]]:
        path = self._path(name)
        self.fs.invalidate_cache(path)
        try:
            return dict(self.fs.find(path, detail=True))
        except FileNotFoundError:
            return {}

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self._path(name))
        except FileNotFoundError:
            pass

    def delete_tree(self, name: str) -> None:
        files = list(self._files(name))
        try:
            if files:
                self.fs.rm(files)
        except FileNotFoundError:
            # Another deleter got some first (a taken-over job removing its failed
            # checkpoint while the new writer sweeps it): the rest one by one.
            for path in files:
                try:
                    self.fs.rm_file(path)
                except FileNotFoundError:
                    pass
        if self.protocol in ("memory", "hdfs"):  # stores with real folders
            try:
                self.fs.rm(self._path(name), recursive=True)
            except FileNotFoundError:
                pass

    def clear(self) -> None:
        self.delete_tree("")

    def tree_bytes(self, name: str) -> int:
        return sum(int(info.get("size") or 0) for info in self._files(name).values())

    def make_durable(self, name: str) -> None:
        return None  # an object is durable once its PUT returns

    def create(self) -> None:
        self.check_conditions()
