"""The one size unit of the public API: every size an option takes is in MB (``*_mb``),
and :func:`mb_bytes` is the one place a MB becomes bytes."""

from __future__ import annotations

from typing import overload

__all__ = ["mb_bytes"]


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
