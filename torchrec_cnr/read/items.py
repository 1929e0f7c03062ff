"""What a read of a chain wants, as frozen data: stored tensors (or spans of their rows)
by link, rank and name, in groups held together, and the memory budget they are read
under (carried out by :mod:`torchrec_cnr.read.plan`).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from torchrec_cnr.encoding import ShardRecord

__all__ = ["Alloc", "MemoryBudget", "ReadItem", "ReadPlan", "TensorKey", "held_by_reads"]

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


_LEDGER = threading.Lock()
_LIVE: weakref.WeakSet[MemoryBudget] = weakref.WeakSet()
"""Every budget of the process not yet dropped: the ledger of what its reads hold."""


def _forked() -> None:
    """A forked child (a data loader's worker, say) starts a ledger of its own: its
    parent's reads are not its, and a thread of the parent may have held the lock."""
    global _LEDGER, _LIVE
    _LEDGER, _LIVE = threading.Lock(), weakref.WeakSet()


os.register_at_fork(after_in_child=_forked)

SHARE_FLOOR = 0.25
"""The least share of its bound a read that sizes its own pieces takes (:meth:`MemoryBudget.
share`), however much the process's other reads hold: it goes on in smaller pieces, not
one row at a time."""


def held_by_reads() -> int:
    """The bytes every read of this process holds now, by the ledger."""
    with _LEDGER:
        return _held()


def _held(but: MemoryBudget | None = None) -> int:
    """What the ledger's budgets (but ``but``) hold; the caller holds :data:`_LEDGER`."""
    return sum(b.used for b in _LIVE if b is not but)


class MemoryBudget:
    """The host memory a read may hold, in bytes (``None``: no bound), and what it holds.

    Every read of a process (a restore, a follower's update, an export, a compaction) holds
    its bytes in one ledger, and takes more only while what all of them hold together stays
    within its bound: two at once (a background compaction beside a restore, say) share
    ``IOOptions.read_memory_mb`` instead of holding it twice. What a read took is given back
    when it ends (:meth:`release`, or ``with``) or when its budget is dropped. A forked
    child starts with a ledger of its own, empty.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.used = 0
        with _LEDGER:
            _LIVE.add(self)

    def __enter__(self) -> MemoryBudget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def left(self) -> int | None:
        """Bytes of the bound that no read of the process holds (``None``: no bound)."""
        return None if self.limit is None else max(0, self.limit - held_by_reads())

    def take(self, nbytes: int, always: bool = False) -> bool:
        """Takes ``nbytes`` if the process's reads, this one's included, stay within the
        bound with them (or ``always``); whether they were taken."""
        with _LEDGER:
            if always or self.limit is None or _held() + nbytes <= self.limit:
                self.used += nbytes
                return True
            return False

    def share(self) -> int | None:
        """What this read may hold in pieces it sizes itself, taken (in place of what it
        held): what the process's other reads leave of the bound, and at least
        :data:`SHARE_FLOOR` of it; ``None``: no bound."""
        if self.limit is None:
            return None
        with _LEDGER:
            self.used = max(self.limit - _held(but=self), int(self.limit * SHARE_FLOOR), 1)
            return self.used

    def release(self) -> None:
        """Gives back everything this read took."""
        with _LEDGER:
            self.used = 0

    def rows(self, row_bytes: int) -> int:
        """Rows of ``row_bytes`` each in one piece of at most the bound; at least one."""
        assert self.limit is not None, "an unbounded budget is read whole"
        return max(1, self.limit // max(1, row_bytes))


Alloc = Callable[[ReadItem, list[int], torch.dtype], torch.Tensor | None]
"""``alloc(item, shape, dtype)`` may give the tensor to read a whole item into (a reused
buffer, whose pages are already faulted in); ``None`` reads it into a fresh one."""
