"""Staging: pooled host buffers within a byte budget, and whole or chunked staging into a sink."""

from __future__ import annotations

import dataclasses
import io
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from torchrec_cnr.selection.policy import Decision, Kind
from torchrec_cnr.snapshot import page_aligned
from torchrec_cnr.staging import StagedCheckpoint, StagedShard, StagingPool, stage
from torchrec_cnr.staging.lazy import LazyStaging
from torchrec_cnr.staging.plan import plan_save
from torchrec_cnr.staging.pool import _buffers_of, chunk_rows
from torchrec_cnr.staging.shard import stage_shard
from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.lookups import KernelLookups
from torchrec_cnr.tracking.shard import LocalShard, ShardSpec

F32 = torch.float32
I64 = torch.int64


class _Kernel:
    """Stands in for a TBE kernel: counts flushes and holds the step counter."""

    def __init__(self, iteration: float = 7.0) -> None:
        self.flushes = 0
        self.emb_module = SimpleNamespace(iter=torch.tensor([iteration]))

    def flush(self) -> None:
        self.flushes += 1


def _shard(
    rows: int = 10,
    cols: int = 4,
    row_offset: int = 100,
    kernel: _Kernel | None = None,
    states: str = "row",
    num_embeddings: int = 1000,
    seed: int = 0,
) -> LocalShard:
    """A shard of ``rows`` rows starting at global row ``row_offset``, with row-wise
    Adagrad's ``(rows,)`` momentum (``states="row"``), Adam's two ``(rows, cols)`` moments
    (``"element"``) or no state (``"none"``)."""
    g = torch.Generator().manual_seed(seed)
    spec = ShardSpec(
        "m.t", 0, "row_wise", row_offset, 0, rows, cols, num_embeddings, cols, "m.t.weight"
    )
    found: dict[str, torch.Tensor] = {}
    if states == "row":
        found["momentum1"] = torch.rand(rows, generator=g)
    elif states == "element":
        found["momentum1"] = torch.rand(rows, cols, generator=g)
        found["momentum2"] = torch.rand(rows, cols, generator=g)
    return LocalShard(
        spec=spec,
        weight=torch.randn(rows, cols, generator=g),
        states=found,
        optimizer="EXACT_ROWWISE_ADAGRAD" if states == "row" else "ADAM",
        words=torch.zeros(bitmap.num_words(rows), dtype=torch.int64),
        kernel=kernel if kernel is not None else _Kernel(),
    )


@dataclass
class _Handed:
    """What the sink saw of one ``add``: copies taken at once, and the buffers themselves."""

    key: str
    row0: int
    total: int | None
    first_row: int
    global_rows: torch.Tensor | int
    ids: torch.Tensor | None
    weight: torch.Tensor
    states: dict[str, torch.Tensor]
    scalars: dict[str, float]
    staged: StagedShard


@dataclass
class _RecordingSink:
    """A writer that records what it is handed, and checks that no buffer it holds is
    overwritten before its ``wait()``."""

    events: list[str] = field(default_factory=list)
    handed: list[_Handed] = field(default_factory=list)
    pending: list[_Handed] = field(default_factory=list)

    def start(self) -> None:
        self.events.append("start")

    def abandon(self) -> None:
        self.events.append("abandon")

    def add(self, shard: StagedShard, row0: int = 0, total: int | None = None) -> None:
        for earlier in self.pending:
            self._check_intact(earlier)
        rows = shard.global_rows()
        got = _Handed(
            key=shard.key,
            row0=row0,
            total=total,
            first_row=shard.first_row,
            global_rows=rows.clone() if isinstance(rows, torch.Tensor) else rows,
            ids=None if shard.ids is None else shard.ids.clone(),
            weight=shard.weight.clone(),
            states={n: s.clone() for n, s in shard.states.items()},
            scalars=dict(shard.scalars),
            staged=shard,
        )
        self.events.append("add")
        self.handed.append(got)
        self.pending.append(got)

    def wait(self) -> None:
        for got in self.pending:
            self._check_intact(got)
        self.pending.clear()
        self.events.append("wait")

    @staticmethod
    def _check_intact(got: _Handed) -> None:
        assert torch.equal(got.staged.weight, got.weight), "a buffer was reused before wait()"
        for name, value in got.states.items():
            assert torch.equal(got.staged.states[name], value)


class _AppState:
    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}


def _stage(
    shards: list[LocalShard],
    rows: list[torch.Tensor | None],
    pool: StagingPool,
    sink: _RecordingSink,
    dense: dict[str, torch.Tensor] | None = None,
) -> StagedCheckpoint:
    """Stages ``rows`` of each shard (every row where ``None``) as planned from their bits."""
    kind: Kind = "full" if all(r is None for r in rows) else "delta"
    for shard, r in zip(shards, rows):
        if shard.words is not None:  # None: a kernel whose every row counts as modified
            shard.words.zero_()
            bitmap.set_bits(shard.words, torch.arange(shard.spec.rows) if r is None else r)
    decision = Decision(kind, True)
    plan = plan_save(3, shards, decision, [False] * len(shards), pool.budget_bytes)
    return stage(plan, dense or {}, {"app": _AppState(5)}, pool, sink)


# StagingPool


def test_take_reuses_a_buffer_that_is_large_enough() -> None:
    pool = StagingPool()
    first = pool.take("a", (10, 4), F32)
    again = pool.take("a", (8, 4), F32)
    assert again.shape == (8, 4) and again.is_contiguous()
    assert again.data_ptr() == first.data_ptr()
    assert pool.nbytes == 50 * 4  # 40 elements with 25 % headroom


def test_take_grows_with_headroom_and_replaces_the_smaller_buffer() -> None:
    pool = StagingPool()
    pool.take("a", (10,), F32)
    grown = pool.take("a", (100,), F32)
    assert grown.shape == (100,)
    assert pool.nbytes == 125 * 4  # the old buffer is gone, the new one has 25 % headroom
    assert pool.take("a", (125,), F32).data_ptr() == grown.data_ptr()


def test_take_allocates_afresh_for_another_dtype() -> None:
    pool = StagingPool()
    pool.take("a", (10,), F32)
    ids = pool.take("a", (10,), torch.int64)
    assert ids.dtype == torch.int64
    assert pool.nbytes == 12 * 8  # only the int64 buffer is kept under the key


def test_take_of_zero_rows_gives_an_empty_tensor_of_the_shape() -> None:
    pool = StagingPool(budget_bytes=100)
    empty = pool.take("a", (0, 4), F32)
    assert empty.shape == (0, 4) and pool.nbytes == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8, torch.int64])
def test_buffers_start_on_a_page_boundary_for_direct_writes(dtype) -> None:
    pool = StagingPool()
    for rows in (1, 1000, 40_000):
        buf = pool.take(f"k{rows}", (rows, 3), dtype)
        assert buf.data_ptr() % 4096 == 0 and buf.shape == (rows, 3) and buf.dtype == dtype
        buf.fill_(1)  # the whole view is usable memory
        assert int(buf.double().sum()) == rows * 3


def test_within_a_budget_buffers_take_no_headroom() -> None:
    pool = StagingPool(budget_bytes=440)
    pool.take("a", (100,), F32)
    assert pool.nbytes == 400  # exactly what was asked: later buffers need the rest
    unbounded = StagingPool()
    unbounded.take("a", (100,), F32)
    assert unbounded.nbytes == 500  # 125 elements: room for the next, larger delta


def test_a_new_checkpoint_evicts_stale_buffers_oldest_first_only_as_far_as_needed() -> None:
    pool = StagingPool(budget_bytes=1000)
    pool.take("a", (125,), F32)  # 500 bytes
    pool.begin()
    pool.take("b", (125,), F32)  # fits beside the stale "a": nothing evicted
    assert pool.nbytes == 1000
    pool.begin()
    kept_b = pool.take("b", (100,), F32)
    pool.begin()
    pool.take("c", (125,), F32)  # "a" and "b" are stale: evicting "a" makes room
    assert pool.nbytes == 1000
    assert pool.take("b", (125,), F32).data_ptr() == kept_b.data_ptr()  # "b" survived


def test_buffers_in_use_by_this_checkpoint_are_never_evicted() -> None:
    pool = StagingPool(budget_bytes=1000)
    a = pool.take("a", (100,), F32)
    b = pool.take("b", (100,), F32)
    a.fill_(1.0)
    b.fill_(2.0)
    c = pool.take("c", (300,), F32)  # no room: over budget, but exactly the size asked
    assert c.shape == (300,)
    assert pool.nbytes == 800 + 1200
    assert bool((a == 1.0).all()) and bool((b == 2.0).all())  # neither was given up


def test_release_gives_every_buffer_back() -> None:
    pool = StagingPool(budget_bytes=1000)
    pool.take("a", (10,), F32)
    pool.take("b", (10,), F32)
    pool.release()
    assert pool.nbytes == 0
    pool.take("c", (100,), F32)  # the next checkpoint starts from an empty pool
    assert pool.nbytes == 400


# Chunk sizes and the buffers of a full checkpoint


def test_row_bytes_counts_values_states_and_the_id_a_delta_stores() -> None:
    row_state = _shard(cols=4, states="row")
    assert row_state.row_bytes(False) == 4 * 4 + 4
    assert row_state.row_bytes(True) == 4 * 4 + 4 + 4  # int32 id
    element_state = _shard(cols=4, states="element")
    assert element_state.row_bytes(False) == 3 * 4 * 4
    assert _shard(cols=4, states="none").row_bytes() == 4 * 4 + 4


def test_row_bytes_counts_an_int64_id_for_tables_past_int32() -> None:
    huge = _shard(cols=2, states="none", num_embeddings=2**31)
    assert huge.row_bytes(True) == 2 * 4 + 8


def test_chunk_rows_fit_the_budget_and_never_drop_to_zero() -> None:
    shard = _shard(cols=4, states="row")  # 20 bytes a row, 24 with its id
    assert chunk_rows(shard, False, None) is None
    assert chunk_rows(shard, False, 100) == 5
    assert chunk_rows(shard, True, 100) == 4
    assert chunk_rows(shard, False, 1) == 1  # a row larger than the budget still stages


@pytest.mark.parametrize("compiled", [True, False])
def test_a_checkpoint_within_budget_takes_one_buffer_set_per_shard(
    compiled: bool,
) -> None:
    shards = [_shard(rows=10, cols=4), _shard(rows=6, cols=2, states="element")]
    # lazy staging's row claims (two bits a row, in int64 words) or flags (a bool a row)
    flags = [("s0/claims", (2,), I64), ("s1/claims", (2,), I64)] if compiled else [
        ("s0/staged", (10,), torch.bool), ("s1/staged", (6,), torch.bool)]  # fmt: skip
    assert list(_buffers_of(shards, None, compiled)) == [
        ("s0.w", (10, 4), F32),
        ("s0.momentum1", (10,), F32),
        flags[0],
        ("s1.w", (6, 2), F32),
        ("s1.momentum1", (6, 2), F32),
        ("s1.momentum2", (6, 2), F32),
        flags[1],
    ]
    fits = 10 * 20 + 6 * 24
    assert [key for key, _, _ in _buffers_of(shards, fits, compiled)][0] == "s0.w"


def test_a_checkpoint_over_budget_takes_one_chunk_buffer_set_of_chunk_rows() -> None:
    shards = [_shard(rows=10, cols=4), _shard(rows=2, cols=4)]
    # 240 bytes in all, over the 100 of the budget: 5 rows of 20 bytes a chunk
    assert list(_buffers_of(shards, 100, True)) == [
        ("chunk.w", (5, 4), F32),
        ("chunk.momentum1", (5,), F32),
        ("chunk.w", (2, 4), F32),  # a shard smaller than a chunk takes its own rows
        ("chunk.momentum1", (2,), F32),
    ]


def test_prefault_allocates_the_buffers_a_full_save_then_reuses() -> None:
    shards = [_shard(rows=10), _shard(rows=6, seed=1)]
    dense = {"mlp.weight": torch.randn(3, 2)}
    pool = StagingPool()
    pool.prefault(shards, dense)
    allocated = pool.nbytes
    pointers = {k: b.data_ptr() for k, b in pool._buffers.items()}
    assert set(pointers) == {
        *("s0.w", "s0.momentum1", "s0/claims", "s1.w", "s1.momentum1", "s1/claims"),
        "dense/mlp.weight",
        # The copies a save takes of each shard's bitmap (its rows modified since the
        # previous checkpoint are not tracked here).
        *(
            f"s{i}/bits/{name}"
            for i in (0, 1)
            for name in ("selected", "selected/before", "cleared")
        ),
    }
    sink = _RecordingSink()
    staged = _stage(shards, [None, None], pool, sink, dense)
    assert pool.nbytes == allocated  # staging allocated nothing more
    assert [h.staged.weight.data_ptr() for h in sink.handed] == [
        pointers["s0.w"],
        pointers["s1.w"],
    ]
    assert staged.dense["mlp.weight"].data_ptr() == pointers["dense/mlp.weight"]
    assert torch.equal(staged.dense["mlp.weight"], dense["mlp.weight"])


# stage()


def test_whole_staging_hands_over_each_shard_once_without_waiting() -> None:
    kernel = _Kernel(iteration=11.0)
    shards = [_shard(rows=10, kernel=kernel), _shard(rows=6, row_offset=40, kernel=kernel)]
    sink = _RecordingSink()
    staged = _stage(shards, [None, None], StagingPool(), sink)
    assert sink.events == ["add", "add"]  # the writer waits later, training goes on now
    assert kernel.flushes == 1  # one flush per kernel, however many shards it holds
    for i, (got, shard) in enumerate(zip(sink.handed, shards)):
        assert got.key == f"s{i}" and got.row0 == 0 and got.total is None
        assert got.ids is None and got.global_rows == shard.spec.row_offset
        assert torch.equal(got.weight, shard.weight)
        assert torch.equal(got.states["momentum1"], shard.states["momentum1"])
        assert got.scalars == {"iter": 11.0}
    assert staged.step == 3 and staged.kind == "full"
    assert staged.staged_bytes == (10 + 6) * shards[0].row_bytes(False)


def test_staged_values_are_copies_that_training_may_then_modify() -> None:
    shard = _shard()
    before = shard.weight.clone()
    sink = _RecordingSink()
    _stage([shard], [None], StagingPool(), sink)
    shard.weight.add_(1.0)
    shard.states["momentum1"].zero_()
    assert torch.equal(sink.handed[0].staged.weight, before)
    assert not bool((sink.handed[0].staged.states["momentum1"] == 0).all())


def test_delta_staging_stages_the_selected_rows_with_global_ids() -> None:
    shard = _shard(rows=10, row_offset=100)
    rows = torch.tensor([1, 4, 9])
    sink = _RecordingSink()
    staged = _stage([shard], [rows], StagingPool(), sink)
    got = sink.handed[0]
    assert got.ids is not None and got.ids.dtype == torch.int32
    assert got.ids.tolist() == [101, 104, 109]
    assert isinstance(got.global_rows, torch.Tensor)
    assert got.global_rows.tolist() == [101, 104, 109]
    assert torch.equal(got.weight, shard.weight[rows])
    assert torch.equal(got.states["momentum1"], shard.states["momentum1"][rows])
    assert staged.staged_bytes == 3 * shard.row_bytes(True)


def test_staging_copies_the_dense_state_and_serializes_app_state() -> None:
    dense = {"over.weight": torch.randn(2, 3)}
    staged = _stage([_shard()], [None], StagingPool(), _RecordingSink(), dense)
    assert torch.equal(staged.dense["over.weight"], dense["over.weight"])
    assert staged.dense["over.weight"].data_ptr() != dense["over.weight"].data_ptr()
    assert torch.load(io.BytesIO(staged.app_state)) == {"app": {"value": 5}}


def test_a_shard_without_modified_row_bits_stages_no_step_counters() -> None:
    shard = _shard()
    shard.words = None  # a dense kernel: no counters to read
    sink = _RecordingSink()
    _stage([shard], [None], StagingPool(), sink)
    assert sink.handed[0].scalars == {}


def _rows_covered(sink: _RecordingSink, key: str) -> list[int]:
    covered: list[int] = []
    for got in sink.handed:
        if got.key != key:
            continue
        n = got.weight.shape[0]
        assert got.row0 == len(covered)  # chunks are handed over in order, back to back
        if isinstance(got.global_rows, torch.Tensor):
            covered += got.global_rows.tolist()
        else:
            covered += list(range(got.global_rows, got.global_rows + n))
    return covered


def test_chunked_staging_hands_over_each_chunk_before_reusing_buffers() -> None:
    shards = [_shard(rows=10, row_offset=100), _shard(rows=7, row_offset=300, seed=1)]
    pool = StagingPool(budget_bytes=60)  # 3 rows of 20 bytes: 340 bytes need chunks
    sink = _RecordingSink()
    staged = _stage(shards, [None, None], pool, sink)
    # ceil(10 / 3) + ceil(7 / 3) chunks, each waited for before the next is copied
    assert sink.events == ["add", "wait"] * 7
    assert [h.weight.shape[0] for h in sink.handed] == [3, 3, 3, 1, 3, 3, 1]
    assert len({h.staged.weight.data_ptr() for h in sink.handed}) == 1  # one buffer set
    for i, shard in enumerate(shards):
        chunks = [h for h in sink.handed if h.key == f"s{i}"]
        assert all(h.total == shard.spec.rows and h.ids is None for h in chunks)
        assert [h.first_row for h in chunks] == [h.row0 for h in chunks]
        start = shard.spec.row_offset
        assert _rows_covered(sink, f"s{i}") == list(range(start, start + shard.spec.rows))
        assert torch.equal(torch.cat([h.weight for h in chunks]), shard.weight)
        assert torch.equal(
            torch.cat([h.states["momentum1"] for h in chunks]), shard.states["momentum1"]
        )
    assert staged.staged_bytes == 17 * 20  # each chunk counted once


def test_chunked_delta_staging_covers_the_selected_rows_exactly_with_global_ids() -> None:
    shard = _shard(rows=20, row_offset=1000)
    rows = torch.tensor([0, 2, 3, 5, 8, 13, 19])
    pool = StagingPool(budget_bytes=50)  # 2 rows of 24 bytes with their ids
    sink = _RecordingSink()
    _stage([shard], [rows], pool, sink)
    assert sink.events == ["add", "wait"] * 4
    assert all(h.total == 7 for h in sink.handed)
    assert _rows_covered(sink, "s0") == (rows + 1000).tolist()
    assert torch.equal(torch.cat([h.weight for h in sink.handed]), shard.weight[rows])
    assert torch.equal(
        torch.cat([h.states["momentum1"] for h in sink.handed]), shard.states["momentum1"][rows]
    )


def test_chunked_staging_of_a_shard_with_no_selected_rows_hands_over_one_empty_chunk() -> None:
    shards = [_shard(rows=10), _shard(rows=10, row_offset=500, seed=1)]
    sink = _RecordingSink()
    _stage(
        shards,
        [torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.int64)],
        StagingPool(30),
        sink,
    )
    empty = [h for h in sink.handed if h.key == "s1"]
    assert len(empty) == 1 and empty[0].weight.shape == (0, 4) and empty[0].total == 0


def test_a_budget_the_checkpoint_fits_in_stages_it_whole() -> None:
    shards = [_shard(rows=10), _shard(rows=6, seed=1)]
    sink = _RecordingSink()
    _stage(shards, [None, None], StagingPool(budget_bytes=16 * 20), sink)
    assert sink.events == ["add", "add"]
    assert [h.key for h in sink.handed] == ["s0", "s1"]


@pytest.mark.parametrize("states", ["row", "element"])
def test_chunked_staging_holds_no_more_than_the_budget(states: str) -> None:
    shard = _shard(rows=1000, cols=16, states=states)
    budget = 4096
    pool = StagingPool(budget_bytes=budget)
    _stage([shard], [None], pool, _RecordingSink())
    assert pool.nbytes <= budget


def test_a_lookup_waits_for_one_background_chunk_at_most() -> None:
    # threading.Lock is not fair: a background copy that releases the kernel's lock and
    # takes it again at once would keep a waiting lookup out for all its chunks. It yields
    # between chunks (yield_to_lookups), so the lookup runs after the chunk in progress.
    # The copy itself notes each chunk it ends while a lookup waits, so the count does not
    # depend on when this test's thread gets scheduled.
    lookups = KernelLookups()
    chunks, seen, ended_while_waiting = [0], [], []
    lookups.subscribe(lambda rows: seen.append(chunks[0]))
    started = threading.Event()

    def background() -> None:
        for _ in range(60):
            lookups.yield_to_lookups()
            with lookups.lock:
                started.set()
                time.sleep(0.002)  # a chunk's copy, the GIL released
                chunks[0] += 1
                if lookups._waiting:
                    ended_while_waiting.append(chunks[0])

    copier = threading.Thread(target=background)
    copier.start()
    started.wait()
    lookups.before(torch.tensor([1, 2]))
    copier.join()
    assert chunks[0] == 60 and len(seen) == 1
    assert len(ended_while_waiting) <= 1, (ended_while_waiting, seen)


# ------------------------------------------------------------------------------ GPU

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _on_cuda(shard: LocalShard) -> LocalShard:
    """``shard`` as the tracker keeps a CUDA kernel's: rows, states and bits on the device."""
    return dataclasses.replace(
        shard,
        weight=shard.weight.cuda(),
        states={k: v.cuda() for k, v in shard.states.items()},
        words=None if shard.words is None else shard.words.cuda(),
        lookups=KernelLookups(),
    )


@pytest.mark.gpu
@_CUDA
def test_pinned_buffers_start_on_a_page_boundary() -> None:
    t = page_aligned(1 << 20, torch.float32, pin=True)
    assert t.is_pinned() and t.data_ptr() % 4096 == 0
    assert StagingPool(None, pin=True).take("w", (100, 8), F32).is_pinned()


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("states", ["row", "element", "none"])
@pytest.mark.parametrize("rows_on", ["all", "host", "device", "slice"])
def test_a_cuda_shard_stages_into_pinned_buffers_what_its_host_copy_stages(
    states: str, rows_on: str
) -> None:
    host = _shard(5000, 24, states=states, seed=3)
    pick = torch.randperm(5000, generator=torch.Generator().manual_seed(1))[:700].sort()[0]
    rows = {"all": None, "host": pick, "device": pick.cuda(), "slice": slice(1000, 3000)}
    want = stage_shard(
        host, "s0", pick if rows_on == "device" else rows[rows_on], StagingPool(None)
    )
    got = stage_shard(_on_cuda(host), "s0", rows[rows_on], StagingPool(None, pin=True))
    assert got.weight.is_pinned() and torch.equal(got.weight, want.weight)
    assert got.states.keys() == want.states.keys()
    for name, value in want.states.items():
        assert torch.equal(got.states[name], value)
    assert (got.ids is None) == (want.ids is None)
    if want.ids is not None and got.ids is not None:
        assert torch.equal(got.ids, want.ids)


class _Collect:
    def __init__(self) -> None:
        self.got: list[StagedShard] = []

    def add(self, shard: StagedShard, row0: int = 0, total: int | None = None) -> None:
        self.got.append(shard)

    def start(self) -> None:
        pass


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("kind", ["full", "delta"])
def test_lazy_staging_of_a_cuda_shard_stages_the_rows_as_they_were_at_save(kind: Kind) -> None:
    # Copy-on-write on CUDA: the lookup hook copies the rows a batch is about to update
    # (its indices on the device) before training rewrites them; the background copy the
    # rest. The staged rows are the values at save() either way.
    shard = _on_cuda(_shard(6000, 16, states="row", seed=5))
    n = shard.spec.rows
    picked = torch.arange(0, n, 3)
    if kind == "delta":
        assert shard.words is not None
        shard.words.zero_()
        bitmap.set_bits(shard.words, picked.cuda())
    at_save = shard.weight.cpu()
    states_at_save = {k: v.cpu() for k, v in shard.states.items()}
    decision = Decision(kind, True)
    plan = plan_save(0, [shard], decision, [True], None)
    lazy = LazyStaging.begin(plan.staged("lazy"), decision, StagingPool(None, pin=True))
    touched = torch.arange(0, n, 7).cuda()
    assert shard.lookups is not None
    shard.lookups.before(touched)  # the batch's lookup: the hook copies first
    with torch.no_grad():
        shard.weight[touched] += 1.0
        for v in shard.states.values():
            v[touched] += 1.0
    sink = _Collect()
    lazy.run(sink)  # type: ignore[arg-type]
    torch.cuda.synchronize()
    (staged,) = sink.got
    rows = torch.arange(n) if kind == "full" else picked
    assert lazy.hook_rows > 0
    assert torch.equal(staged.weight, at_save[rows])
    for k, v in states_at_save.items():
        assert torch.equal(staged.states[k], v[rows])
    if kind == "delta":
        assert staged.ids is not None
        assert torch.equal(staged.ids.long(), rows + shard.spec.row_offset)


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("kind", ["full", "delta"])
def test_lazy_staging_on_cuda_never_reads_a_row_after_training_wrote_it(kind: Kind) -> None:
    # The background copy runs on its side stream while batches keep looking up and
    # updating hot rows on the training stream, with a large kernel queued before each
    # update so that the streams overlap: a chunk that read a staged flag before the hook's
    # write landed, or a batch that updated a row before the side stream's copy of it ran,
    # would stage an updated row.
    busy = torch.randn(2048, 2048, device="cuda")
    for seed in range(8):
        shard = _on_cuda(_shard(400_000, 64, states="row", seed=seed))
        n = shard.spec.rows
        if kind == "delta":
            assert shard.words is not None
            shard.words.zero_()
            bitmap.set_bits(shard.words, torch.arange(0, n, 2).cuda())
        at_save = shard.weight.cpu()
        states_at_save = {k: v.cpu() for k, v in shard.states.items()}
        decision = Decision(kind, True)
        plan = plan_save(0, [shard], decision, [True], None)
        lazy = LazyStaging.begin(plan.staged("lazy"), decision, StagingPool(None, pin=True))
        sink = _Collect()
        g = torch.Generator(device="cuda").manual_seed(seed)
        assert shard.lookups is not None
        # One batch's hook copies first, so that the chunks read flags it wrote (a fast GPU
        # can copy every chunk before the loop's first batch).
        shard.lookups.before(torch.randint(0, n, (8192,), device="cuda", generator=g))
        copier = threading.Thread(target=lazy.run, args=(sink,))
        copier.start()
        batches = 0
        while copier.is_alive() or batches < 4:
            rows = torch.randint(0, n, (8192,), device="cuda", generator=g)
            shard.lookups.before(rows)
            busy = busy @ busy.T  # delays the update on the training stream
            busy = busy / busy.norm()
            with torch.no_grad():
                shard.weight[rows] += 1.0
                for v in shard.states.values():
                    v[rows] += 1.0
            batches += 1
        copier.join()
        torch.cuda.synchronize()
        (staged,) = sink.got
        stored = torch.arange(n) if kind == "full" else torch.arange(0, n, 2)
        assert lazy.hook_rows > 0 and lazy.background_s > 0
        assert torch.equal(staged.weight, at_save[stored]), seed
        for k, v in states_at_save.items():
            assert torch.equal(staged.states[k], v[stored]), (seed, k)


# plan_save


def _marked(shard: LocalShard, rows: list[int]) -> LocalShard:
    assert shard.words is not None
    shard.words.zero_()
    bitmap.set_bits(shard.words, torch.tensor(rows, dtype=torch.int64))
    return shard


def test_a_plan_stages_lazily_where_allowed_and_chooses_the_eager_shards_rows() -> None:
    shards = [_marked(_shard(rows=10), [1, 4]), _marked(_shard(rows=10, seed=1), [2, 3, 9])]
    plan = plan_save(5, shards, Decision("delta", True), [True, False], budget_bytes=None)
    lazy, eager = plan.shards
    assert (lazy.strategy, lazy.key, lazy.rows, lazy.count) == ("lazy", "s0", None, None)
    assert eager.strategy == "eager" and eager.key == "s1" and eager.count == 3
    assert eager.rows is not None and eager.rows.tolist() == [2, 3, 9]
    assert plan.nbytes is None, "no budget: nothing counted"


def test_a_plan_over_the_budget_chunks_every_shard_with_its_rows_chosen() -> None:
    shards = [_marked(_shard(rows=10), [1, 4, 5]), _marked(_shard(rows=10, seed=1), [2])]
    row_bytes = shards[0].row_bytes(True)  # 4 fp32 columns, a momentum and an id
    fits = plan_save(5, shards, Decision("delta", True), [True, True], 4 * row_bytes)
    assert [p.strategy for p in fits.staged("lazy")] == ["lazy", "lazy"]
    assert fits.nbytes == 4 * row_bytes and [p.count for p in fits.shards] == [3, 1]
    over = plan_save(5, shards, Decision("delta", True), [True, False], 4 * row_bytes - 1)
    assert [p.strategy for p in over.shards] == ["chunked", "chunked"]
    assert [p.rows.tolist() for p in over.shards if p.rows is not None] == [[1, 4, 5], [2]]


def test_a_delta_of_every_row_is_planned_as_a_baseline_shard_without_ids() -> None:
    everything = list(range(10))
    shards = [_marked(_shard(rows=10), everything), _marked(_shard(rows=10, seed=1), everything)]
    plan = plan_save(5, shards, Decision("delta", True), [True, False], budget_bytes=10**6)
    assert [(p.rows, p.count) for p in plan.shards] == [(None, None), (None, None)]
    assert plan.nbytes == 2 * 10 * shards[0].row_bytes(False)
