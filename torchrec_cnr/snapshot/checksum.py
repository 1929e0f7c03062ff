"""Checksums of stored tensors.

Every tensor a checkpoint stores gets a CRC32 of its raw bytes in the manifest; a
restore recomputes it on every tensor it reads, and ``cnr verify`` on every tensor of
every checkpoint a chain needs.

Large tensors are written and read in pieces, each on its own thread, each with the
CRC32 of its own bytes; :func:`crc32_combine` joins them into the tensor's CRC32 without
touching the bytes again.

The CRC32 is zlib's, computed by a small C library (``_crc32.c``, carry-less
multiplication, built by ``pip install`` beside this file and loaded with ctypes, which
releases the GIL): 9-11 GB/s per core here against zlib's 2-3.5 GB/s, where the checksum
was half of a commit's CPU time and a quarter of a restore's. Without the library (no C
compiler at install time, or a CPU without PCLMULQDQ) zlib computes the same values.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import zlib
from typing import Any

import numpy as np
import torch

from torchrec_cnr.errors import ChecksumError
from torchrec_cnr.native import load_library

__all__ = ["as_bytes", "check", "crc32", "crc32_bytes", "crc32_combine"]

_POLY = 0xEDB88320  # CRC-32 (reflected), as zlib computes it
_COMPILED_MIN = 4096
"""Shorter inputs go to zlib: the ctypes call costs more than it saves."""

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _library() -> Any:
    """The compiled library with its functions typed, or ``None`` (logged once) without it."""
    lib = load_library(__file__, "_crc32_lib", "checksums run on zlib, ~3x slower")
    if lib is None:
        return None
    lib.cnr_crc32.restype = ctypes.c_int64
    lib.cnr_crc32.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int64]
    lib.cnr_crc32_combine.restype = ctypes.c_int64
    lib.cnr_crc32_combine.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int64]
    if lib.cnr_crc32(0, b"123456789", 9) == 0xCBF43926:  # -1 where the CPU lacks PCLMULQDQ
        return lib
    log.warning("torchrec_cnr: this CPU lacks PCLMULQDQ; checksums run on zlib")
    return None


def as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, whatever its dtype (bf16 included).

    The view is writable when the tensor is: readers fill tensors through it.
    """
    if t.numel() == 0:
        return memoryview(b"")
    array: Any = t.view(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def crc32(tensor: torch.Tensor) -> int:
    """CRC32 of the tensor's raw bytes."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return crc32_bytes(as_bytes(t.contiguous()))


def crc32_bytes(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32 of ``data``, continuing from ``value`` (the CRC32 of what came before):
    ``zlib.crc32(data, value)``, computed by the compiled library where it is built."""
    lib = _library() if len(data) >= _COMPILED_MIN else None
    if lib is None:
        return zlib.crc32(data, value)
    view = memoryview(data).cast("B")
    return int(lib.cnr_crc32(value, np.frombuffer(view, dtype=np.uint8).ctypes.data, len(view)))


def _times(matrix: tuple[int, ...], vector: int) -> int:
    """A 32x32 matrix over GF(2) (one int per column) times a 32-bit vector."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _squared(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(matrix, column) for column in matrix)


@functools.lru_cache(maxsize=64)
def _shift(length: int) -> tuple[int, ...]:
    """The operator that appends ``length`` zero bytes to a CRC32's register.

    Built by squaring the one-zero-bit operator (``length`` in bits, read bit by bit),
    as zlib's ``crc32_combine`` does.
    """
    one_bit = (_POLY, *(1 << i for i in range(31)))
    result = tuple(1 << i for i in range(32))  # identity
    power, bits = one_bit, length * 8
    while bits:
        if bits & 1:
            result = tuple(_times(power, column) for column in result)
        bits >>= 1
        if bits:
            power = _squared(power)
    return result


def crc32_combine(first: int, second: int, second_length: int) -> int:
    """The CRC32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``.

    Computed by the compiled library where it is built: the Python below takes 1-2 ms a
    length, holding the GIL, and a checkpoint combines tens of pieces on the background
    writer while training runs.
    """
    if second_length < 0:
        raise ValueError(f"second_length must be >= 0, got {second_length}")
    if first == 0 or second_length == 0:  # the operator is linear: it maps 0 to 0
        return second if first == 0 else first
    lib = _library()
    if lib is not None:
        return int(lib.cnr_crc32_combine(first, second, second_length))
    return _times(_shift(second_length), first) ^ second


def check(value: torch.Tensor | bytes, expected: int | None, what: str) -> None:
    """Raises :class:`ChecksumError` naming ``what`` if ``value`` does not match ``expected``."""
    if expected is None:
        return
    got = crc32_bytes(value) if isinstance(value, bytes) else crc32(value)
    mismatch(got, expected, what)


def mismatch(got: int, expected: int | None, what: str) -> None:
    """Raises :class:`ChecksumError` if a computed checksum differs from the recorded one."""
    if expected is not None and got != expected:
        raise ChecksumError(f"{what} is corrupt: checksum {got:#010x}, recorded {expected:#010x}")
