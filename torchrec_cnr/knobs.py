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


def collective_timeout_s() -> int:
    """Seconds a rank waits for the others at a checkpoint barrier."""
    return _int("TORCHREC_CNR_COLLECTIVE_TIMEOUT_S", 600)


def io_threads() -> int:
    """Threads per rank that encode, write and read a checkpoint's objects at once."""
    return _int("TORCHREC_CNR_IO_THREADS", 8)


def object_bytes() -> int:
    """Largest data object a checkpoint writes (whole rows): a tensor larger than this is
    written as several objects, in parallel."""
    return _int("TORCHREC_CNR_OBJECT_KB", 64 << 10) << 10


def lease_ttl_s() -> int:
    """Seconds after its last refresh that a root's lease stops counting as held by a live
    job (the holder refreshes it every quarter of this)."""
    return _int("TORCHREC_CNR_LEASE_TTL_S", 60)


def inject_fault(step: int, rank: int, phase: str = "write") -> None:
    """Fault injection for tests: ``TORCHREC_CNR_INJECT_FAULT=KIND@WHEN:RANK[,...]``.

    Called by the background writer after a checkpoint's files are written and before
    they are made durable and committed (``phase="write"``), and likewise during a
    compaction (``phase="compact"``). KIND is ``oserror`` (raise ENOSPC), ``sigkill``
    (kill this process) or ``delay`` (sleep 3 s). WHEN is a step or ``*`` for a save,
    ``compact`` for a compaction; RANK may be ``*``.
    """
    raw = os.environ.get("TORCHREC_CNR_INJECT_FAULT")
    if not raw:
        return
    import errno
    import signal
    import time

    for item in raw.split(","):
        kind, _, where = item.partition("@")
        when, _, at_rank = where.partition(":")
        hit = when == "compact" if phase == "compact" else when in ("*", str(step))
        if not hit or at_rank not in ("*", str(rank)):
            continue
        if kind == "oserror":
            raise OSError(
                errno.ENOSPC, f"injected: no space left on device (step {step}, rank {rank})"
            )
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "delay":
            time.sleep(3.0)
