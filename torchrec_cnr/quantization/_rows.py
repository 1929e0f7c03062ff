"""The :class:`QuantizedRows` container and the :func:`quantize` entry point."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._adaptive import search_ranges
from ._config import (
    CAST_DTYPES,
    CAST_METHODS,
    UNIFORM_METHODS,
    check_finite,
    check_fp16_stored,
    check_method_bits,
    check_search_params,
)
from ._kmeans import kmeans_dequantize, kmeans_quantize
from ._packing import packed_nbytes
from ._uniform import decode, encode_minmax, encode_range, encode_searched, fused_row_bytes


def _expected_layout(
    method: str, bits: int, shape: tuple[int, int]
) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
    """Tensor name -> (shape, dtype) that :meth:`QuantizedRows.to_tensors` emits."""
    n, dim = shape
    if method in UNIFORM_METHODS:
        return {"data": ((n, fused_row_bytes(dim, bits)), torch.uint8)}
    if method == "kmeans":
        return {
            "codes": ((n, packed_nbytes(dim, bits)), torch.uint8),
            "codebook": ((n, 1 << bits), torch.float16),
        }
    return {"values": ((n, dim), CAST_DTYPES[method])}


@dataclass(frozen=True, eq=False)
class QuantizedRows:
    """Quantized embedding rows, held as the plain tensors a checkpoint stores.

    Layout per method (N rows of width D):

    * ``symmetric`` / ``asymmetric`` / ``adaptive``: ``data`` (N, row_bytes)
      uint8 in FBGEMM's fused rowwise layout. 2/3/4 bits: packed codes for
      ``padded_dim(D, bits)`` columns, then fp16 scale, fp16 bias per row;
      8 bits: D code bytes, then fp32 scale, fp32 bias. ``x = bias + scale*q``.
    * ``kmeans``: ``data`` holds packed codes (N, packed_nbytes(D, bits)) uint8
      and ``codebook`` the (N, 2**bits) fp16 centroids; ``x = codebook[q]``.
    * ``fp16`` / ``bf16`` / ``none``: ``data`` is the (N, D) fp16 / bf16 /
      fp32 values.

    Attributes:
        method: Quantization method name.
        bits: Bits per element: the code width, or 16/32 for the casts.
        shape: Logical ``(N, D)`` of the original rows.
        data: Main stored tensor (see above).
        codebook: k-means centroids, ``None`` for other methods.
    """

    method: str
    bits: int
    shape: tuple[int, int]
    data: torch.Tensor
    codebook: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """Device the stored tensors live on."""
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held by all stored tensors (codes, scales/biases, codebooks)."""
        return sum(t.numel() * t.element_size() for t in self.to_tensors().values())

    def dequantize(self) -> torch.Tensor:
        """Reconstruct the rows.

        Returns:
            (N, D) fp32 tensor on :attr:`device` (never aliasing stored data).
        """
        n, dim = self.shape
        if n == 0 or dim == 0:
            return torch.zeros(n, dim, dtype=torch.float32, device=self.device)
        if self.method in UNIFORM_METHODS:
            return decode(self.data, self.bits, dim)
        if self.method == "kmeans":
            assert self.codebook is not None
            return kmeans_dequantize(self.data, self.codebook, self.bits, dim)
        return self.data.to(torch.float32, copy=True)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name, for a checkpoint writer.

        Returns:
            ``{"data": ...}`` for uniform methods, ``{"codes": ...,
            "codebook": ...}`` for kmeans, ``{"values": ...}`` for casts; see
            the class docstring for shapes and dtypes.
        """
        if self.method in UNIFORM_METHODS:
            return {"data": self.data}
        if self.method == "kmeans":
            assert self.codebook is not None
            return {"codes": self.data, "codebook": self.codebook}
        return {"values": self.data}

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, torch.Tensor],
        method: str,
        bits: int,
        shape: tuple[int, int] | list[int],
    ) -> QuantizedRows:
        """Rebuild a container from :meth:`to_tensors` output.

        Args:
            tensors: Name -> tensor, as produced by :meth:`to_tensors`.
            method: The method it was quantized with.
            bits: Its :attr:`bits` (ignored for ``fp16``/``bf16``/``none``).
            shape: Logical ``(N, D)``.

        Raises:
            ValueError: Unknown method/bits, or tensors missing or of the
                wrong shape/dtype for ``(method, bits, shape)``.
        """
        stored_bits = check_method_bits(method, bits)
        if len(shape) != 2 or any(int(s) < 0 for s in shape):
            raise ValueError(f"shape must be (N, D) with N, D >= 0, got {tuple(shape)!r}")
        n, dim = (int(s) for s in shape)
        layout = _expected_layout(method, stored_bits, (n, dim))
        if set(tensors) != set(layout):
            raise ValueError(
                f"{method!r} rows need tensors {sorted(layout)}, got {sorted(tensors)}"
            )
        for key, (want_shape, want_dtype) in layout.items():
            t = tensors[key]
            if tuple(t.shape) != want_shape or t.dtype != want_dtype:
                raise ValueError(
                    f"tensor {key!r} is {tuple(t.shape)} {t.dtype}; {method!r} at {stored_bits} bits "
                    f"for shape {(n, dim)} needs {want_shape} {want_dtype}"
                )
        main = tensors["codes"] if method == "kmeans" else tensors[next(iter(layout))]
        return cls(method, stored_bits, (n, dim), main, tensors.get("codebook"))


def _scale_bias(data: torch.Tensor) -> torch.Tensor:
    """(N, 2) fp16 scale, bias: the last 4 bytes of each fused N-bit row."""
    tail = data[:, -4:]
    if data.shape[1] % 4 == 0 and data.storage_offset() % 4 == 0:
        # Gathering one int32 per row is ~10x faster than a strided byte copy.
        return tail.view(torch.int32).contiguous().view(torch.float16)
    return tail.contiguous().view(torch.float16)


def _empty(method: str, bits: int, shape: tuple[int, int], device: torch.device) -> QuantizedRows:
    tensors = {
        key: torch.empty(s, dtype=dt, device=device)
        for key, (s, dt) in _expected_layout(method, bits, shape).items()
    }
    return QuantizedRows.from_tensors(tensors, method, bits, shape)


def quantize(
    rows: torch.Tensor,
    method: str = "adaptive",
    bits: int = 4,
    *,
    n_bins: int = 200,
    ratio: float = 0.16,
    name: str = "rows",
    row_ids: torch.Tensor | int | None = None,
    compiled: bool = True,
) -> QuantizedRows:
    """Quantize embedding rows for a checkpoint, row by row.

    Args:
        rows: (N, D) fp32/fp16/bf16 tensor on any device; N may be 0.
        method: ``symmetric`` (range ``[-max|x|, max|x|]``), ``asymmetric``
            (``[min, max]``), ``adaptive`` (searched range, see
            :mod:`._adaptive`), ``kmeans`` (per-row codebook), or the casts
            ``fp16``, ``bf16``, ``none`` (fp32 copy).
        bits: 2, 3, 4 or 8 for the code methods; ignored for casts.
        n_bins: Adaptive search step is ``range / n_bins``.
        ratio: Adaptive search shrinks the range by at most this fraction in
            its greedy phase.
        name: Table name for error messages.
        row_ids: each row's id in its table, for error messages: an ``(N,)``
            tensor, or the id of the first row of consecutive rows; the row
            index if ``None``.
        compiled: run the adaptive search compiled where the library is built.

    Returns:
        A :class:`QuantizedRows` on ``rows``' device sharing no memory with
        ``rows``.

    Raises:
        ValueError: Bad method/bits/parameters, a non-2-D or non-float
            tensor, NaN/Inf in a row, or a row whose fp16 scale/bias,
            codebook or values would overflow; row errors name ``name`` and
            the row index.
    """
    stored_bits = check_method_bits(method, bits)
    check_search_params(n_bins, ratio)
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or not rows.is_floating_point():
        got = (
            f"{tuple(rows.shape)} {rows.dtype}"
            if isinstance(rows, torch.Tensor)
            else type(rows).__name__
        )
        raise ValueError(f"table {name!r}: rows must be a 2-D floating tensor (N, D), got {got}")
    rows = rows.detach()
    n, dim = rows.shape
    if n == 0 or dim == 0:
        return _empty(method, stored_bits, (n, dim), rows.device)
    if method == "adaptive":
        # Compiled, the search and the encoding are one pass, which checks finiteness too.
        searched = encode_searched(rows, stored_bits, n_bins, ratio, compiled)
        if searched is not None:
            data, bad = searched
            if bad is not None:
                check_finite(rows, name, row_ids)  # raises, naming the row
                raise AssertionError(f"row {bad} was reported not finite")  # pragma: no cover
            if stored_bits < 8:
                check_fp16_stored(_scale_bias(data), name, "scale/bias", row_ids)
            return QuantizedRows(method, stored_bits, (n, dim), data)
    check_finite(rows, name, row_ids)

    if method in CAST_METHODS:
        values = rows.to(CAST_DTYPES[method])
        if values.data_ptr() == rows.data_ptr():
            values = values.clone()  # the caller keeps training these rows
        if method == "fp16":
            check_fp16_stored(values, name, "values", row_ids)
        return QuantizedRows(method, stored_bits, (n, dim), values.contiguous())

    x = rows.float().contiguous()
    if method == "kmeans":
        codes, codebook = kmeans_quantize(x, stored_bits)
        check_fp16_stored(codebook, name, "codebook", row_ids)
        return QuantizedRows(method, stored_bits, (n, dim), codes, codebook)
    if method == "asymmetric":
        data = encode_minmax(x, stored_bits)
    else:
        if method == "symmetric":
            mn, mx = x.amin(1), x.amax(1)
            m = torch.maximum(-mn, mx)
            # Constant rows keep [v, v] so they round-trip as exactly as the
            # parameter dtype allows (symmetric would put v at a range end).
            flat = mn == mx
            lo, hi = torch.where(flat, mn, -m), torch.where(flat, mx, m)
        else:
            lo, hi = search_ranges(x, stored_bits, n_bins, ratio, compiled=compiled)
        data = encode_range(x, lo, hi, stored_bits)
    if stored_bits < 8:
        check_fp16_stored(_scale_bias(data), name, "scale/bias", row_ids)
    return QuantizedRows(method, stored_bits, (n, dim), data)
