"""Writes whole rows of a table by index at memory speed: ``dst[index] = src``.

torch's ``index_copy_`` and ``index_put_`` on CPU walk a ``(rows, cols)`` tensor element by
element: 80k rows of 64 fp32 into a 1M-row table take 15-17 ms here against 2-5 ms for
numpy's assignment of the same rows seen as fixed-size records, and a memcpy of their
bytes 1.4-2 ms. A follower writes every update so, a restore every delta, compaction
every merged delta, and lazy staging's torch copier (where the compiled one is not used)
the rows it copies before their update. A small C loop (``_rowcopy.c``) writes them
with non-temporal stores into a table of :data:`STREAM_BYTES` or more (a memcpy's time:
no cache line is read before it is filled), and asks for each row's cache lines a few
rows ahead into a smaller one; numpy's assignment runs where it was not built. Both
release the GIL.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np
import torch

from torchrec_cnr.native import load_library

__all__ = ["STREAM_BYTES", "put_rows", "run_start"]

STREAM_BYTES = 32 << 20
"""Tables of this many bytes or more, larger than a CPU's caches, are written with
non-temporal stores (x86-64, rows 16-byte aligned); smaller ones through the caches,
where the rows may still be when they are next read."""


def _records(t: torch.Tensor) -> Any:
    """A CPU tensor of ``n`` rows, each contiguous, as a numpy array of ``n`` records of
    a row's bytes, sharing its memory (a column slice of a table included)."""
    n = t.shape[0]
    flat = t.detach().reshape(n, -1).view(torch.uint8)
    return flat.numpy().view(np.dtype((np.void, flat.shape[1]))).reshape(n)


def _as_records(t: torch.Tensor) -> bool:
    return (
        t.device.type == "cpu"
        and t.numel() > 0
        and t.stride(-1) == 1
        and (t.dim() == 1 or t[0].is_contiguous())
    )


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = load_library(__file__, "_rowcopy_lib", "rows are written by numpy, about 2x slower")
    if lib is not None:
        lib.cnr_put_rows.restype = ctypes.c_int64
        lib.cnr_put_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # fmt: skip
    return lib


def _scatter(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[index] = src`` for rows each contiguous (:func:`_as_records`)."""
    index = index.to(device="cpu", dtype=torch.int64).contiguous()
    lib = _library()
    if lib is None:
        if int(index.min()) < 0 or int(index.max()) >= dst.shape[0]:  # numpy would wrap
            raise IndexError(f"rows {index.min()}..{index.max()} of {dst.shape[0]}")
        _records(dst)[index.numpy()] = _records(src)
        return
    size = dst.element_size()
    row_bytes = size * (dst[0].numel() if dst.dim() > 1 else 1)
    done = lib.cnr_put_rows(dst.data_ptr(), dst.shape[0], dst.stride(0) * size,
                            src.data_ptr(), src.stride(0) * size, index.data_ptr(),
                            index.numel(), row_bytes, STREAM_BYTES)  # fmt: skip
    if done < 0:
        raise IndexError(f"row {int(index[-1 - done])} of a table of {dst.shape[0]} rows")


def run_start(index: torch.Tensor) -> int | None:
    """The first row of ``index`` if it is a run of consecutive rows, ascending (``None``
    otherwise, or if it is empty)."""
    if not index.numel():
        return None
    k, first = index.numel(), int(index[0])
    if int(index[-1]) - first != k - 1 or (k > 1 and not bool((index[1:] > index[:-1]).all())):
        return None
    return first


def put_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[index] = src`` along the first dimension (``index``: distinct rows), ``src``
    converted to ``dst``'s dtype and device: one block copy where ``index`` is a run of
    consecutive rows (a whole table, a run of a delta)."""
    if not index.numel():
        return
    if index.numel() != src.shape[0]:
        raise ValueError(f"{index.numel()} rows indexed, {src.shape[0]} given")
    if src.dtype != dst.dtype or src.device != dst.device:
        src = src.to(device=dst.device, dtype=dst.dtype)
    first = run_start(index)
    if first is not None:
        if first < 0 or first + index.numel() > dst.shape[0]:
            raise IndexError(f"rows {first}..{first + index.numel() - 1} of {dst.shape[0]}")
        with torch.no_grad():
            dst[first : first + index.numel()].copy_(src)
        return
    if _as_records(dst) and _as_records(src) and src.shape[1:] == dst.shape[1:]:
        _scatter(dst, index, src)
        return
    with torch.no_grad():
        dst.index_copy_(0, index.to(dst.device), src)
