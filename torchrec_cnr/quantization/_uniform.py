"""Uniform rowwise quantization in FBGEMM's fused row layouts.

Two stored layouts, chosen by bit width only (never by device or by which code
path produced them), so a checkpoint written on CPU decodes on GPU and back:

* N-bit (2, 3, 4 bits): each row is ``[packed codes | scale fp16 | bias fp16]``
  with ``padded_dim(D, bits) * bits / 8`` code bytes. For 2 and 4 bits this is
  byte-for-byte FBGEMM's ``FusedNBitRowwiseQuantizedSBHalf`` format; 3 bits
  reuses it with the bitstream from :mod:`._packing`.
* 8-bit: each row is ``[D codes | scale fp32 | bias fp32]``, FBGEMM's
  ``Fused8BitRowwiseQuantized`` format.

Dequantization is ``bias + scale * code``. On CPU the FBGEMM kernels do the
work where they exist (2/4/8 bits); elsewhere vectorized torch code mirrors
their arithmetic (fp16 rounding of bias and scale, the scale fix-ups for
degenerate ranges, round-half-even, clamping).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from . import _compiled
from ._adaptive import compiled_search
from ._packing import pack_codes, packed_nbytes, padded_dim, unpack_codes

# Elements per chunk of the torch encoder (its temporaries are ~5x this in bytes).
_ENCODE_CHUNK_ELEMS = 1 << 20

_local = threading.local()


@functools.lru_cache(maxsize=1)
def fbgemm_ops() -> Any | None:
    """``torch.ops.fbgemm`` once ``fbgemm_gpu`` registered it, else ``None``."""
    try:
        import fbgemm_gpu  # noqa: F401  (import registers the operators)
    except Exception:  # pragma: no cover - depends on the install
        return None
    ops = torch.ops.fbgemm
    needed = (
        "FloatToFusedNBitRowwiseQuantizedSBHalf",
        "FloatOrHalfToFusedNBitRowwiseQuantizedSBHalfWithRowwiseMinMax",
        "FusedNBitRowwiseQuantizedSBHalfToFloat",
        "FloatToFused8BitRowwiseQuantized",
        "Fused8BitRowwiseQuantizedToFloat",
    )
    try:
        for name in needed:
            getattr(ops, name)
    except (AttributeError, RuntimeError):  # pragma: no cover
        return None
    return ops


def _cpu_ops(t: torch.Tensor) -> Any | None:
    # The CPU wheel registers no CUDA kernels, so GPU tensors take the torch path.
    return fbgemm_ops() if t.device.type == "cpu" else None


def fused_row_bytes(dim: int, bits: int) -> int:
    """Bytes per stored row of the fused layout for ``bits``."""
    return dim + 8 if bits == 8 else packed_nbytes(dim, bits) + 4


def _pad_columns(x: torch.Tensor, bits: int) -> torch.Tensor:
    # Repeat the last column: the copies leave each row's min/max unchanged, so
    # FBGEMM's own range computation sees the true row.
    width = padded_dim(x.shape[1], bits)
    if width == x.shape[1]:
        return x
    return torch.cat([x, x[:, -1:].expand(-1, width - x.shape[1])], dim=1)


def nbit_params(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FBGEMM's fp16 (scale, bias) for ranges ``[lo, hi]``, as fp32 values.

    Mirrors ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``: the bias is the
    fp16-rounded ``lo``, the scale the fp16-rounded ``(hi - bias) / (2**bits-1)``,
    with scale 1 whenever it would be 0 or its inverse infinite, which keeps
    constant rows finite and (to fp16 precision) exact.

    Args:
        lo: (N,) fp32 range starts.
        hi: (N,) fp32 range ends (``hi >= lo``).
        bits: 2, 3 or 4.

    Returns:
        ``(scale, bias)``, each (N,) fp32 holding fp16-representable values.
    """
    levels = (1 << bits) - 1
    bias = lo.to(torch.float16).float()
    span = hi - bias
    scale = torch.where(span == 0, torch.ones_like(span), span / levels)
    scale = scale.to(torch.float16).float()
    bad = (scale == 0) | torch.isinf(1.0 / scale)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    return scale, bias


def _work_buffer(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """A (rows, cols) fp32 scratch tensor, reused per thread on CPU.

    Fresh multi-MiB CPU allocations are page-faulted in on first write, which
    costs more than the encoding arithmetic itself.
    """
    if device.type != "cpu":
        return torch.empty(rows, cols, dtype=torch.float32, device=device)
    need = rows * cols
    buf = getattr(_local, "work", None)
    if buf is None or buf.numel() < need:
        buf = torch.empty(need)
        _local.work = buf
    return buf[:need].view(rows, cols)


def _encode_nbit_into(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, out: torch.Tensor
) -> None:
    """Write the fused N-bit rows of ``x`` for ranges ``[lo, hi]`` into ``out``.

    Same arithmetic as FBGEMM's kernel (fp16 bias and scale, codes
    ``clamp(round((x - bias) * (1 / scale)))``); padding columns get code 0.
    2- and 4-bit codes are packed with exact float arithmetic on strided
    views (``c0 + 16 c1`` is a byte's value), which on CPU beats integer
    shifts and FBGEMM's own kernel on rows whose width is not a multiple of 32.
    """
    levels = (1 << bits) - 1
    scale, bias = nbit_params(lo, hi, bits)
    n, dim = x.shape
    width = padded_dim(dim, bits)
    nbytes = packed_nbytes(dim, bits)
    _write_params(out, scale, bias, bits)
    q = _work_buffer(n, width, x.device)
    torch.sub(x, bias[:, None], out=q[:, :dim]).mul_((1.0 / scale)[:, None])
    q[:, :dim].round_().clamp_(0, levels)
    if width > dim:
        q[:, dim:] = 0
    if bits == 3:
        out[:, :nbytes] = pack_codes(q.to(torch.uint8), bits)
        return
    per_byte = 8 // bits
    codes = q.view(n, nbytes, per_byte)
    packed = torch.add(codes[..., 0], codes[..., 1], alpha=float(1 << bits))
    for k in range(2, per_byte):
        packed.add_(codes[..., k], alpha=float(1 << (bits * k)))
    out[:, :nbytes] = packed


def _encode_nbit_torch(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int
) -> torch.Tensor:
    out = torch.empty(
        x.shape[0], fused_row_bytes(x.shape[1], bits), dtype=torch.uint8, device=x.device
    )
    _encode_nbit_into(x, lo, hi, bits, out)
    return out


def _encode_8bit_torch(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    # Same arithmetic as FloatToFused8BitRowwiseQuantized (epsilon included),
    # plus clamping because [lo, hi] may be narrower than the row.
    span = hi - lo
    scale = span / 255.0
    # A true division, as FBGEMM's kernel and the compiled encoder divide (a tensor's
    # ``255.0 / t`` multiplies by its reciprocal, which rounds differently).
    inv = torch.full_like(span, 255.0).div_(span + 1e-8)
    q = (x - lo[:, None]).mul_(inv[:, None]).round_().clamp_(0, 255).to(torch.uint8)
    sb = torch.stack([scale, lo], dim=1).contiguous().view(torch.uint8)
    return torch.cat([q, sb], dim=1)


def encode_range(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize rows onto ``2**bits`` uniform levels spanning ``[lo, hi]``.

    Values outside the range clamp to its ends.

    Args:
        x: (N, D) fp32 rows.
        lo: (N,) fp32 range starts.
        hi: (N,) fp32 range ends, ``hi >= lo``.
        bits: 2, 3, 4 or 8.

    Returns:
        (N, fused_row_bytes(D, bits)) uint8 fused rows on ``x``'s device.
    """
    ops = _cpu_ops(x)
    if (
        ops is not None
        and bits in (2, 4)
        and x.shape[0] > 0
        and padded_dim(x.shape[1], bits) % 32 == 0
    ):
        # FBGEMM's kernel is vectorized for widths that are multiples of 32
        # and several times slower than the torch path below otherwise.
        # Checked by experiment on fbgemm-gpu-cpu 1.8: rowwise_min_max is an
        # (N, 2) fp32 tensor [min, max] (fp16 is rejected); the kernel rounds
        # bias/scale to fp16 and clamps exactly like the torch path below,
        # byte for byte (tests compare the two).
        minmax = torch.stack([lo, hi], dim=1).float().contiguous()
        return ops.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalfWithRowwiseMinMax(
            _pad_columns(x, bits).contiguous(), bits, minmax
        )
    # Torch path: chunked so its fp32 temporaries stay bounded on big tables.
    out = torch.empty(
        x.shape[0], fused_row_bytes(x.shape[1], bits), dtype=torch.uint8, device=x.device
    )
    step = max(1, _ENCODE_CHUNK_ELEMS // max(1, x.shape[1]))
    for i in range(0, x.shape[0], step):
        j = slice(i, i + step)
        if bits == 8:
            out[j] = _encode_8bit_torch(x[j], lo[j], hi[j])
        else:
            _encode_nbit_into(x[j], lo[j], hi[j], bits, out[j])
    return out


def encode_searched(
    x: torch.Tensor, bits: int, n_bins: int, ratio: float, compiled: bool = True
) -> tuple[torch.Tensor, int | None] | None:
    """The adaptive search and the encoding of ``x``'s rows in one compiled pass over each
    row (``_rowsearch.c``): the same rows as ``encode_range(x, *search_ranges(x, bits))``
    byte for byte, without the encoder's second pass over memory.

    Args:
        x: (N, D) fp32 rows on CPU, contiguous.
        bits: 2, 3, 4 or 8.

    Returns:
        ``(fused rows, None)``; ``(partial rows, i)`` when row ``i`` is the first that is
        not finite; ``None`` where the compiled library does not run (not built, switched
        off, CUDA tensors): then use :func:`search_ranges` and :func:`encode_range`.
    """
    n, dim = x.shape
    lib = _compiled.library(compiled) if x.device.type == "cpu" and dim > 0 else None
    if lib is None or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    out = torch.empty(n, fused_row_bytes(dim, bits), dtype=torch.uint8)
    lo, hi = torch.empty(n), torch.empty(n)
    bad = compiled_search(lib, x, bits, n_bins, ratio, None, lo, hi, out)
    if bad is not None:
        return out, bad
    params = ((hi - lo) / 255.0, lo) if bits == 8 else nbit_params(lo, hi, bits)
    _write_params(out, *params, bits)
    return out, None


def _write_params(out: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int) -> None:
    """Rows' stored ``scale`` and ``bias`` into the last bytes of fused rows ``out``: fp16
    at 2/3/4 bits (:func:`nbit_params`' values), fp32 at 8 bits, as :func:`encode_range`
    stores them."""
    if bits == 8:
        out[:, -8:] = torch.stack([scale, bias], 1).view(torch.uint8)
        return
    # Rows are an even number of bytes, so fp16 (scale, bias) go in as int16.
    out.view(torch.int16)[:, -2:] = torch.stack([scale, bias], 1).half().view(torch.int16)


def encode_minmax(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Asymmetric quantization over each row's own ``[min, max]``.

    Uses FBGEMM's fused kernels on CPU (2/4 bits: ``FloatToFusedNBitRowwise
    QuantizedSBHalf``; 8 bits: ``FloatToFused8BitRowwiseQuantized``), torch
    code otherwise.

    Args:
        x: (N, D) fp32 rows.
        bits: 2, 3, 4 or 8.

    Returns:
        (N, fused_row_bytes(D, bits)) uint8 fused rows.
    """
    ops = _cpu_ops(x)
    if ops is not None and x.shape[0] > 0:
        if bits == 8:
            return ops.FloatToFused8BitRowwiseQuantized(x.contiguous())
        if bits in (2, 4):
            return ops.FloatToFusedNBitRowwiseQuantizedSBHalf(
                _pad_columns(x, bits).contiguous(), bits
            )
    if x.shape[0] == 0:
        return torch.empty(0, fused_row_bytes(x.shape[1], bits), dtype=torch.uint8, device=x.device)
    # amin + amax: aminmax(dim=1) is ~10x slower on CPU.
    return encode_range(x, x.amin(1), x.amax(1), bits)


def split_fused(
    data: torch.Tensor, bits: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split fused rows into ``(codes, scale, bias)``.

    Args:
        data: (N, fused_row_bytes(dim, bits)) uint8.
        bits: 2, 3, 4 or 8.
        dim: Logical row width ``D``.

    Returns:
        codes (N, D) uint8, scale (N,) fp32, bias (N,) fp32.
    """
    n = data.shape[0]
    if data.shape[1] != fused_row_bytes(dim, bits):
        raise ValueError(
            f"fused rows have {data.shape[1]} bytes, expected {fused_row_bytes(dim, bits)} "
            f"for dim={dim} at {bits} bits"
        )
    if bits == 8:
        codes = data[:, :dim]
        sb = data[:, dim:].contiguous().view(torch.float32).reshape(n, 2)
    else:
        nb = packed_nbytes(dim, bits)
        codes = unpack_codes(data[:, :nb], bits, dim)
        sb = data[:, nb:].contiguous().view(torch.float16).reshape(n, 2).float()
    return codes, sb[:, 0], sb[:, 1]


def decode(data: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Dequantize fused rows to fp32 ``bias + scale * code``.

    Args:
        data: (N, fused_row_bytes(dim, bits)) uint8 fused rows.
        bits: 2, 3, 4 or 8.
        dim: Logical row width ``D``.

    Returns:
        (N, D) fp32 on ``data``'s device.
    """
    ops = _cpu_ops(data)
    if ops is not None and data.shape[0] > 0 and bits in (2, 4, 8):
        if bits == 8:
            return ops.Fused8BitRowwiseQuantizedToFloat(data.contiguous())
        out = ops.FusedNBitRowwiseQuantizedSBHalfToFloat(data.contiguous(), bits)
        return out if out.shape[1] == dim else out[:, :dim].contiguous()
    codes, scale, bias = split_fused(data, bits, dim)
    return torch.addcmul(bias[:, None], codes.float(), scale[:, None])
