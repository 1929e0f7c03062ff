"""Rows on their way from a checkpoint to a serving model.

:class:`StoredRows` are rows as a checkpoint stores them (fp32 values, or the parts our
quantizer wrote); :class:`PreparedRows` are the same rows converted to one serving
table's form by :meth:`~torchrec_cnr.serving.targets.ServingTarget.prepare`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from torchrec_cnr.quantization import UNIFORM_METHODS, QuantizedRows

__all__ = ["PreparedRows", "StoredRows", "finite_rows_of"]


@dataclass(frozen=True, eq=False)
class StoredRows:
    """Rows as a checkpoint stores them: set exactly one of the two fields.

    Example::

        StoredRows.fp32(rows)  # (n, dim) values
        StoredRows.quantized(q.to_tensors(), q.method, q.bits, q.shape)
    """

    values: Tensor | None = None
    """(n, dim) floating values."""
    packed: QuantizedRows | None = None
    """Rows quantized by :func:`torchrec_cnr.quantization.quantize`."""

    def __post_init__(self) -> None:
        if (self.values is None) == (self.packed is None):
            raise ValueError("StoredRows needs exactly one of values and packed")
        v = self.values
        if v is not None and (v.dim() != 2 or not v.is_floating_point()):
            raise ValueError(
                f"StoredRows.values must be a 2-D floating tensor (n, dim), got "
                f"{tuple(v.shape)} {v.dtype}"
            )

    @classmethod
    def fp32(cls, values: Tensor) -> StoredRows:
        """Rows stored as (n, dim) floating values."""
        return cls(values=values)

    @classmethod
    def quantized(
        cls,
        parts: Mapping[str, Tensor],
        method: str,
        bits: int,
        shape: int | tuple[int, int] | list[int],
    ) -> StoredRows:
        """Rows from the tensors :meth:`QuantizedRows.to_tensors` gave the checkpoint.

        Args:
            parts: Name -> tensor, each with one row per stored row.
            method: The quantization method.
            bits: Its bit width.
            shape: ``(n, dim)``, or ``dim`` alone (``n`` is then the parts' row count).

        Raises:
            ValueError: ``parts`` do not fit ``(method, bits, shape)``.
        """
        if isinstance(shape, int):
            rows = {int(t.shape[0]) for t in parts.values()}
            if len(rows) != 1:
                raise ValueError(f"parts {sorted(parts)} have different row counts {sorted(rows)}")
            shape = (rows.pop(), shape)
        return cls(packed=QuantizedRows.from_tensors(dict(parts), method, bits, shape))

    @property
    def shape(self) -> tuple[int, int]:
        """``(n, dim)``."""
        if self.packed is not None:
            return self.packed.shape
        assert self.values is not None
        n, dim = self.values.shape
        return int(n), int(dim)

    def tensors(self) -> list[Tensor]:
        """The tensors holding the rows."""
        if self.packed is not None:
            return list(self.packed.to_tensors().values())
        assert self.values is not None
        return [self.values]

    def dequantize(self) -> Tensor:
        """(n, dim) fp32 values; may alias :attr:`values` when they are fp32."""
        if self.packed is not None:
            return self.packed.dequantize()
        assert self.values is not None
        return self.values.detach().float()

    def finite(self) -> Tensor:
        """Whether each row's values are finite, as :func:`finite_rows_of` says of the
        dequantized rows; a 2/3/4-bit uniform row is not dequantized for it: its values
        are ``bias + scale * q`` with an fp16 scale and bias and ``q`` below 16, so they
        are finite exactly where the scale and bias are (no such sum leaves fp32's
        range)."""
        q = self.fused_nbit()
        if q is None:
            return finite_rows_of(self.values if self.values is not None else self.dequantize())
        # An fp16 is finite unless its exponent bits (0x7C of its high byte) are all set.
        high = q.data[:, -3::2] & 0x7C  # of scale and bias (little-endian)
        return (high[:, 0] != 0x7C) & (high[:, 1] != 0x7C)

    def fused_nbit(self) -> QuantizedRows | None:
        """The packed rows if they are uniform 2/3/4-bit: ``[codes | scale fp16 | bias
        fp16]`` rows, which serving takes without requantizing."""
        q = self.packed
        if q is not None and q.method in UNIFORM_METHODS and q.bits < 8:
            return q
        return None


@dataclass(frozen=True, eq=False)
class PreparedRows:
    """Rows converted to one table's serving form by :meth:`ServingTarget.prepare`."""

    key: str
    """The table they were prepared for."""
    count: int
    """Number of rows."""
    tensors: tuple[Tensor, ...]
    """The serving form, private to the target that made it."""


def memory_bytes(tensors: list[Tensor]) -> int:
    """Bytes of the distinct memory ``tensors`` view."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def finite_rows_of(values: Tensor) -> Tensor:
    """Whether every element of each row of ``(n, dim)`` ``values`` is finite.

    A sum that is finite adds no NaN or infinity (either carries through it): first the
    whole tensor's (half the time of the rows' sums here), then, if it is not, each row's
    (ten times faster than ``isfinite(values).all(1)``), and only rows whose sum is not
    finite, rare, element by element, as finite values may add up past the float range."""
    if bool(torch.isfinite(values.sum())):
        return torch.ones(values.shape[0], dtype=torch.bool, device=values.device)
    finite = torch.isfinite(values.sum(dim=1))
    if not bool(finite.all()):
        suspect = torch.nonzero(~finite).flatten()
        finite[suspect] = torch.isfinite(values[suspect]).all(dim=1)
    return finite
