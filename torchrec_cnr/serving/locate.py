"""Where a follower reads each row of an update: which checkpoint of the chain, at which
positions, each row once.

:mod:`.plan` says which rows changed since the served checkpoint; this module finds, for
each of them, its latest stored version and reads it:

- a cold update (nothing served, or no recorded path of changes) reads every row from
  the target's chain, newest link first;
- a warm one reads from the checkpoints since the served one (:attr:`UpdatePlan.newer`)
  alone: each row from the newest that changed it where those rows lie in one run (a
  tail, or a consecutive delta), the rest from the newest that stores it; or all from the
  target, where it stores them all and that costs fewer bytes and requests.

Rows are read with ranged reads of consecutive positions (a ranged GET on S3). A table
whose records split its rows by column (or were resharded) is assembled from its links
as a restore does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchrec_cnr.encoding import FP32, ShardRecord
from torchrec_cnr.manifest import Summary
from torchrec_cnr.quantization import UNIFORM_METHODS
from torchrec_cnr.read import ChainReader, find_ids
from torchrec_cnr.read.items import ReadItem
from torchrec_cnr.read.plan import stream
from torchrec_cnr.serving.plan import changed_rows
from torchrec_cnr.serving.rows import StoredRows
from torchrec_cnr.snapshot.buffers import Buffers
from torchrec_cnr.snapshot.reader import settle

__all__ = ["Read", "read_table"]


@dataclass
class _Piece:
    """Rows ``ids`` of a table, stored at positions ``keep`` of ``rec`` of link ``link`` of
    ``reader``."""

    ids: torch.Tensor
    rec: ShardRecord
    keep: torch.Tensor
    reader: ChainReader
    link: int

    def items(self, names: list[str]) -> list[ReadItem]:
        """Its rows of stored tensors ``names``, as read items."""
        rank = self.rec.spec.rank
        return [ReadItem(self.link, rank, name, positions=self.keep) for name in names]

    def cost(self) -> int:
        """The bytes its read fetches, a request counted as ``request_bytes`` more."""
        snapshot, total = self.reader.reader(self.link), 0
        for name in self.rec.value_names:
            nbytes, requests = snapshot.subset_cost(self.rec.spec.rank, name, self.keep)
            total += nbytes + requests * snapshot.storage.request_bytes
        return total

    def begin(self, buffers: Buffers | None) -> Read:
        """Queues its reads (into ``buffers`` where given); returns what waits for them and
        gives ``(ids, rows)``, the rows as stored."""
        rec = self.rec
        names = rec.value_names
        parts = stream(self.reader, self.items(names), buffers)
        if rec.format == FP32:
            return lambda: (self.ids, StoredRows.fp32(parts[0]()))

        def finish() -> tuple[torch.Tensor, StoredRows]:
            read = dict(zip(rec.parts, settle(parts)))
            return self.ids, StoredRows.quantized(
                read, rec.format.method, rec.format.bits, rec.spec.cols
            )

        return finish


Read = Callable[[], tuple[torch.Tensor, StoredRows]]
"""Waits for the reads of some rows of a table, queued already, and gives ``(ids, rows)``."""


def _same_values(rec: ShardRecord, ours: list[ShardRecord], cols: int) -> bool:
    """Whether ``rec`` stores a row as the target's records of its table would, had the
    row not changed in between: whole rows, fp32, or one uniform format (a row quantizes
    the same way at every save; k-means or a bit width that changed may not)."""
    if rec.spec.cols != cols:
        return False
    if rec.format == FP32:
        return True
    return rec.format.method in UNIFORM_METHODS and all(
        r.format == rec.format and r.parts == rec.parts for r in ours
    )


def _located(
    source: ChainReader, table: str, wanted: torch.Tensor
) -> tuple[list[_Piece], torch.Tensor] | None:
    """Where ``source``'s links, newest first, store rows ``wanted`` of ``table``: each
    row's pieces, and the rows none stores; ``None`` if a record splits the table's rows
    by column (see :func:`_assemble`)."""
    shape = source.entry.tables[table]
    if not all(rec.spec.cols == shape.embedding_dim for _, rec in source.records(table)):
        return None
    if 2 * wanted.numel() >= shape.num_embeddings:
        return _located_densely(source, table, wanted, shape.num_embeddings)
    pieces = []
    for n in reversed(range(len(source.links))):
        for rec in source.link_records(n):
            if rec.spec.table != table or rec.saved_rows == 0 or not wanted.numel():
                continue
            found = source.locate(n, rec, wanted)
            pieces += [_Piece(ids, rec, keep, source, n) for ids, keep in found]
            if found:
                taken = (
                    found[0][0]
                    if len(found) == 1
                    else torch.cat([i for i, _ in found]).sort().values
                )
                wanted = wanted[~find_ids(taken, wanted)[0]]
    return pieces, wanted


def _located_densely(
    source: ChainReader, table: str, wanted: torch.Tensor, rows: int
) -> tuple[list[_Piece], torch.Tensor]:
    """:func:`_located` where most of the table's ``rows`` are wanted (a cold start): a
    mask of the rows still wanted, checked against every row each link stores, costs a
    pass over those ids instead of searches through the wanted ones."""
    left = torch.zeros(rows, dtype=torch.bool)
    left[wanted] = True
    pieces = []
    for n in reversed(range(len(source.links))):
        for rec in source.link_records(n):
            if rec.spec.table != table or rec.saved_rows == 0:
                continue
            for ids, at in source.stored(n, rec):
                hit = left[ids]
                if bool(hit.any()):
                    ids = ids[hit]
                    pieces.append(_Piece(ids, rec, at[hit], source, n))
                    left[ids] = False
    return pieces, left.nonzero().flatten()


def _from_newer(
    chain: ChainReader, source: ChainReader, table: str, wanted: torch.Tensor
) -> tuple[list[_Piece], torch.Tensor]:
    """Rows ``wanted`` of ``table`` from ``source``'s links (the checkpoints since the
    served one, oldest first: see :attr:`UpdatePlan.newer`), each from the newest that
    changed it, where those rows lie in one run: the pieces, and the rows left."""
    # The target's own records: a row read from a newer checkpoint must be stored as the
    # target stores it (its chain's older links are not read for a warm update).
    ours = [rec for rec in chain.link_records(-1) if rec.spec.table == table]
    dim = chain.entry.tables[table].embedding_dim
    pieces = []
    deferred = []  # changed by a checkpoint that does not store them in a run
    for n in reversed(range(len(source.links))):
        entry = source.links[n]
        for rec in chain.manifest.shards(entry):
            if rec.spec.table != table or rec.saved_rows == 0 or not wanted.numel():
                continue
            ids, start = changed_rows(chain, entry, rec)
            hit, at = find_ids(ids, wanted)
            if bool(hit.all()):  # the usual update: every row wanted is in this one
                found, wanted = wanted, wanted[:0]
            elif bool(hit.any()):
                found, at, wanted = wanted[hit], at[hit], wanted[~hit]
            else:
                continue
            if start is None or not _same_values(rec, ours, dim):
                # Their value is the target chain's: older checkpoints hold older ones.
                deferred.append(found)
            else:
                pieces.append(_Piece(found, rec, start + at, source, n))
    if deferred:
        wanted = torch.sort(torch.cat([wanted, *deferred])).values
    return pieces, wanted


def read_table(
    chain: ChainReader,
    table: str,
    wanted: torch.Tensor | None,
    newer: list[Summary],
    buffers: Buffers | None = None,
) -> list[Read]:
    """The latest stored version of rows ``wanted`` (every row if ``None``) of ``table``,
    each row read once: the reads of its ``(ids, rows)`` pieces, queued (:func:`settle`
    waits for them), so that the next table can be located while they run.

    A cold update reads them from ``chain``, newest link first. A warm one reads them
    from ``newer`` alone, which stores every row it wants (the target's chain is not
    read): each from the newest checkpoint that changed it where those lie in one run
    (:func:`_from_newer`), the rest from the newest that stores it; or, where the target
    stores them all (a full checkpoint, or a delta since a baseline no later than the
    served one) and that costs less, all from the target (the survivors of older
    checkpoints' runs lie scattered through them). Rows are read into ``buffers`` where
    given."""
    rows = torch.arange(chain.entry.tables[table].num_embeddings) if wanted is None else wanted
    if not newer:
        return _read_rest(chain, table, [], rows, _located(chain, table, rows), buffers)
    source = chain.narrowed(newer[::-1])
    pieces, rest = _from_newer(chain, source, table, rows)
    found = _located(source, table, rest)
    if len(newer) > 1 and (alone := _located(chain.narrowed([chain.entry]), table, rows)):
        if not alone[1].numel() and (
            found is None
            or sum(p.cost() for p in alone[0]) < sum(p.cost() for p in pieces + found[0])
        ):
            return [p.begin(buffers) for p in alone[0]]
    return _read_rest(source, table, pieces, rest, found, buffers)


def _read_rest(
    source: ChainReader,
    table: str,
    pieces: list[_Piece],
    rest: torch.Tensor,
    found: tuple[list[_Piece], torch.Tensor] | None,
    buffers: Buffers | None,
) -> list[Read]:
    """``pieces`` read, then rows ``rest`` where :func:`_located` ``found`` them in
    ``source`` (``None``: assembled from its links, split by column, before this returns)."""
    if found is not None:
        return [p.begin(buffers) for p in pieces + found[0]]
    if not rest.numel():
        return [p.begin(buffers) for p in pieces]
    values = StoredRows.fp32(_assemble(source, table, rest))
    return [*(p.begin(buffers) for p in pieces), lambda: (rest, values)]


def _assemble(source: ChainReader, table: str, wanted: torch.Tensor) -> torch.Tensor:
    """Full fp32 rows ``wanted`` of a table whose rows are split by column (or
    resharded): each from the newest of ``source``'s links that stores all its columns;
    a row no link stores whole, from every link, oldest first (as a restore does)."""
    from torchrec_cnr.read.tables import table_values

    dim = source.entry.tables[table].embedding_dim
    out = torch.zeros(wanted.numel(), dim)
    left = torch.arange(wanted.numel())  # positions in ``wanted`` still to read
    for n in reversed(range(len(source.links))):
        cover = torch.zeros(left.numel(), dtype=torch.int64)  # columns link n stores
        for rec in source.link_records(n):
            if rec.spec.table == table and rec.saved_rows and left.numel():
                for ids, _ in source.locate(n, rec, wanted[left]):
                    cover[find_ids(wanted[left], ids)[1]] += rec.spec.cols
        whole = cover == dim
        if bool(whole.any()):
            link = source.narrowed([source.links[n]])
            out[left[whole]] = table_values(link, table, wanted[left[whole]])
            left = left[~whole]
    if left.numel():
        out[left] = table_values(source, table, wanted[left])
    return out
