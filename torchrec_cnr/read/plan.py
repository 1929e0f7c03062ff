"""Reads as a plan: what a reader of a chain wants, as frozen items
(:mod:`torchrec_cnr.read.items`), carried out in one place under one memory budget.

A restore plans before it reads: first the saved ids it places rows by, then every stored
tensor (or span of rows of one) its placed shards need. :func:`carry_out` reads a plan:
what fits the :class:`~torchrec_cnr.read.items.MemoryBudget` is read (every link's reads
at once) and held by the reader it returns; the rest is only verified, a few pieces at
a time within what the budget leaves, to be read again where it is used. The export and
the follower cut their reads into pieces by the same budget
(:meth:`~torchrec_cnr.read.items.MemoryBudget.rows`).

A follower streams its reads instead of holding them: :func:`stream` begins items of
scattered rows (:attr:`~torchrec_cnr.read.items.ReadItem.positions`) and returns what
waits for each, so that the next table is planned while they run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchrec_cnr.read.chain import ChainReader
from torchrec_cnr.read.items import Alloc, MemoryBudget, ReadItem, ReadPlan, TensorKey
from torchrec_cnr.snapshot.buffers import Buffers
from torchrec_cnr.snapshot.reader import ending_first, settle

__all__ = ["Held", "carry_out", "stream"]


@dataclass(frozen=True)
class Held:
    """A carried-out plan."""

    chain: ChainReader
    """The reader, holding what it held before and every item read."""
    deferred: tuple[ReadItem, ...]
    """Items over the budget: verified, not held; read again where they are used."""
    spare_bytes: int | None
    """The budget left over what is held (``None``: no bound): a deferred item is read
    again about this many bytes at a time."""


def _nbytes(chain: ChainReader, item: ReadItem) -> int:
    """The bytes ``item`` takes once read (nothing is read)."""
    if item.span is None:
        return chain.nbytes(item.link, item.rank, item.tensor)
    row_bytes = chain.reader(item.link).row_bytes(item.rank, item.tensor)
    return row_bytes * (item.span[1] - item.span[0])


def _into(
    items: dict[tuple[int, str], ReadItem], alloc: Alloc | None
) -> Callable[[tuple[int, str], list[int], torch.dtype], torch.Tensor | None] | None:
    """``alloc`` as :meth:`~torchrec_cnr.snapshot.SnapshotReader.read_many` calls it."""
    if alloc is None:
        return None
    return lambda key, shape, dtype: alloc(items[key], shape, dtype)


def carry_out(
    chain: ChainReader, plan: ReadPlan, budget: MemoryBudget, alloc: Alloc | None = None
) -> Held:
    """Reads ``plan``: each group that fits ``budget`` (in the plan's order) is read and
    held, every link's reads at once (a failure raised once all have ended); each item of
    the others is read only to verify it, within what the budget leaves.

    Raises:
        CheckpointReadError: a stored tensor cannot be read.
        ChecksumError: a stored tensor does not match its recorded checksum.
    """
    held: dict[TensorKey, torch.Tensor] = {}
    deferred: list[ReadItem] = []
    to_read: dict[int, list[ReadItem]] = {}
    seen = set(chain.held)
    for group in plan.groups:
        assert all(item.positions is None for item in group), "scattered rows: see stream"
        todo = [item for item in group if item.key not in seen]
        seen.update(item.key for item in todo)
        if budget.take(sum(_nbytes(chain, item) for item in todo), plan.hold_all):
            for item in todo:
                to_read.setdefault(item.link, []).append(item)
        else:
            deferred += todo
    links: list[int] = []
    begun: list[Callable[[], dict[tuple[int, str], torch.Tensor]]] = []
    with ending_first(begun):  # every link's reads at once, the deltas' beside the baseline's
        for n, items in sorted(to_read.items()):
            spans = [item for item in items if item.span is not None]
            held.update(zip((item.key for item in spans), chain.windows(spans)))
            whole = {(item.rank, item.tensor): item for item in items if item.span is None}
            begun.append(chain.reader(n).begin_many(list(whole), _into(whole, alloc)))
            links.append(n)
    for n, got in zip(links, settle(begun)):
        held.update({(n, *key): tensor for key, tensor in got.items()})
    spare = budget.left
    for item in deferred:  # read again where used: checked now, before anything changes
        chain.check(item, spare or 0)
    return Held(chain.holding(held), tuple(deferred), spare)


def stream(
    chain: ChainReader, items: list[ReadItem], buffers: Buffers | None = None
) -> list[Callable[[], torch.Tensor]]:
    """Begins reading ``items``, each of scattered rows (``positions``; with a record's
    verification off, only their bytes), all at once on the I/O threads, into ``buffers``
    where given: for each, the call that waits for its rows, as stored."""
    begun = []
    for item in items:
        assert item.positions is not None, "stream reads scattered rows; carry_out the rest"
        reader = chain.reader(item.link)
        begun.append(
            reader.begin_rows_subset(item.rank, item.tensor, item.positions, buffers=buffers)
        )
    return begun
