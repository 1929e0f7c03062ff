"""What a read of a chain wants, as frozen data: stored tensors (or spans of their rows)
by link, rank and name, in groups held together, and the memory budget they are read
under (carried out by :mod:`torchrec_cnr.read.plan`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from torchrec_cnr.encoding import ShardRecord

__all__ = ["Alloc", "MemoryBudget", "ReadItem", "ReadPlan", "TensorKey"]

TensorKey = tuple[int, int, str]
"""(link index in the chain, storage rank, stored name)."""


@dataclass(frozen=True)
class ReadItem:
    """One stored tensor of one link of a chain, or a span of its rows."""

    link: int
    """Index of the link in the chain, baseline first."""
    rank: int
    """The storage rank that saved it."""
    tensor: str
    """Its stored name."""
    span: tuple[int, int] | None = None
    """Rows ``lo..hi - 1`` alone (read in the checksummed blocks they lie in); ``None``:
    the whole tensor."""
    blocks: tuple[int, ...] | None = None
    """The record's block checksums of the tensor (see
    :attr:`~torchrec_cnr.encoding.ShardRecord.block_checksums`), for a span."""
    positions: torch.Tensor | None = field(default=None, compare=False)
    """``(k,)`` ascending stored rows alone, read as ranged reads of their runs (a
    follower's changed rows, scattered through a checkpoint): streamed by
    :func:`~torchrec_cnr.read.plan.stream`, never held by a reader."""

    @classmethod
    def of(
        cls, link: int, rec: ShardRecord, name: str, window: tuple[int, int] | None = None
    ) -> ReadItem:
        """Stored tensor ``name`` of saved shard ``rec`` (of link ``link``): rows
        ``window`` alone (in the blocks the record has checksums of) if given, else whole."""
        if window is None:
            return cls(link, rec.spec.rank, name)
        blocks = rec.block_checksums.get(name)
        return cls(link, rec.spec.rank, name, window, None if blocks is None else tuple(blocks))

    @property
    def key(self) -> TensorKey:
        """Where the reader holds it: ``(link, rank, tensor)``."""
        return (self.link, self.rank, self.tensor)


@dataclass(frozen=True)
class ReadPlan:
    """Groups of read items, in order: a group is held whole or not at all (the tensors of
    one saved shard's rows, say, are applied together)."""

    groups: tuple[tuple[ReadItem, ...], ...]
    hold_all: bool = False
    """Hold every item whatever the budget (its bytes still count): reads the rest of the
    plan depends on (a restore's saved ids)."""


class MemoryBudget:
    """The host memory a read may hold, in bytes (``None``: no bound), and what it holds."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.used = 0

    @property
    def left(self) -> int | None:
        """Bytes not yet taken (``None``: no bound)."""
        return None if self.limit is None else max(0, self.limit - self.used)

    def take(self, nbytes: int, always: bool = False) -> bool:
        """Takes ``nbytes`` if they fit (or ``always``); whether they were taken."""
        if always or self.limit is None or self.used + nbytes <= self.limit:
            self.used += nbytes
            return True
        return False

    def rows(self, row_bytes: int) -> int:
        """Rows of ``row_bytes`` each in one piece of at most the budget; at least one."""
        assert self.limit is not None, "an unbounded budget is read whole"
        return max(1, self.limit // max(1, row_bytes))


Alloc = Callable[[ReadItem, list[int], torch.dtype], torch.Tensor | None]
"""``alloc(item, shape, dtype)`` may give the tensor to read a whole item into (a reused
buffer, whose pages are already faulted in); ``None`` reads it into a fresh one."""
