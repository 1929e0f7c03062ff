"""The compiled range search (``_rowsearch.c``), loaded with ctypes.

``pip install`` builds the C file, with its AVX2 and AVX-512 builds (``_rowsearch_avx2.c``,
``_rowsearch_avx512.c``), into ``_rowsearch_lib*.so`` beside this one (``setup.py``).
ctypes releases the GIL for the call, so the checkpoint writer's encode threads search in
parallel. Where the library is missing (no C compiler at install time) or the caller
switches it off (``IOOptions.compiled_search``), :func:`library` returns ``None`` and the
search runs as torch code.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from torchrec_cnr.native import load_library


@functools.lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    lib = load_library(
        __file__, "_rowsearch_lib", "adaptive quantization runs as torch code, ~5x slower"
    )
    if lib is None:
        return None
    lib.cnr_search_rows.restype = ctypes.c_int
    lib.cnr_search_rows.argtypes = [
        ctypes.c_void_p,  # x
        ctypes.c_int64,  # n
        ctypes.c_int64,  # dim
        ctypes.c_int,  # bits
        ctypes.POINTER(ctypes.c_int32),  # clips
        ctypes.c_int,  # n_clips
        ctypes.c_int,  # n_bins
        ctypes.c_int,  # refine
        ctypes.c_double,  # omega
        ctypes.c_float,  # frame
        ctypes.c_void_p,  # lo_out
        ctypes.c_void_p,  # hi_out
    ]
    lib.cnr_fp16_round.restype = ctypes.c_float
    lib.cnr_fp16_round.argtypes = [ctypes.c_float]
    return lib


def library(enabled: bool = True) -> ctypes.CDLL | None:
    """The loaded library, or ``None`` (not built, or not ``enabled``)."""
    return _load() if enabled else None


def search_rows(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    bits: int,
    clips: list[int],
    n_bins: int,
    refine: int,
    omega: float,
    frame: float,
    lo: torch.Tensor,
    hi: torch.Tensor,
) -> None:
    """Ranges of the rows of ``x`` ((N, D) contiguous fp32 on CPU) into ``lo`` and ``hi``."""
    arr = (ctypes.c_int32 * max(1, len(clips)))(*clips)
    n, dim = x.shape
    rc = lib.cnr_search_rows(
        x.data_ptr(),
        n,
        dim,
        bits,
        arr,
        len(clips),
        n_bins,
        refine,
        omega,
        frame,
        lo.data_ptr(),
        hi.data_ptr(),
    )
    if rc == -2:
        raise MemoryError(f"compiled range search: no memory for a {dim}-wide work block")
    if rc != 0:
        raise ValueError(
            f"compiled range search: bad arguments (bits={bits}, dim={dim}, n_bins={n_bins})"
        )
