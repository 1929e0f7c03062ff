"""Method names, bit widths, argument validation and the bit-width policy.

Everything here is cheap and device-agnostic; the numeric work lives in the
sibling modules.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

#: Uniform (affine) quantizers: fused rowwise layout, per-row scale and bias.
UNIFORM_METHODS: tuple[str, ...] = ("symmetric", "asymmetric", "adaptive")
#: Every method that maps rows onto ``2**bits`` levels.
CODE_METHODS: tuple[str, ...] = (*UNIFORM_METHODS, "kmeans")
#: Plain dtype casts; ``bits`` is ignored for these.
CAST_METHODS: tuple[str, ...] = ("fp16", "bf16", "none")
#: The dtype each cast stores.
CAST_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "none": torch.float32,
}
#: All accepted values of ``method``.
METHODS: tuple[str, ...] = (*CODE_METHODS, *CAST_METHODS)
#: Bit widths accepted by the code methods.
BITS: tuple[int, ...] = (2, 3, 4, 8)

#: Default ``select_bits`` thresholds: (max expected restores, bits), ascending.
DEFAULT_THRESHOLDS: tuple[tuple[int, int], ...] = ((1, 2), (3, 3), (20, 4))


def check_method_bits(method: str, bits: int) -> int:
    """Validate ``method``/``bits`` and return the bit width actually stored.

    Args:
        method: One of :data:`METHODS`.
        bits: One of :data:`BITS` for the code methods; ignored for casts.

    Returns:
        ``bits`` for code methods, 16 for ``fp16``/``bf16`` and 32 for ``none``,
        so that a container always reports the width it really holds.

    Raises:
        ValueError: Unknown method, or a bit width the method cannot produce.
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; allowed: {', '.join(METHODS)}")
    if method in CAST_METHODS:
        return 32 if method == "none" else 16
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or int(bits) not in BITS:
        raise ValueError(
            f"bits={bits!r} is not supported by method {method!r}; allowed: "
            f"{', '.join(str(b) for b in BITS)}"
        )
    return int(bits)


def check_search_params(n_bins: int, ratio: float) -> None:
    """Validate the adaptive range-search parameters.

    Raises:
        ValueError: ``n_bins`` not a positive int or ``ratio`` outside [0, 1).
    """
    if isinstance(n_bins, bool) or not isinstance(n_bins, numbers.Integral) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive int, got {n_bins!r}")
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be a number in [0, 1), got {ratio!r}")


RowIds = torch.Tensor | int | None
"""Rows' ids in their table, for messages: a ``(N,)`` tensor, the id of the first of
consecutive rows, or ``None`` for their index."""


def _row_name(row: int, row_ids: RowIds) -> int:
    if row_ids is None:
        return row
    return row_ids + row if isinstance(row_ids, int) else int(row_ids[row])


def check_finite(rows: torch.Tensor, name: str, row_ids: RowIds = None) -> None:
    """Reject rows containing NaN or Inf.

    One full-tensor sum covers the common all-good case (NaN and Inf both
    survive a sum); the per-row scan that names the culprit only runs when
    the sum is not finite, which also clears sums that merely overflowed.

    Args:
        rows: (N, D) floating tensor.
        name: Table name used in error messages.
        row_ids: the rows' ids in their table, for messages (see :data:`RowIds`).

    Raises:
        ValueError: Naming ``name`` and the first offending row.
    """
    if rows.numel() == 0 or math.isfinite(float(rows.sum())):
        return
    bad = (~torch.isfinite(rows)).any(dim=1).nonzero()
    if bad.numel():
        row = _row_name(int(bad[0, 0]), row_ids)
        raise ValueError(f"table {name!r} row {row} contains NaN or Inf")


def check_fp16_stored(stored: torch.Tensor, name: str, what: str, row_ids: RowIds = None) -> None:
    """Reject rows whose fp16 parameters (or values) overflowed to Inf.

    Checked on the small stored tensor after encoding instead of on the
    input: whether a row fits depends on its min and range, not on |x| alone
    (a row spanning [0, 7e4] has a finite fp16 scale at 2 bits).

    Args:
        stored: (N, k) fp16 tensor the container will keep.
        name: Table name used in error messages.
        what: What ``stored`` holds, for the message.
        row_ids: the rows' ids in their table, for messages (see :data:`RowIds`).

    Raises:
        ValueError: Naming ``name`` and the first row that overflowed.
    """
    # Inputs are finite by now, so only Inf can appear; abs().amax() is the
    # cheapest full pass over fp16 on CPU (no conversion to fp32).
    if stored.numel() == 0 or math.isfinite(float(stored.abs().amax())):
        return
    ok = torch.isfinite(stored).all(dim=1)
    if not bool(ok.all()):
        row = _row_name(int((~ok).nonzero()[0, 0]), row_ids)
        raise ValueError(
            f"table {name!r} row {row} overflows the fp16 {what} (values too large for fp16); "
            "use bits=8, 'bf16' or 'none' for this table"
        )


def check_thresholds(thresholds: Sequence[Sequence[int | float]]) -> None:
    """Checks ``(max_restores, bits)`` pairs: limits strictly increasing, bits in :data:`BITS`.

    Raises:
        ValueError: naming the malformed pair or the whole list.
    """
    previous = float("-inf")
    for pair in thresholds:
        if len(pair) != 2:
            raise ValueError(f"each threshold must be (max_restores, bits), got {pair!r}")
        limit, bits = pair
        if not limit > previous:
            raise ValueError(
                f"threshold limits must be strictly increasing, got {list(thresholds)}"
            )
        if bits not in BITS:
            raise ValueError(f"threshold bits must be one of {BITS}, got {bits!r}")
        previous = limit


def select_bits(
    expected_restores: int | float,
    thresholds: Sequence[tuple[int | float, int]] = DEFAULT_THRESHOLDS,
) -> int:
    """Pick a bit width from the number of restores a checkpoint may see.

    Check-N-Run's rule: every restore compounds quantization error, so the more
    restores a checkpoint is expected to serve, the more bits it needs. With
    the default thresholds: ``L <= 1 -> 2``, ``L <= 3 -> 3``, ``L <= 20 -> 4``,
    otherwise 8.

    Args:
        expected_restores: Expected number of restores ``L`` (>= 0).
        thresholds: ``(max_restores, bits)`` pairs with strictly increasing
            ``max_restores`` and bits from :data:`BITS`.

    Returns:
        The bit width of the first threshold with ``L <= max_restores``, else 8.

    Raises:
        ValueError: Negative/non-numeric ``expected_restores`` or malformed
            thresholds.
    """
    if isinstance(expected_restores, bool) or not isinstance(expected_restores, (int, float)):
        raise ValueError(f"expected_restores must be a number, got {expected_restores!r}")
    if not expected_restores >= 0:  # also rejects NaN
        raise ValueError(f"expected_restores must be >= 0, got {expected_restores!r}")
    check_thresholds(thresholds)
    for limit, bits in thresholds:
        if expected_restores <= limit:
            return int(bits)
    return 8
