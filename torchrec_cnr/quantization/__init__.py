"""Check-N-Run per-row quantization of embedding-table checkpoints.

``quantize(rows, method, bits)`` turns an (N, D) float tensor into a
:class:`QuantizedRows` whose :meth:`~QuantizedRows.to_tensors` are plain
tensors a checkpoint writer can store, and whose
:meth:`~QuantizedRows.dequantize` restores fp32 rows. ``select_bits`` picks a
bit width from the number of restores a checkpoint is expected to serve.

Example::

    q = quantize(weights, "adaptive", bits=4, name="t3")
    blobs = q.to_tensors()
    restored = QuantizedRows.from_tensors(blobs, q.method, q.bits, q.shape).dequantize()
"""

from __future__ import annotations

from ._adaptive import search_ranges
from ._config import (
    BITS,
    CAST_DTYPES,
    CAST_METHODS,
    CODE_METHODS,
    DEFAULT_THRESHOLDS,
    METHODS,
    UNIFORM_METHODS,
    check_thresholds,
    select_bits,
)
from ._fused import SB_BYTES, fused_int8_rows
from ._packing import pack_codes, packed_nbytes, padded_dim, unpack_codes
from ._rows import QuantizedRows, quantize

__all__ = [
    "BITS",
    "CAST_DTYPES",
    "CAST_METHODS",
    "CODE_METHODS",
    "DEFAULT_THRESHOLDS",
    "METHODS",
    "UNIFORM_METHODS",
    "QuantizedRows",
    "SB_BYTES",
    "check_thresholds",
    "fused_int8_rows",
    "pack_codes",
    "packed_nbytes",
    "padded_dim",
    "quantize",
    "search_ranges",
    "select_bits",
    "unpack_codes",
]
