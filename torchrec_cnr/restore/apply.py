"""Applying a chain of checkpoints to a live model, mapped by global row ids.

A restore is all or nothing. :func:`read_chain` reads and verifies every tensor this
rank needs from every link of the chain, deserializes ``app_state`` and plans where every
saved row lands (:mod:`torchrec_cnr.read.geometry`), checking each saved tensor's
shape against its destination, before anything changes. Its reads are two plans
(:mod:`torchrec_cnr.read.plan`): the saved ids of the deltas, which say where rows land,
then every tensor the placed shards need. A saved shard of which only some rows land on
this rank (a restore onto another sharding) is read in the checksummed blocks those lie in
(its window). Read tensors are held in host memory up to a budget; past it they are read
only to be verified (a few pieces at a time, windows through the host's cache), then read
again (and verified again) while applying: a saved shard of the same
layout straight into the model, a window straight into place where its rows land as one
piece, else a few blocks at a time, other tensors whole. Only when every rank has read and
planned (the caller agrees on it) does :func:`apply_chain` write into the model.

The chain is applied in order, baseline first, later links winning, so a checkpoint
restores onto any sharding and world size.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrec_cnr.encoding import FP32, ShardRecord, dtype_name
from torchrec_cnr.read.chain import ChainReader
from torchrec_cnr.read.geometry import (
    Placement,
    overlaps,
    place,
    scatter,
    scatter_weight,
    states_fit,
)
from torchrec_cnr.read.items import Alloc, MemoryBudget, ReadItem, ReadPlan, TensorKey
from torchrec_cnr.read.plan import carry_out
from torchrec_cnr.rowcopy import run_start
from torchrec_cnr.schema import without_gc
from torchrec_cnr.snapshot.objects import load_object
from torchrec_cnr.staging import StagingPool
from torchrec_cnr.tracking.shard import LocalShard

__all__ = ["PreparedRestore", "ReadOptions", "apply_chain", "own_part_suffices", "read_chain"]


@dataclass(frozen=True)
class ReadOptions:
    """How :func:`read_chain` reads: the host memory it may hold, the buffers it may read
    into and the types a saved ``app_state`` may hold."""

    budget_bytes: int | None = None
    """Host memory for read tensors; ``None`` keeps every one."""
    pool: StagingPool | None = None
    """The staging buffers, to read this rank's own baseline tensors into: a fresh
    gigabyte costs a page fault per 4 KiB, about as long as reading it."""
    safe_globals: Sequence[Any] = ()
    """Types ``app_state`` may hold beyond tensors, numbers, strings and plain containers
    (see :func:`~torchrec_cnr.snapshot.objects.load_object`)."""


def _same_layout(rec: ShardRecord, local: LocalShard) -> bool:
    """A whole fp32 shard saved with this very layout and state: copied as it is."""
    ss, ls = rec.spec, local.spec
    return (
        rec.all_rows
        and rec.format == FP32
        and (ss.row_offset, ss.col_offset, ss.rows, ss.cols)
        == (ls.row_offset, ls.col_offset, ls.rows, ls.cols)
        and states_fit(rec, local.optimizer, local.states)
        and all(rec.states[n].dtype == dtype_name(s) for n, s in local.states.items())
    )


def _needs(rec: ShardRecord, local: LocalShard) -> list[str]:
    """The stored tensors of ``rec`` a restore into ``local`` reads."""
    names = list(rec.value_names)
    if not rec.all_rows:
        names.append(rec.ids_name(rec.key))
    if states_fit(rec, local.optimizer, local.states):
        names += [rec.states[n].tensor for n in local.states]
    return names


@dataclass
class _Step:
    """One saved shard applied to one local shard."""

    link: int
    shard: int
    """Index of the local shard."""
    rec: ShardRecord
    whole: bool
    """Copy the saved tensors as they are (:func:`_same_layout`)."""
    where: Placement | None
    """Where the rows land, unless ``whole``."""
    window: Window | None = None
    """The saved rows read, if not all (``where.keep`` counts from its first)."""


@dataclass(frozen=True)
class PreparedRestore:
    """A chain whose every needed tensor was read and verified, planned, ready to apply."""

    chain: ChainReader
    """The chain's reader, holding what was read within the budget."""
    steps: list[_Step] = field(default_factory=list)
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    app_state: dict[str, Any] | None = None
    """Each ``app_state`` object's saved state dict, by name."""
    warnings: list[str] = field(default_factory=list)
    """Optimizer states that do not carry over, one message per table; where ``app_state``
    comes from another rank or is not restored."""
    spare_bytes: int | None = None
    """The budget left over what is held (``None``: no budget): windows verified but not
    held are read again while applying, about this many bytes at a time."""
    budget: MemoryBudget | None = field(default=None, compare=False)
    """What it holds, in the process's ledger of reads until it is dropped."""


def own_part_suffices(chain: ChainReader, shards: list[LocalShard], rank: int) -> bool:
    """Whether storage rank ``rank`` saved every one of ``shards``, with its very geometry,
    in every link of the chain: then no other rank's records hold any of their rows (a
    table's shards are disjoint, or replicas), and a restore reads that rank's alone."""
    want = {(s.spec.table, s.spec.row_offset, s.spec.col_offset, s.spec.rows, s.spec.cols)
            for s in shards}  # fmt: skip
    for link in chain.links:
        have = {(r.spec.table, r.spec.row_offset, r.spec.col_offset, r.spec.rows, r.spec.cols)
                for r in chain.manifest.shards(link, rank)}  # fmt: skip
        if not want <= have:
            return False
    return True


def _sources(
    chain: ChainReader, shards: list[LocalShard]
) -> list[tuple[int, ShardRecord, int, LocalShard]]:
    """``(link, saved shard, index of the local shard, local shard)`` for every saved shard
    of the chain that holds some element of a local shard: by table, then by overlap, so
    that a rank reads only the saved shards its own come from."""
    return [
        (n, rec, i, local)
        for i, local in enumerate(shards)
        for n, rec in chain.records(local.spec.table)
        if overlaps(rec.spec, local.spec)
    ]


Window = tuple[int, int]
"""Rows ``lo..hi - 1`` of a saved shard: the only ones of its rows that land on this rank."""


def _ids_plan(sources: list[tuple[int, ShardRecord, int, LocalShard]]) -> ReadPlan:
    """The saved ids of every delta placed by rows: read first, and held, to place them."""
    return ReadPlan(
        tuple(
            (ReadItem(n, rec.spec.rank, rec.ids_name(rec.key)),)
            for n, rec, _, local in sources
            if not rec.all_rows and not _same_layout(rec, local)
        ),
        hold_all=True,
    )


def _place(
    chain: ChainReader, sources: list[tuple[int, ShardRecord, int, LocalShard]]
) -> tuple[list[_Step], list[str]]:
    """Where every saved shard of the chain lands (its saved ids held), and a warning per
    table whose optimizer state does not carry over."""
    steps: list[_Step] = []
    warned: dict[str, str] = {}
    with without_gc():  # many small objects (see schema.without_gc)
        for n, rec, i, local in sources:
            if _same_layout(rec, local):
                steps.append(_Step(n, i, rec, True, None))
                continue
            where = place(rec.spec, chain.saved_ids(n, rec), local.spec)
            if where is None:
                continue
            steps.append(_Step(n, i, rec, False, where))
            if not states_fit(rec, local.optimizer, local.states):
                warned.setdefault(
                    local.spec.table,
                    f"table {local.spec.table!r}: the checkpoint holds {rec.optimizer} state "
                    f"{sorted(rec.states)}, the model trains with {local.optimizer} "
                    f"{sorted(local.states)}; its weights are restored, its optimizer state "
                    "is left as initialized",
                )
    return steps, list(warned.values())


def _windows(steps: list[_Step]) -> dict[tuple[int, int, str], Window]:
    """``(link, storage rank, record key)`` -> the rows of a saved shard that land on this
    rank, for each saved shard placed by rows where some of its rows land elsewhere (a
    restore onto another sharding reads only those, see :func:`_plan`)."""
    spans: dict[tuple[int, int, str], Window] = {}
    whole: set[tuple[int, int, str]] = set()
    for step in steps:
        key = (step.link, step.rec.spec.rank, step.rec.key)
        window = None if step.where is None else step.where.window
        if step.whole or window is None:
            whole.add(key)
        else:
            lo, hi = window
            old = spans.get(key, (lo, hi))
            spans[key] = (min(lo, old[0]), max(hi, old[1]))
    saved = {(s.link, s.rec.spec.rank, s.rec.key): s.rec.saved_rows for s in steps}
    return {
        key: (lo, hi)
        for key, (lo, hi) in spans.items()
        if key not in whole and hi - lo < saved[key]
    }


def _plan(
    steps: list[_Step], shards: list[LocalShard], windows: dict[tuple[int, int, str], Window]
) -> ReadPlan:
    """Every tensor the restore reads: a saved shard of which only ``windows`` land, its
    rows' tensors in those rows, held together or read again together; the others whole,
    baseline first."""
    spans: dict[tuple[int, int, str], dict[str, ReadItem]] = {}
    whole: dict[TensorKey, ReadItem] = {}
    for step in steps:
        rec = step.rec
        unit = (step.link, rec.spec.rank, rec.key)
        window = windows.get(unit)
        for name in _needs(rec, shards[step.shard]):
            if window is not None and name in rec.row_names:
                spans.setdefault(unit, {})[name] = ReadItem.of(step.link, rec, name, window)
            else:
                item = ReadItem(step.link, rec.spec.rank, name)
                whole.setdefault(item.key, item)
    by_link = sorted(whole.values(), key=lambda item: item.link)
    return ReadPlan(tuple(tuple(g.values()) for g in spans.values()) + tuple((i,) for i in by_link))


def _staging(pool: StagingPool, rank: int) -> Alloc:
    """Reads this rank's own baseline tensors into the staging buffers."""
    pool.begin()

    def alloc(item: ReadItem, shape: list[int], dtype: torch.dtype) -> torch.Tensor | None:
        mine = item.link == 0 and item.rank == rank
        return pool.take(item.tensor, tuple(shape), dtype) if mine else None

    return alloc


def _check(
    chain: ChainReader,
    shards: list[LocalShard],
    steps: list[_Step],
    windows: dict[tuple[int, int, str], Window],
) -> list[_Step]:
    """Checks each held tensor's rows against its record; points each step read in a
    window at the window's rows."""
    checked = []
    for step in steps:
        rec, local = step.rec, shards[step.shard]
        window = windows.get((step.link, rec.spec.rank, rec.key))
        if window is not None:
            assert step.where is not None and step.where.keep is not None
            where = dataclasses.replace(step.where, keep=step.where.keep - window[0])
            step = dataclasses.replace(step, where=where, window=window)
        checked.append(step)
        for name in _needs(rec, local):
            held = chain.held.get((step.link, rec.spec.rank, name))
            if held is None:
                continue  # over the budget: checked when read again
            rows = held.shape[0]
            if window is not None and name in rec.row_names:
                expected = window[1] - window[0]
            else:
                expected = rec.saved_rows
            if rows != expected:
                raise ValueError(
                    f"{chain.links[step.link].id}: {name} holds {rows} rows, the manifest "
                    f"records {rec.saved_rows}"
                )
    return checked


def read_chain(
    chain: ChainReader,
    shards: list[LocalShard],
    dense_names: list[str],
    app_rank: int | None,
    options: ReadOptions,
    world_size: int | None = None,
) -> PreparedRestore:
    """Reads, verifies and plans everything a restore of ``chain`` into ``shards`` needs.

    Args:
        chain: the chain to restore.
        shards: this rank's shards to restore.
        dense_names: dense tensors to restore (from the chain's last checkpoint).
        app_rank: this rank, to restore its ``app_state``; ``None`` for none. A rank
            beyond the checkpoint's world size takes that of ``app_rank % world_size``:
            replicated state (the dense optimizer of DDP replicas) is the same on every
            rank, and a fresh one would let this rank's replica drift from the others.
        options: the memory budget, the staging buffers and the types ``app_state`` may
            hold.
        world_size: the restoring job's; where it is smaller than the checkpoint's, rank
            0 warns which ranks' ``app_state`` (and which keys of it) no rank restores.

    Raises:
        CheckpointReadError: a checkpoint directory or file of the chain is missing or
            unreadable.
        ChecksumError: a stored tensor does not match its recorded checksum.
        ValueError: a stored tensor does not fit where it goes.
        UnsafeObjectError: the saved ``app_state`` names a type that is not allowed.
    """
    budget = MemoryBudget(options.budget_bytes)
    sources = _sources(chain, shards)
    chain = carry_out(chain, _ids_plan(sources), budget).chain
    steps, notes = _place(chain, sources)
    windows = _windows(steps)
    alloc = None
    if options.pool is not None and options.budget_bytes is None:
        alloc = _staging(options.pool, shards[0].spec.rank if shards else -1)
    held = carry_out(chain, _plan(steps, shards, windows), budget, alloc)
    chain = held.chain
    steps = _check(chain, shards, steps, windows)
    dense = chain.dense(dense_names)
    app_state = None
    if app_rank is not None:
        world = chain.entry.world_size
        source = app_rank % world
        blob = chain.app_state(source)
        what = f"{chain.links[-1].id}: the app_state of rank {source}"
        app_state = load_object(blob, options.safe_globals, what)
        if source != app_rank:
            notes.append(
                f"rank {app_rank} takes the app_state of rank {source}: the checkpoint was "
                f"written by {world} rank(s)"
            )
        if app_rank == 0 and world_size is not None and world_size < world:
            notes.append(_dropped_app_state(chain, world_size, options))
    return PreparedRestore(chain, steps, dense, app_state, notes, held.spare_bytes, budget)


def _dropped_app_state(chain: ChainReader, world_size: int, options: ReadOptions) -> str:
    """What a restore onto ``world_size`` ranks leaves of the checkpoint's ``app_state``."""
    world = chain.entry.world_size
    dropped = []
    for rank in range(world_size, world):
        try:
            saved = load_object(chain.app_state(rank), options.safe_globals, "")
            keys = ", ".join(repr(k) for k in saved) if isinstance(saved, dict) else "?"
        except Exception as e:  # it is not restored: its damage fails nothing
            keys = f"unreadable: {type(e).__name__}"
        dropped.append(f"rank {rank} ({keys})")
    return (
        f"the checkpoint was written by {world} ranks and this job has {world_size}: each "
        "rank restores the app_state of the rank of its number, so the app_state of "
        f"{'; '.join(dropped)} is not restored (a data reader there would start over from "
        "its own position; see docs/storage.md)"
    )


def _load_scalars(chain: ChainReader, shards: list[LocalShard]) -> None:
    """Sets each kernel's step counters to the saved ones of the tables it holds.

    After resharding, a kernel may hold tables that sat in different kernels; those
    counted the same steps, and the largest value is taken.
    """
    by_table: dict[str, list[ShardRecord]] = {}
    for rec in chain.link_records(-1):
        by_table.setdefault(rec.spec.table, []).append(rec)
    by_kernel: dict[int, tuple[LocalShard, dict[str, float]]] = {}
    for local in shards:
        for rec in by_table.get(local.spec.table, []):
            if not states_fit(rec, local.optimizer, local.states):
                continue
            _, merged = by_kernel.setdefault(id(local.kernel), (local, {}))
            for name, value in rec.scalars.items():
                merged[name] = max(value, merged.get(name, value))
    for local, merged in by_kernel.values():
        local.load_scalar_states(merged)


PIECE_BYTES = 16 << 20
"""The most bytes of rows :func:`_apply_again` reads at once, where rows do not go straight
into place: small enough for malloc to recycle (past its mmap threshold, 32 MB at most in
glibc, each piece would be fresh pages, faulted in again)."""


def _destinations(
    rec: ShardRecord, where: Placement, local: LocalShard
) -> dict[str, torch.Tensor] | None:
    """Where each stored tensor of ``rec`` read again lands, as one contiguous piece of the
    model, where its landing rows do: fp32 rows of every column, a run of saved rows to a
    run of rows, into host tensors of the stored dtypes. ``None`` otherwise."""
    assert where.keep is not None
    weight = local.weight
    if (
        rec.format != FP32
        or weight.dtype != torch.float32
        or weight.device.type != "cpu"
        or not weight.is_contiguous()
        or rec.spec.cols != local.spec.cols
        or run_start(where.keep) is None
        or run_start(where.rows) is None
    ):
        return None
    r0, n = int(where.rows[0]), where.count
    out = {rec.weight_name(rec.key): weight[r0 : r0 + n]}
    if states_fit(rec, local.optimizer, local.states):
        for name, state in local.states.items():
            if rec.states[name].dtype != dtype_name(state) or not state.is_contiguous():
                return None
            if state.dim() == 2 or where.owns_row_state:
                out[rec.states[name].tensor] = state[r0 : r0 + n]
    return out


def _apply_again(chain: ChainReader, step: _Step, local: LocalShard, spare_bytes: int) -> None:
    """Applies a step whose window was verified but not held: its rows read again, through
    the host's cache, each block checked again: straight into place where they land as one
    piece (:func:`_destinations`), else in pieces of about ``spare_bytes`` or
    :data:`PIECE_BYTES` (whole blocks of its values, one at least), each written into place.
    A tensor stored in blocks larger than a piece (a per-row state) is read for the whole
    window at once."""
    rec, where, window = step.rec, step.where, step.window
    assert where is not None and where.keep is not None and window is not None
    lo, count = window[0], window[1] - window[0]
    into = _destinations(rec, where, local)
    if into is not None:
        a = lo + int(where.keep[0])
        wanted = [ReadItem.of(step.link, rec, name, (a, a + where.count)) for name in into]
        chain.windows(wanted, cached=True, out=list(into.values()))
        return
    names = [name for name in _needs(rec, local) if name in rec.row_names]
    reader = chain.reader(step.link)
    row_bytes = sum(reader.row_bytes(rec.spec.rank, name) for name in names)
    block = rec.block_checksums.get(rec.value_names[0], [count])[0]
    rows = max(1, min(spare_bytes, PIECE_BYTES) // max(1, row_bytes) // block) * block
    by_piece = [name for name in names if rec.block_checksums.get(name, [count])[0] <= rows]
    once = [name for name in names if name not in by_piece]
    held = dict(
        zip(once, chain.windows([ReadItem.of(step.link, rec, n, window) for n in once], True))
    )
    fits = states_fit(rec, local.optimizer, local.states)
    first = lo // block * block  # pieces cut at whole blocks of the stored rows
    for start in range(first, window[1], rows):
        a, b = max(start, lo) - lo, min(start + rows, window[1]) - lo  # ``keep`` counts from ``lo``
        j0, j1 = torch.searchsorted(where.keep, torch.tensor([a, b])).tolist()
        if j0 == j1:
            continue
        piece = dataclasses.replace(where, keep=where.keep[j0:j1] - a, rows=where.rows[j0:j1])
        got = chain.windows(
            [ReadItem.of(step.link, rec, n, (lo + a, lo + b)) for n in by_piece], True
        )
        parts = {**{n: t[a:b] for n, t in held.items()}, **dict(zip(by_piece, got))}
        scatter_weight(local.weight, piece, rec, parts.__getitem__, chain.io.encode)
        if fits:
            for name, state in local.states.items():
                scatter(state, piece, parts[rec.states[name].tensor])


def apply_chain(
    prepared: PreparedRestore,
    shards: list[LocalShard],
    dense: Mapping[str, torch.Tensor],
    scalars: bool = True,
) -> list[torch.Tensor]:
    """Writes a read and planned chain into this rank's shards and dense tensors.

    ``scalars=False`` leaves the kernels' step counters as they are (a partial restore
    goes on from the live step). ``app_state`` is loaded apart, before this (see
    :mod:`torchrec_cnr.restore.collective`).

    Returns:
        For each local shard, a ``(rows,)`` bool mask of rows that came from a delta
        rather than the baseline.
    """
    for message in prepared.warnings:
        warnings.warn(message, stacklevel=3)
    chain = prepared.chain
    touched = [torch.zeros(s.spec.rows, dtype=torch.bool, device=s.weight.device) for s in shards]
    with torch.no_grad():
        for step in prepared.steps:
            local, rec = shards[step.shard], step.rec
            fetch = chain.fetch(step.link, rec)
            if step.whole:  # straight into place if not held
                rank = rec.spec.rank
                chain.read_into(step.link, rank, rec.weight_name(rec.key), local.weight)
                for name, state in local.states.items():
                    chain.read_into(step.link, rank, rec.states[name].tensor, state)
                if step.link > 0:
                    touched[step.shard][:] = True
                continue
            where = step.where
            assert where is not None
            if step.link > 0:
                touched[step.shard][where.rows.to(local.weight.device)] = True
            key = (step.link, rec.spec.rank, rec.value_names[0])
            if step.window is not None and key not in chain.held:
                _apply_again(chain, step, local, prepared.spare_bytes or 0)
                continue
            scatter_weight(local.weight, where, rec, fetch, chain.io.encode)
            if states_fit(rec, local.optimizer, local.states):
                for name, state in local.states.items():
                    scatter(state, where, fetch(rec.states[name].tensor))
        if scalars:
            _load_scalars(chain, shards)
        for name, tensor in dense.items():
            tensor.copy_(prepared.dense[name])
    return touched
