"""The compiled range search and encoder (``_rowsearch.c``), loaded with ctypes.

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
    lib.cnr_quantize_rows.restype = ctypes.c_int
    lib.cnr_quantize_rows.argtypes = [
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
        ctypes.c_void_p,  # codes (NULL: search only)
        ctypes.c_int64,  # stride (bytes between rows of codes)
        ctypes.c_int64,  # width (codes per row, padded)
        ctypes.POINTER(ctypes.c_int64),  # bad_row (NULL: no check)
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
    codes: torch.Tensor | None = None,
    width: int = 0,
) -> int | None:
    """Ranges of the rows of ``x`` ((N, D) contiguous fp32 on CPU) into ``lo`` and ``hi``.

    With ``codes`` ((N, bytes) uint8, rows contiguous), also the rows' packed codes under
    those ranges into its first ``width * bits / 8`` bytes of each row (``width``: ``D``
    padded, :func:`~torchrec_cnr.quantization._packing.padded_dim`), and rows that are not
    finite are looked for.

    Returns:
        With ``codes``, the first row that is not finite (nothing is written past its
        batch), else ``None``.
    """
    arr = (ctypes.c_int32 * max(1, len(clips)))(*clips)
    n, dim = x.shape
    bad = ctypes.c_int64(-1)
    if codes is not None:
        assert codes.dtype == torch.uint8 and codes.shape[0] == n and codes.stride(1) == 1
    rc = lib.cnr_quantize_rows(
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
        None if codes is None else codes.data_ptr(),
        0 if codes is None else codes.stride(0),
        width,
        None if codes is None else ctypes.byref(bad),
    )
    if rc == -3:
        return bad.value
    if rc == -2:
        raise MemoryError(f"compiled range search: no memory for a {dim}-wide work block")
    if rc != 0:
        raise ValueError(
            f"compiled range search: bad arguments (bits={bits}, dim={dim}, n_bins={n_bins})"
        )
    return None
