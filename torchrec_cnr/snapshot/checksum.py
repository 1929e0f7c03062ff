"""Checksums of stored tensors.

Every tensor a checkpoint stores gets a CRC32 of its raw bytes in the manifest; a
restore recomputes it on every tensor it reads, and ``cnr verify`` on every tensor of
every checkpoint a chain needs.

Large tensors are written and read in pieces, each on its own thread, each with the
CRC32 of its own bytes; :func:`crc32_combine` joins them into the tensor's CRC32 without
touching the bytes again. zlib's CRC32 runs at several GB/s per core here (6.5 GB/s
measured), well above the disk, so no faster checksum is needed.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import torch

from torchrec_cnr.errors import ChecksumError

__all__ = ["as_bytes", "check", "crc32", "crc32_bytes", "crc32_combine"]

_POLY = 0xEDB88320  # CRC-32 (reflected), as zlib computes it


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
    return zlib.crc32(as_bytes(t.contiguous()))


def crc32_bytes(data: bytes | memoryview, value: int = 0) -> int:
    """CRC32 of ``data``, continuing from ``value`` (the CRC32 of what came before)."""
    return zlib.crc32(data, value)


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
    """The CRC32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    if second_length == 0:
        return first
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
