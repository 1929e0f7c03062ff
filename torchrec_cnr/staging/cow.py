"""The compiled copier of lazy staging (``_cow.c``), loaded with ctypes.

Lazy staging's two copiers, the background writer and the training thread's lookup hook,
claim rows with atomic bit operations in C instead of taking a Python lock per chunk:
neither waits for the other longer than one 64-row run, and neither needs the GIL while
it copies. ``pip install`` builds the C file into ``_cow_lib*.so`` beside this one
(``setup.py``). Where it is missing (no C compiler at install time), or switched off
(``IOOptions.compiled_staging``), or a shard's tensors are not on the CPU, lazy
staging copies with torch under the kernel's lock instead (:mod:`.lazy`).
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from torchrec_cnr.native import load_library
from torchrec_cnr.tracking import bitmap

__all__ = [
    "MAX_ARRAYS",
    "Group",
    "Rows",
    "claim_words",
    "library",
    "snapshot_bits",
    "supports",
]

MAX_ARRAYS = 8
"""A shard's weight and optimizer states, as many as ``_cow.c`` takes."""

LAYOUT = 4
"""``cnr_cow_layout()`` of the ``_cow.c`` this module speaks to."""

_i64 = ctypes.c_int64


class _Shard(ctypes.Structure):
    """``cnr_cow_shard`` of ``_cow.c``."""

    _fields_ = [
        ("n", _i64),
        ("rows", _i64),
        ("base", _i64),
        ("selected", ctypes.c_void_p),
        ("before", ctypes.c_void_p),
        ("tail", ctypes.c_void_p),
        ("tail_before", ctypes.c_void_p),
        ("stale", _i64),
        ("slot_rows", ctypes.c_void_p),
        ("claimed", ctypes.c_void_p),
        ("done", ctypes.c_void_p),
        ("arrays", ctypes.c_int32),
        ("row_bytes", _i64 * MAX_ARRAYS),
        ("src_stride", _i64 * MAX_ARRAYS),
        ("src", ctypes.c_void_p * MAX_ARRAYS),
        ("dst", ctypes.c_void_p * MAX_ARRAYS),
    ]


@functools.lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    lib = load_library(__file__, "_cow_lib", "lazy staging copies under a lock per chunk")
    if lib is None:
        return None
    lib.cnr_cow_max_arrays.restype = ctypes.c_int32
    layout = getattr(lib, "cnr_cow_layout", None)
    if layout is not None:
        layout.restype = ctypes.c_int32
    if lib.cnr_cow_max_arrays() != MAX_ARRAYS or layout is None or layout() != LAYOUT:
        raise RuntimeError(f"{lib._name}: built for another layout; reinstall torchrec_cnr")
    lib.cnr_cow_range.restype = _i64
    lib.cnr_cow_range.argtypes = [ctypes.POINTER(_Shard), _i64, _i64]
    lib.cnr_cow_lookup.restype = _i64
    lib.cnr_cow_lookup.argtypes = [ctypes.POINTER(_Shard), ctypes.c_int32, ctypes.c_void_p, _i64]
    lib.cnr_cow_snapshot.restype = _i64
    lib.cnr_cow_snapshot.argtypes = [ctypes.c_void_p] * 4 + [_i64]
    lib.cnr_cow_stored_rows.restype = _i64
    lib.cnr_cow_stored_rows.argtypes = [ctypes.POINTER(_Shard), ctypes.c_void_p,
                                        ctypes.c_void_p, _i64, ctypes.c_int32]  # fmt: skip
    return lib


def library(enabled: bool = True) -> ctypes.CDLL | None:
    """The loaded library, or ``None`` (not built, or not ``enabled``:
    ``IOOptions.compiled_staging``)."""
    return _load() if enabled else None


def supports(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether the library can copy rows of each ``(live, staged)`` pair: CPU tensors of one
    dtype whose rows are contiguous, the staged ones packed."""
    if len(pairs) > MAX_ARRAYS:
        return False
    for src, dst in pairs:
        if src.device.type != "cpu" or dst.device.type != "cpu" or src.dtype != dst.dtype:
            return False
        if src.dim() not in (1, 2) or src.shape[1:] != dst.shape[1:] or not dst.is_contiguous():
            return False
        if src.dim() == 2 and src.shape[1] > 1 and src.stride(1) != 1:
            return False
    return True


def claim_words(n: int) -> int:
    """int64 words a shard of ``n`` staged rows needs for its claims (two bits a row)."""
    return 2 * bitmap.num_words(n)


class Rows(NamedTuple):
    """One shard's rows to stage, as :class:`Group` takes them."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    """Each live tensor, ``(rows, ...)``, with its staging buffer, ``(n, ...)``."""
    rows: int
    """Rows of the shard."""
    base: int
    """Where they start in the positions the kernel's lookups report."""
    selected: tuple[torch.Tensor, torch.Tensor] | None
    """The int64 bitmap of the rows staged and its exclusive popcount prefix; ``None``:
    every row."""
    claims: torch.Tensor
    """``(claim_words(n),)`` int64, zeroed: the claimed and copied bits of the staged rows."""
    tail: tuple[torch.Tensor, torch.Tensor, int] | None = None
    """The bitmap of the staged rows stored last (a subset of ``selected``), its popcount
    prefix and the number of staged rows before them; ``None``: rows in ascending order."""


class Group:
    """The shards of one kernel staged lazily, as the library sees them.

    Every tensor handed in must stay alive, unmoved, as long as the group is used.

    Args:
        lib: :func:`library`'s value.
        shards: each shard's rows.
    """

    def __init__(self, lib: ctypes.CDLL, shards: list[Rows]) -> None:
        self._lib = lib
        self._array = (_Shard * len(shards))()
        for c, (pairs, rows, base, selected, claims, tail) in zip(self._array, shards):
            assert supports(pairs), "staged eagerly or with torch instead"
            n = pairs[0][1].shape[0]
            words = bitmap.num_words(n)
            assert claims.dtype == torch.int64 and claims.numel() == 2 * words
            c.n, c.rows, c.base = n, rows, base
            if selected is not None:
                c.selected, c.before = selected[0].data_ptr(), selected[1].data_ptr()
            if tail is not None:
                assert selected is not None, "a tail is a subset of the rows staged"
                c.tail, c.tail_before, c.stale = tail[0].data_ptr(), tail[1].data_ptr(), tail[2]
            c.claimed, c.done = claims.data_ptr(), claims.data_ptr() + 8 * words
            c.arrays = len(pairs)
            for i, (src, dst) in enumerate(pairs):
                size = src.element_size()
                c.row_bytes[i] = size * (src.shape[1] if src.dim() == 2 else 1)
                c.src_stride[i] = size * src.stride(0)
                c.src[i], c.dst[i] = src.data_ptr(), dst.data_ptr()

    def lookup(self, rows: torch.Tensor) -> int:
        """Before a lookup of ``rows`` (int64 positions, duplicates allowed): copies the rows
        held and not copied yet, and waits for those being copied. How many it copied."""
        rows = rows.contiguous()
        return int(
            self._lib.cnr_cow_lookup(self._array, len(self._array), rows.data_ptr(), rows.numel())
        )

    def stage(
        self, i: int, rows: torch.Tensor | None, ids: torch.Tensor | None, offset: int
    ) -> int:
        """The background copy of shard ``i``: where it holds some rows, their local rows in
        stored order into ``rows`` (``(n,)`` int64) and their table ids (``+ offset``) into
        ``ids`` (int32 or int64, or ``None``), without the GIL; then every staged row
        nobody has claimed (:meth:`copy`). How many it copied."""
        shard = self._array[i]
        if shard.selected:
            if rows is None or rows.numel() != shard.n:
                raise ValueError(f"a delta's copy needs a buffer for its {shard.n} rows")
            ids32 = ids is not None and ids.dtype == torch.int32
            held = int(self._lib.cnr_cow_stored_rows(
                ctypes.byref(shard), rows.data_ptr(), None if ids is None else ids.data_ptr(),
                offset, ids32,
            ))  # fmt: skip
            if held != shard.n:
                raise ValueError(f"the bitmaps of shard {i} hold {held} rows, not {shard.n}")
        return self.copy(i, rows, 0, shard.n)

    def copy(self, i: int, slot_rows: torch.Tensor | None, a: int, b: int) -> int:
        """Copies staged rows ``a:b`` of shard ``i`` that nobody has claimed; ``slot_rows``:
        the ``(n,)`` int64 local row of each staged row, in staged order (``None`` where
        every row is staged). How many it copied."""
        shard = self._array[i]
        shard.slot_rows = None if slot_rows is None else slot_rows.data_ptr()
        copied = int(self._lib.cnr_cow_range(ctypes.byref(shard), a, b))
        if copied < 0:
            raise ValueError(f"rows {a}:{b} of {shard.n}, or a delta without slot_rows")
        return copied


def snapshot_bits(
    lib: ctypes.CDLL | None,
    words: torch.Tensor,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    before: torch.Tensor,
) -> int:
    """``out = words & mask`` (``words`` if ``mask`` is ``None``) and ``before``, the set
    bits of ``out`` in the words before each; returns the set bits of ``out``. One compiled
    pass where ``lib`` is given and the bitmaps are on the CPU, torch otherwise."""
    if lib is not None and words.device.type == "cpu":
        return int(
            lib.cnr_cow_snapshot(
                words.data_ptr(),
                None if mask is None else mask.data_ptr(),
                out.data_ptr(),
                before.data_ptr(),
                words.numel(),
            )
        )
    if mask is None:
        out.copy_(words)
    else:
        torch.bitwise_and(words, mask, out=out)
    counts = bitmap.popcounts(out).to(before.device)
    torch.cumsum(counts, 0, out=before)
    before -= counts
    return int(counts.sum())
