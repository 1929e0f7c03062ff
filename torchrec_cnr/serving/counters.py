"""What a follower did: a report per update applied, and counters of its polls.

:mod:`.metrics` exposes them to Prometheus; ``cnr-train serve`` writes them to its
metrics file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchrec_cnr.serving.gate import RefusedUpdate

__all__ = ["Counters", "UpdateReport"]


@dataclass(frozen=True)
class UpdateReport:
    """What one update did."""

    step: int
    """The step served after it."""
    checkpoint: str
    """The served checkpoint's id."""
    rows: int
    """Rows read and applied."""
    bytes_read: int
    """Bytes read from the root (manifest, indexes, ids and rows)."""
    requests: int
    """Requests made to the root (each read, ranged read, stat or listing)."""
    seconds: float
    """From the poll to the update applied."""
    blocked_s: float
    """How long serving was blocked (the exclusive side of the lock)."""
    lag_s: float
    """From the checkpoint's commit to the update applied."""
    cold: bool
    """Every row was read: no recorded path of changes from the served checkpoint."""
    rewind: bool
    """The root's latest checkpoint is older than the one served before."""
    held_bytes: int = 0
    """Memory the update's rows took at once: as read, and in serving form where that is
    not a view of them (the spare copy of swap mode is :attr:`Follower.spare_bytes`); over
    the memory budget, the most one piece took."""
    spilled_bytes: int = 0
    """Over the memory budget: the bytes of the rows in mapped files (page cache)."""


@dataclass
class Counters:
    """A follower's updates, refusals and polls, oldest first."""

    reports: list[UpdateReport] = field(default_factory=list)
    """Every update applied."""
    refused: list[RefusedUpdate] = field(default_factory=list)
    """Updates the accept gate refused."""
    polls: int = 0
    """Polls made (on the polling thread or not; pinned ones too)."""
    idle_polls: int = 0
    """Polls that found nothing new to serve, once a step was served."""
    idle_requests: int = 0
    """Requests those polls made (one stat or HEAD each, while the manifest stays)."""

    def count_idle(self, requests: int) -> None:
        """Counts a poll that found nothing new to serve, having made ``requests``."""
        self.idle_polls += 1
        self.idle_requests += requests

    def refused_last(self, checkpoint: str) -> bool:
        """Whether the last update refused came from ``checkpoint``."""
        return bool(self.refused) and self.refused[-1].checkpoint == checkpoint
