"""Buffers to read into that a reader reuses once nothing views them.

A reader that reads about as many bytes again and again (a follower's warm updates) would
otherwise read each time into fresh memory, whose pages the kernel maps and zeroes on
first touch. Measured on a follower of 1 GB of fp32 tables updating 5% of rows: a third of
its CPU per update, nearly all of its system time.

Each buffer is an anonymous mapping (page-aligned, for ``O_DIRECT``) that the tensors
read into view through the buffer protocol, which holds a reference to the mapping for as
long as any tensor, view or storage of it lives. A mapping with no reference but this
pool's is free: whatever was read into it was dropped (a copy-mode update applied, say),
so the next read may overwrite it. One still viewed (a swap-mode update kept to be
replayed, rows an accept gate kept) is never handed out again.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import mmap
import sys
import threading

import torch

from torchrec_cnr.storage import DIRECT_ALIGN, DIRECT_MIN_BYTES

__all__ = ["Buffers", "advise_huge_pages", "anonymous"]

HUGE_PAGE = 2 << 20
"""The size of a huge page (x86-64, and arm64 with 4 KiB pages)."""


def anonymous(nbytes: int) -> mmap.mmap:
    """``nbytes`` of private anonymous memory, page-aligned, that the kernel may back with
    huge pages where it holds one (``madvise(MADV_HUGEPAGE)``; the host's transparent huge
    page setting rules, ``never`` turns it off).

    The first touch of fresh memory costs a page fault per page, the kernel zeroing each:
    0.49 s per GB in 4 KiB pages here against 0.10 s in 2 MiB ones, where a cold
    ``O_DIRECT`` read of that GB from this machine's disk into memory already touched took
    0.37 s."""
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE:
        with contextlib.suppress(OSError):  # a kernel built without huge pages
            memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


MIN_BYTES = DIRECT_MIN_BYTES
"""Reads smaller than this go into fresh memory: their pages cost little, and a reader of
many small pieces would otherwise hold a mapping for each."""

SLACK = 1.25
"""A new buffer holds this much more than asked for, so that a later read a little larger
(an update that changed a few more rows) fits it."""


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Advises the huge pages that lie whole inside a CPU ``tensor``'s storage for huge
    pages (``madvise(MADV_HUGEPAGE)``), memory another allocator made: pages not touched
    yet fault in as huge pages, and the kernel's ``khugepaged`` merges touched ones over
    time. For tables written at random rows (a follower's, a restore's): a row then costs
    a miss in the TLB far less often. Nothing on another device, below a huge page, or
    where the kernel or platform has no such advice."""
    if tensor.device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    end = (start + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
    if end > first:
        _libc().madvise(first, end - first, mmap.MADV_HUGEPAGE)  # EINVAL where not built in


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _references(buffers: list[mmap.mmap], i: int) -> int:
    """The reference count of ``buffers[i]``, each tensor that views it holding one."""
    return sys.getrefcount(buffers[i])


_IDLE = _references([anonymous(DIRECT_ALIGN)], 0)
"""The reference count :func:`_references` sees of a mapping held by its list alone."""


class Buffers:
    """Page-aligned buffers to read into, each reused once no tensor views it.

    A reader calls :meth:`trim` before each round of reads (a follower's update): the
    buffers free then, up to about the bytes the last round took, are kept to be handed
    out in this round, the other free ones dropped. Between rounds a reader so holds the
    memory of one round, not of the largest it ever read, and a read finds its buffer by
    a search of the kept ones, not a pass over every buffer held.
    """

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []  # every buffer held, free or in use
        self._idle: list[mmap.mmap] = []  # free at the last trim, not handed out since; by size
        self._lock = threading.Lock()
        self._taken = 0  # bytes handed out since the last trim

    def holds(self, nbytes: int) -> bool:
        """Whether a read of ``nbytes`` goes into these buffers (:data:`MIN_BYTES`)."""
        return nbytes >= MIN_BYTES

    def take(self, numel: int, dtype: torch.dtype, phase: int = 0) -> torch.Tensor:
        """An uninitialized 1-d tensor of ``numel`` elements starting ``phase`` bytes (mod
        4 KiB) past a page boundary (see :func:`~torchrec_cnr.snapshot.page_aligned`): the
        smallest buffer kept at the last trim that holds it, else a new one."""
        phase %= DIRECT_ALIGN
        need = phase + numel * dtype.itemsize
        with self._lock:
            at = bisect.bisect_left(self._idle, need, key=len)
            if at < len(self._idle):
                chosen = self._idle.pop(at)
            else:
                size = -(-int(need * SLACK) // DIRECT_ALIGN) * DIRECT_ALIGN
                chosen = anonymous(max(size, DIRECT_ALIGN))
                self._maps.append(chosen)
            self._taken += len(chosen)
            raw = torch.frombuffer(chosen, dtype=torch.uint8, count=need)  # in use from here
        return raw[phase:].view(dtype)

    def trim(self) -> None:
        """Keeps, smallest first, the free buffers that fit in the bytes taken since the
        last trim, for the next round to take; drops the other free ones."""
        with self._lock:
            keep, self._taken = self._taken, 0
            self._idle = []  # its references would make its buffers look in use
            free = [i for i in range(len(self._maps)) if _references(self._maps, i) == _IDLE]
            dropped: set[int] = set()
            for i in sorted(free, key=lambda i: len(self._maps[i])):
                if len(self._maps[i]) <= keep:
                    keep -= len(self._maps[i])
                    self._idle.append(self._maps[i])
                else:
                    dropped.add(i)
            self._maps = [m for i, m in enumerate(self._maps) if i not in dropped]

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer held, free or in use."""
        with self._lock:
            return sum(len(m) for m in self._maps)
