"""Bit packing of per-element codes into bytes, vectorized over whole tensors.

Byte layout follows FBGEMM's fused N-bit rows so packed codes can sit in the
same tensor FBGEMM kernels read: inside a byte, element ``k`` occupies bits
``[bits*k, bits*(k+1))`` (little-endian). 3-bit codes, which FBGEMM has no
format for, use the same convention on a 24-bit word: eight codes fill three
bytes, code ``k`` at bits ``[3k, 3k+3)`` of the little-endian word.

Row widths are padded so every packed row is an even number of bytes (FBGEMM
refuses rows whose fp16 scale/bias would be misaligned); see
:func:`padded_dim`.
"""

from __future__ import annotations

import sys

import torch

# The fast 3-bit path reinterprets 8 code bytes as one int64.
_LITTLE_ENDIAN = sys.byteorder == "little"

# Columns a packed row is padded to. 2/4-bit mirror FBGEMM's alignment rule
# (packed bytes must be even); 3-bit uses 16 codes = 6 bytes for the same
# reason; 8-bit rows need no padding.
_PAD_MULTIPLE = {2: 8, 3: 16, 4: 4, 8: 1}


def padded_dim(dim: int, bits: int) -> int:
    """Number of code columns a packed row of ``dim`` elements holds.

    Args:
        dim: Logical row width ``D`` (>= 0).
        bits: 2, 3, 4 or 8.

    Returns:
        ``D`` rounded up to the packing multiple for ``bits``.
    """
    multiple = _PAD_MULTIPLE[bits]
    return -(-dim // multiple) * multiple


def packed_nbytes(dim: int, bits: int) -> int:
    """Bytes per packed row of ``dim`` codes at ``bits`` bits."""
    return padded_dim(dim, bits) * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes into bytes.

    Args:
        codes: (N, D) integer tensor with values in ``[0, 2**bits)``; any
            integer dtype, any device.
        bits: 2, 3, 4 or 8.

    Returns:
        (N, packed_nbytes(D, bits)) uint8 tensor on the same device. Padding
        columns are packed as code 0.
    """
    if bits not in _PAD_MULTIPLE:
        raise ValueError(f"cannot pack {bits}-bit codes; allowed: 2, 3, 4, 8")
    n, dim = codes.shape
    width = padded_dim(dim, bits)
    c = codes.to(torch.uint8)
    if width != dim:
        c = torch.nn.functional.pad(c, (0, width - dim))
    if bits == 8:
        return c.contiguous()
    if bits == 3 and _LITTLE_ENDIAN:
        # Eight uint8 codes read as one int64 hold code k in byte k. Merge
        # neighbouring fields pairwise (SWAR: 8 -> 4 -> 2 -> 1 lanes) so code
        # k lands at bit 3k, then keep the word's low 3 bytes.
        v = c.contiguous().view(n, width // 8, 8).view(torch.int64).squeeze(-1)
        v = (v & 0x0007000700070007) | ((v >> 5) & 0x0038003800380038)
        v = (v & 0x0000003F0000003F) | ((v >> 10) & 0x00000FC000000FC0)
        v = (v & 0xFFF) | ((v >> 20) & 0xFFF000)
        out = torch.empty(n, width // 8, 3, dtype=torch.uint8, device=c.device)
        out.copy_(v.unsqueeze(-1).view(torch.uint8)[..., :3])  # 2x faster than reshape
        return out.view(n, width * 3 // 8)
    if bits == 3:  # portable fallback for big-endian hosts
        groups = c.view(n, width // 8, 8).to(torch.int32)
        w32 = groups[..., 0].clone()
        for k in range(1, 8):
            w32 |= groups[..., k] << (3 * k)
        out = torch.stack([w32 & 0xFF, (w32 >> 8) & 0xFF, (w32 >> 16) & 0xFF], dim=-1)
        return out.to(torch.uint8).view(n, width * 3 // 8)
    per_byte = 8 // bits
    groups = c.view(n, width // per_byte, per_byte)
    out = groups[..., 0].clone()
    for k in range(1, per_byte):
        out |= groups[..., k] << (bits * k)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`.

    Args:
        packed: (N, packed_nbytes(dim, bits)) uint8 tensor.
        bits: 2, 3, 4 or 8.
        dim: Logical row width ``D`` to return (padding is dropped).

    Returns:
        (N, D) uint8 codes on the same device.
    """
    if bits not in _PAD_MULTIPLE:
        raise ValueError(f"cannot unpack {bits}-bit codes; allowed: 2, 3, 4, 8")
    n = packed.shape[0]
    width = padded_dim(dim, bits)
    if packed.shape[1] != width * bits // 8:
        raise ValueError(
            f"packed rows have {packed.shape[1]} bytes, expected {width * bits // 8} "
            f"for dim={dim} at {bits} bits"
        )
    p = packed.to(torch.uint8)
    if bits == 8:
        return p[:, :dim]
    mask = (1 << bits) - 1
    if bits == 3 and _LITTLE_ENDIAN:
        # Inverse of pack_codes: widen each 3-byte group to an int64 and split
        # the fields back out (1 -> 2 -> 4 -> 8 lanes) to one code per byte.
        g = torch.nn.functional.pad(p.reshape(n, width // 8, 3), (0, 5))
        v = g.view(torch.int64).squeeze(-1)
        v = (v & 0xFFF) | ((v & 0xFFF000) << 20)
        v = (v & 0x0000003F0000003F) | ((v & 0x00000FC000000FC0) << 10)
        v = (v & 0x0007000700070007) | ((v & 0x0038003800380038) << 5)
        return v.unsqueeze(-1).view(torch.uint8).reshape(n, width)[:, :dim]
    if bits == 3:
        b = p.reshape(n, width // 8, 3).to(torch.int32)
        w32 = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        shifts = torch.arange(0, 24, 3, device=p.device, dtype=torch.int32)
        codes = (w32.unsqueeze(-1) >> shifts) & mask
        return codes.to(torch.uint8).reshape(n, width)[:, :dim]
    shifts = torch.arange(0, 8, bits, device=p.device, dtype=torch.uint8)
    codes = (p.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(n, width)[:, :dim]
