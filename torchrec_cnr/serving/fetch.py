"""Reads one update, ready to apply: plans it, reads its rows and dense state, and shows
them to the accept gate, spilling them to mapped files over the memory budget.

Nothing here changes the serving model: everything that can fail (a file retired or
replaced while read, a damaged file, a model that does not match) fails before
:mod:`.apply` runs, and the follower keeps serving the last good step.
"""

from __future__ import annotations

import contextlib

import torch

from torchrec_cnr.iocontext import IOContext
from torchrec_cnr.manifest import Entry, Manifest, Summary
from torchrec_cnr.read import ChainReader, MemoryBudget
from torchrec_cnr.restore import check_serving
from torchrec_cnr.serving.gate import AcceptGate, PendingUpdate
from torchrec_cnr.serving.locate import Read, read_table
from torchrec_cnr.serving.plan import UpdatePlan, plan_update
from torchrec_cnr.serving.rows import StoredRows
from torchrec_cnr.serving.spill import Spill, piece_bytes, piece_rows
from torchrec_cnr.serving.targets import ServingTarget
from torchrec_cnr.snapshot.buffers import Buffers
from torchrec_cnr.snapshot.reader import settle
from torchrec_cnr.storage import Storage

__all__ = ["UpdateReader"]


class UpdateReader:
    """Reads updates of ``target`` from ``storage``.

    Args:
        storage: the root, read only.
        io: the I/O context its reads run on.
        target: the serving model, wrapped: its tables and dense tensors say what to read
            (and must match the checkpoint's).
        accept: the accept gate; ``None`` accepts everything. Over the memory budget it
            sees each piece as it is read; otherwise the follower shows it the whole
            update.
        memory_budget: the most bytes an update's rows take in memory, with what the
            process's other reads hold (:class:`~torchrec_cnr.read.MemoryBudget`); a larger
            update is read in pieces and spilled (:mod:`.spill`). ``None``: no bound.
        spill_dir: where the spilled files go; the temporary folder if ``None``.
    """

    def __init__(
        self,
        storage: Storage,
        io: IOContext,
        target: ServingTarget,
        accept: AcceptGate | None = None,
        memory_budget: int | None = None,
        spill_dir: str | None = None,
    ) -> None:
        self.storage = storage
        self.io = io
        self.target = target
        self.accept = accept
        self.memory_budget = memory_budget
        self.spill_dir = spill_dir
        self.buffers = Buffers()
        """What warm updates read into, reused from one to the next (see
        :mod:`torchrec_cnr.snapshot.buffers`); a cold one, every row, reads into fresh
        memory, which is not kept."""

    def read(
        self, manifest: Manifest, latest: Summary, served: Entry | None
    ) -> PendingUpdate | None:
        """The update from ``served`` to ``latest``, read and ready; ``None`` if ``latest``
        is served already. Over the memory budget, an update a piece of which the gate
        refused has :attr:`PendingUpdate.refused` set and is read no further.

        Raises:
            ModelMismatchError: the checkpoint does not match the target.
        """
        chain = ChainReader(self.storage, manifest, latest, self.io, verify=False, lazy=True)
        entry = chain.entry
        slots = {
            key: (s.num_embeddings, s.embedding_dim) for key, s in self.target.tables().items()
        }
        check_serving(entry, slots, self.target.dense_names(), self.storage.url)
        plan = plan_update(manifest, chain, served, None if served is None else served.id)
        if plan is None:
            return None
        memory = MemoryBudget(self.memory_budget)
        update = PendingUpdate(plan, memory=memory)
        if memory.take(_need(plan, entry)):  # within what the process's other reads leave
            self._read_whole(update, chain, entry)
        else:
            update.spill = Spill(self.target, self.spill_dir)
            if not self._read_pieces(update, chain, entry):
                return update  # a piece was refused
        if plan.dense or plan.cold:
            shapes, dense = self.target.tables(), self.target.dense_names()
            read = chain.dense([n for n in entry.dense if n in dense or n in shapes])
            for name, tensor in read.items():
                if name in shapes:  # a data-parallel table: replicated, saved with the dense
                    ids = torch.arange(tensor.shape[0])
                    if not self._take(update, name, [(ids, StoredRows.fp32(tensor))]):
                        return update
                else:
                    update.dense[name] = tensor
        return update

    def _read_whole(self, update: PendingUpdate, chain: ChainReader, latest: Entry) -> None:
        """Every table's rows into ``update``: each table's reads queued before the next
        table is located, so that the reading threads stay busy while this one plans."""
        keys: list[str] = []
        reads: list[Read] = []
        buffers = None if update.plan.cold else self.buffers
        if buffers is not None:
            buffers.trim()  # what the last update took stays, no more
        try:
            for table, shape in latest.tables.items():
                wanted = _wanted(update.plan, table)
                if wanted is None or wanted.numel():
                    queued = read_table(chain, table, wanted, update.plan.newer, buffers)
                    keys += [shape.state_dict_key] * len(queued)
                    reads += queued
        except BaseException:
            with contextlib.suppress(Exception):
                settle(reads)  # none left reading
            raise
        update.rows += [(key, ids, rows) for key, (ids, rows) in zip(keys, settle(reads))]

    def _read_pieces(self, update: PendingUpdate, chain: ChainReader, latest: Entry) -> bool:
        """Over the memory budget: each table's rows read a piece at a time, each shown to
        the gate and spilled before the next is read; False if the gate refused one."""
        assert update.memory is not None
        share = update.memory.share()
        assert share is not None  # unbounded, every update is read whole
        for table, shape in latest.tables.items():
            wanted = _wanted(update.plan, table)
            if wanted is not None and not wanted.numel():
                continue
            every = torch.arange(shape.num_embeddings) if wanted is None else wanted
            for part in every.split(piece_rows(share, shape.embedding_dim)):
                reads = read_table(chain, table, part, update.plan.newer)
                if not self._take(update, shape.state_dict_key, settle(reads)):
                    return False
        return True

    def _take(
        self, update: PendingUpdate, key: str, pieces: list[tuple[torch.Tensor, StoredRows]]
    ) -> bool:
        """Adds rows of ``key`` read together to ``update``: held in it, or, over the memory
        budget, shown to the gate as one piece and spilled; False if the gate refused it."""
        rows = [(key, ids, r) for ids, r in pieces]
        if update.spill is None:
            update.rows += rows
            return True
        if self.accept is not None:
            update.refused = self.accept(PendingUpdate(update.plan, rows))
            if update.refused is not None:
                return False
        update.spill.add(rows)
        return True


def _need(plan: UpdatePlan, latest: Entry) -> int:
    """What an update's rows take while it is prepared (:func:`piece_bytes` a row)."""
    need = 0
    for table, shape in latest.tables.items():
        wanted = _wanted(plan, table)
        rows = shape.num_embeddings if wanted is None else int(wanted.numel())
        need += rows * piece_bytes(shape.embedding_dim)
    return need


def _wanted(plan: UpdatePlan, table: str) -> torch.Tensor | None:
    """The rows of ``table`` ``plan`` reads: ``None`` for every row (a cold plan), none
    for a table a warm plan does not name (it did not change)."""
    if plan.cold:
        return None
    return plan.rows.get(table, torch.empty(0, dtype=torch.int64))
