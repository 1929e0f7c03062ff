"""The one size unit of the public API: every size an option takes is in MB (``*_mb``),
and :func:`mb_bytes` is the one place a MB becomes bytes."""

from __future__ import annotations

import math
from typing import overload

__all__ = ["check_size_mb", "mb_bytes"]


@overload
def mb_bytes(mb: float) -> int: ...
@overload
def mb_bytes(mb: float | None) -> int | None: ...
def mb_bytes(mb: float | None) -> int | None:
    """``mb`` megabytes in bytes, whole; ``None`` (no bound) stays ``None``.

    Every option in MB (``staging_memory_mb``, ``restore_memory_mb``,
    ``priority_budget_mb``, ``IOOptions.object_mb``, the follower's ``memory_budget_mb``,
    the export's ``budget_mb``) counts a MB as 2**20 bytes, here and nowhere else.
    """
    return None if mb is None else int(mb * 2**20)


def check_size_mb(name: str, mb: object) -> None:
    """Refuses a size option in MB that is not a finite number of at least 1 KiB, naming it.

    Raises:
        ValueError: naming ``name`` and the value.
    """
    if (
        not isinstance(mb, int | float) or isinstance(mb, bool)
        or not math.isfinite(mb) or mb_bytes(mb) < 1024
    ):  # fmt: skip
        raise ValueError(f"{name} must be at least 1/1024 (1 KiB, finite), got {mb!r}")
