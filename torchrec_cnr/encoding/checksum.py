"""Checksums of stored tensors.

Every tensor a checkpoint stores gets a CRC32 of its raw bytes in the manifest; a
restore recomputes it on every tensor it reads, and ``cnr verify`` on every tensor of
every checkpoint a chain needs.
"""

from __future__ import annotations

import zlib

import torch

from torchrec_cnr.errors import ChecksumError

__all__ = ["check", "crc32", "crc32_bytes"]


def crc32(tensor: torch.Tensor) -> int:
    """CRC32 of the tensor's raw bytes (zlib runs at several GB/s)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return 0
    return zlib.crc32(t.view(-1).view(torch.uint8).numpy().data)


def crc32_bytes(data: bytes) -> int:
    return zlib.crc32(data)


def check(value: torch.Tensor | bytes, expected: int | None, what: str) -> None:
    """Raises :class:`ChecksumError` naming ``what`` if ``value`` does not match ``expected``."""
    if expected is None:
        return
    got = crc32_bytes(value) if isinstance(value, bytes) else crc32(value)
    if got != expected:
        raise ChecksumError(f"{what} is corrupt: checksum {got:#010x}, recorded {expected:#010x}")
