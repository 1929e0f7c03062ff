"""Tunable constants, each overridable by an environment variable.

These are performance knobs, not behaviour: a checkpoint written with one value
restores with any other.
"""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


def restore_chunk_rows() -> int:
    """Rows scattered into a local shard per step of a restore (bounds temporary memory)."""
    return _int("TORCHREC_CNR_RESTORE_CHUNK_ROWS", 1 << 20)


def collective_timeout_s() -> int:
    """Seconds a rank waits for the others at a checkpoint barrier."""
    return _int("TORCHREC_CNR_COLLECTIVE_TIMEOUT_S", 600)
