"""A checkpoint root on a local or shared POSIX file system.

A checkpoint is durable only once every file and directory under it is. Data objects of a
MiB or more are written and read with ``O_DIRECT`` (:class:`_Direct`): the disk takes the
bytes straight from the writer's buffers and gives them straight to the reader's, so a
checkpoint neither fills the page cache nor pays for fresh page-cache pages. Where the file
system refuses ``O_DIRECT`` (some FUSE and network file systems), or with
``IOOptions(direct_writes=False)`` / ``direct_reads=False``, they go through the page
cache, write-back started as each object is written. :meth:`FsStorage.make_durable` fsyncs
them, drops their pages, and syncs the directories.

Small objects (the manifest, the lease) are replaced atomically: a temporary file, fsync,
rename, fsync of the directory. Conditional writes compare the object's digest under an
``flock`` on ``ROOT/.cnr.lock``, which serializes them across processes of one host and
across hosts on file systems whose locks are coherent (local disks; not every NFS setup).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from torchrec_cnr.storage.backend import ANY, PreconditionFailed, Storage, _Any, truncated

__all__ = ["FsStorage", "fsync_dir", "out_of_space", "replacing", "tree_bytes"]

log = logging.getLogger(__name__)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _libc_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()


def _start_writeback(fd: int) -> None:
    """Starts writing a file's dirty pages back without waiting (Linux's
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``): the disk works while the other objects
    are written, and the final fsync has less left to wait for."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE; a failure leaves it to fsync


def _fsync_and_drop(path: Path) -> None:
    """fsyncs a written object, then drops its pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _address(data: memoryview) -> int:
    return int(np.frombuffer(data, dtype=np.uint8).ctypes.data) if len(data) else 0


DIRECT_ALIGN = 4096
"""The alignment ``O_DIRECT`` transfers need (of address, offset and length): the
device's block, which 4 KiB covers for every common one."""
DIRECT_MIN_BYTES = 1 << 20
"""Objects smaller than this go through the page cache: a direct request waits for
the disk, which costs more than a page-cache copy for small ones."""


class _Direct:
    """``O_DIRECT`` transfers of one storage's large objects.

    ``O_DIRECT`` wants the memory address, the file offset and the length aligned to the
    device's block (4 KiB covers every common one). A buffer that is aligned (the staging
    pool's) goes to the disk as it is; any other passes through a
    per-thread aligned bounce buffer, a memory copy far faster than the disk. The unaligned
    tail of an object, under 4 KiB, is written through the page cache on the same file.
    Reads into an aligned buffer at an aligned offset go straight into it; others fetch
    the aligned span around the wanted bytes into the bounce buffer and copy out. The
    first refusal (``EINVAL``: the file system does not do direct I/O) switches the
    storage to the page cache for good, said once in the log.
    """

    BOUNCE = 8 << 20

    def __init__(self, writes: bool, reads: bool) -> None:
        self.writes, self.reads = writes, reads
        self._local = threading.local()

    def attempt(self, path: Path, flags: int, transfer: Callable[[int], int]) -> int | None:
        """``transfer(fd)`` on ``path`` opened with ``flags | O_DIRECT``; ``None`` where the
        file system refuses ``O_DIRECT``, which turns it off for this storage, said once."""
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
            try:
                return transfer(fd)
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            if self.writes or self.reads:
                self.writes = self.reads = False
                log.info("%s: O_DIRECT refused (%s); using the page cache", path.parent, e)
            return None

    def _bounce(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(mmap.mmap(-1, self.BOUNCE))  # page-aligned
        return buf

    def write(self, fd: int, data: memoryview) -> int:
        """Writes ``data`` at offset 0 of the ``O_DIRECT`` file ``fd``; returns its length."""
        bulk = len(data) - len(data) % DIRECT_ALIGN
        done = 0
        if _address(data) % DIRECT_ALIGN == 0:
            while done < bulk:
                done += os.pwrite(fd, data[done:bulk], done)
        else:
            bounce = self._bounce()
            dst = np.frombuffer(bounce, dtype=np.uint8)
            src = np.frombuffer(data, dtype=np.uint8)
            while done < bulk:
                n = min(len(bounce), bulk - done)
                np.copyto(dst[:n], src[done : done + n])  # releases the GIL
                at = 0
                while at < n:
                    at += os.pwrite(fd, bounce[at:n], done + at)
                done += n
        if done < len(data):  # the tail, through the page cache
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            while done < len(data):
                done += os.pwrite(fd, data[done:], done)
        return done

    def read(self, fd: int, offset: int, out: memoryview) -> int:
        """Reads into ``out`` from ``offset`` of the ``O_DIRECT`` file ``fd``; returns the
        bytes read (fewer at the end of the file). Where ``out`` lies as far from a block
        boundary as ``offset`` (:func:`~torchrec_cnr.snapshot.reader.page_aligned`'s
        ``phase``), only the first partial block passes through the bounce buffer."""
        done = 0
        head = -offset % DIRECT_ALIGN
        if head and (_address(out) + head) % DIRECT_ALIGN == 0 and len(out) > head:
            done = self._bounced(fd, offset, out, 0, head)
            if done < head:  # the end of the file
                return done
        if (_address(out) + done) % DIRECT_ALIGN == 0 and (offset + done) % DIRECT_ALIGN == 0:
            bulk = len(out) - (len(out) - done) % DIRECT_ALIGN  # straight into the buffer
            while done < bulk:
                want = bulk - done
                got = os.preadv(fd, [out[done:bulk]], offset + done)
                done += got
                if got < want:  # the end of the file
                    return done
        return self._bounced(fd, offset, out, done, len(out))

    def _bounced(self, fd: int, offset: int, out: memoryview, done: int, stop: int) -> int:
        """Reads ``out[done:stop]`` through the bounce buffer; returns where it stopped
        (before ``stop`` at the end of the file)."""
        bounce = self._bounce()
        src = np.frombuffer(bounce, dtype=np.uint8)
        dst = np.frombuffer(out, dtype=np.uint8)
        while done < stop:
            pos = offset + done
            start = pos - pos % DIRECT_ALIGN
            skip = pos - start
            want = min(len(bounce), -(-(skip + stop - done) // DIRECT_ALIGN) * DIRECT_ALIGN)
            got = os.preadv(fd, [bounce[:want]], start)
            n = min(got - skip, stop - done)
            if n <= 0:
                break
            np.copyto(dst[done : done + n], src[skip : skip + n])
            done += n
            if got < want:
                break
        return done


@contextlib.contextmanager
def replacing(target: Path) -> Iterator[Path]:
    """A file beside ``target`` for the block to write; once it ends, made durable and
    renamed over ``target``, its folder synced: a reader finds the old file or the whole
    new one, never part of it. Where the block or the sync fails, ``target`` stays as it
    was and the file is removed."""
    draft = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        yield draft
        fd = os.open(draft, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(draft, target)
    except BaseException:
        draft.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


FULL_BYTES = 1 << 20
"""Less room than this left on a file system after a write failed: the disk was full."""


@contextlib.contextmanager
def out_of_space(path: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Raises what the block raises, or, where the file system of ``path`` (or of its
    nearest existing folder) has less than :data:`FULL_BYTES` left after it failed, an
    ``OSError`` (ENOSPC) saying that ``what`` does not fit, from the error: torch's
    serializers report a write that a full disk cut short as a bad position
    (``unexpected pos``), not as a full disk."""
    try:
        yield
    except Exception as e:
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or not _full(path):
            raise
        raise OSError(errno.ENOSPC, f"no space left on device: {what} does not fit") from e


def _full(path: str | os.PathLike[str]) -> bool:
    at = Path(path).absolute()
    while not at.exists() and at != at.parent:
        at = at.parent
    try:
        st = os.statvfs(at)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BYTES


def tree_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of every file under ``path``."""
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FsStorage(Storage):
    """A root directory on a POSIX file system."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        direct_writes: bool = True,
        direct_reads: bool = True,
    ) -> None:
        """``direct_writes``, ``direct_reads``: ``O_DIRECT`` for objects of a MiB or more
        where the file system allows it (``IOOptions.direct_writes``, ``.direct_reads``)."""
        self.root = Path(path)
        self.url = str(path)
        self._direct = _Direct(direct_writes, direct_reads)
        self._unsynced: set[str] = set()  # objects written but not yet fsynced
        self._unsynced_lock = threading.Lock()

    def path(self, name: str) -> str:
        return str(self.root / name)

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def read(self, name: str) -> tuple[bytes, str] | None:
        try:
            data = (self.root / name).read_bytes()
        except FileNotFoundError:
            return None
        return data, _digest(data)

    def read_into(self, name: str, offset: int, out: memoryview, cached: bool = False) -> None:
        path = self.root / name
        done = 0
        if self._direct.reads and not cached and len(out) >= DIRECT_MIN_BYTES:
            direct = self._direct
            done = direct.attempt(path, os.O_RDONLY, lambda fd: direct.read(fd, offset, out)) or 0
            if done == len(out):
                return
        fd = os.open(path, os.O_RDONLY)
        try:
            while done < len(out):
                n = os.preadv(fd, [out[done:]], offset + done)
                if n == 0:
                    size = os.fstat(fd).st_size
                    raise truncated(str(self.root / name), size, offset, offset + len(out))
                done += n
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".cnr.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def write(self, name: str, data: bytes, expect: str | None | _Any = ANY) -> str:
        target = self.root / name
        with self._locked():
            if expect is not ANY:
                current = self.read(name)
                found = None if current is None else current[1]
                if found != expect:
                    raise PreconditionFailed(
                        f"{target}: expected version {expect}, found {found or 'no object'}"
                    )
            target.parent.mkdir(parents=True, exist_ok=True)
            with replacing(target) as draft:
                draft.write_bytes(data)
        return _digest(data)

    def write_object(self, name: str, data: memoryview) -> None:
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        direct = self._direct
        if direct.writes and len(data) >= DIRECT_MIN_BYTES:
            if direct.attempt(target, flags, lambda fd: direct.write(fd, data)) is not None:
                self._written(name)
                return
        fd = os.open(target, flags, 0o644)
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
            _start_writeback(fd)
        finally:
            os.close(fd)
        self._written(name)

    def _written(self, name: str) -> None:
        with self._unsynced_lock:
            self._unsynced.add(name)

    def stamp(self, name: str) -> str | None:
        try:  # a replaced object is a new file (written aside, then renamed over)
            st = (self.root / name).stat()
        except FileNotFoundError:
            return None
        return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"

    def exists(self, name: str) -> bool:
        return (self.root / name).exists()

    def children(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def delete_tree(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def tree_bytes(self, name: str) -> int:
        return tree_bytes(self.root / name)

    def make_durable(self, name: str) -> None:
        path = self.root / name
        # The objects this process wrote under ``name``, then the entries that name
        # them, in every directory down from the root. Once durable, an object's pages
        # leave the page cache: a checkpoint is rarely read back soon, and a page cache
        # full of old checkpoints made every later write reclaim pages first (buffered
        # writes of 2 GB took 2.6 s instead of 0.25 s, measured).
        with self._unsynced_lock:
            mine = {n for n in self._unsynced if n.startswith(name + "/")}
            self._unsynced -= mine
        for n in sorted(mine):
            _fsync_and_drop(self.root / n)
        for dirpath, _, _ in os.walk(path):
            fsync_dir(dirpath)
        fsync_dir(path.parent)
