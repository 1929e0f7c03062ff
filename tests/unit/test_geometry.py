"""Shard geometry: saved rows land by global id, columns by overlap, per-row states from
the saved shard that holds the destination's first column."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_cnr.encoding import FP32, ShardContent, ShardRecord, build_record, decode_weight
from torchrec_cnr.quantization import quantize
from torchrec_cnr.read import geometry
from torchrec_cnr.read.geometry import (
    Placement,
    overlap,
    overlaps,
    place,
    scatter,
    scatter_weight,
    states_fit,
    whole_table,
)
from torchrec_cnr.schema import Format
from torchrec_cnr.tracking.shard import ShardSpec

TABLE = "m.t"


def _spec(row0: int, rows: int, col0: int, cols: int, table: str = TABLE) -> ShardSpec:
    return ShardSpec(table, 0, "grid", row0, col0, rows, cols, 100, 16)


def _ids(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def _place(
    src: ShardSpec, ids: torch.Tensor, dst: ShardSpec, wanted: torch.Tensor | None = None
) -> Placement:
    where = place(src, ids, dst, wanted)
    assert where is not None
    return where


def test_overlap_is_the_common_half_open_range() -> None:
    assert overlap(0, 5, 3, 5) == (3, 5)
    assert overlap(3, 5, 0, 5) == (3, 5)
    assert overlap(2, 2, 0, 10) == (2, 4)  # contained


def test_ranges_that_only_touch_or_are_empty_do_not_overlap() -> None:
    assert overlap(0, 3, 3, 2) is None
    assert overlap(5, 1, 0, 5) is None
    assert overlap(2, 0, 0, 10) is None


def test_shards_overlap_only_in_rows_and_columns_of_the_same_table() -> None:
    a = _spec(0, 10, 0, 8)
    assert overlaps(a, _spec(9, 5, 7, 4))
    assert not overlaps(a, _spec(10, 5, 0, 8))  # rows apart
    assert not overlaps(a, _spec(0, 10, 8, 8))  # columns apart
    assert not overlaps(a, _spec(0, 10, 0, 8, table="m.other"))


def test_saved_rows_land_by_global_id_and_columns_by_overlap() -> None:
    src = _spec(0, 10, 0, 8)
    dst = _spec(5, 5, 4, 8)
    where = _place(src, _ids(7, 1, 9, 5), dst)
    assert where.keep is not None and where.keep.tolist() == [0, 2, 3]  # id 1 is outside
    assert where.rows.tolist() == [2, 4, 0]  # ids 7, 9, 5 in the destination, stored order
    assert where.count == 3
    assert where.src_cols == slice(4, 8) and where.dst_cols == slice(0, 4)
    assert where.owns_row_state  # the saved columns 0..7 hold the destination's first, 4


def test_per_row_state_belongs_to_the_saved_shard_holding_the_destinations_first_column() -> None:
    dst = _spec(0, 10, 4, 8)  # columns 4..11
    left = _place(_spec(0, 10, 0, 8), _ids(0), dst)  # columns 0..7 hold column 4
    right = _place(_spec(0, 10, 8, 8), _ids(0), dst)  # columns 8..15 do not
    assert left.owns_row_state and not right.owns_row_state
    assert _place(_spec(0, 10, 4, 2), _ids(0), dst).owns_row_state
    assert not _place(_spec(0, 10, 5, 2), _ids(0), dst).owns_row_state


def test_every_saved_row_inside_the_destination_keeps_them_all() -> None:
    where = _place(_spec(0, 10, 0, 8), _ids(3, 4, 8), _spec(0, 10, 0, 8))
    assert where.keep is None
    assert where.rows.tolist() == [3, 4, 8]
    assert where.owns_row_state


def test_wanted_rows_map_to_their_position_in_the_wanted_list() -> None:
    src = _spec(0, 10, 0, 8)
    dst = whole_table(TABLE, 100, 16)
    where = _place(src, _ids(2, 5, 6, 9), dst, wanted=_ids(1, 5, 9, 40))
    assert where.keep is not None and where.keep.tolist() == [1, 3]
    assert where.rows.tolist() == [1, 2]
    assert where.src_cols == slice(0, 8) and where.dst_cols == slice(0, 8)


def test_no_common_row_or_column_places_nothing() -> None:
    src = _spec(0, 10, 0, 8)
    assert place(src, _ids(1, 2), _spec(10, 5, 0, 8)) is None  # rows apart
    assert place(src, _ids(1, 2), _spec(0, 10, 8, 8)) is None  # columns apart
    assert place(src, _ids(1, 2), _spec(5, 5, 0, 8)) is None  # no saved row inside
    assert place(src, _ids(), _spec(0, 10, 0, 8)) is None  # nothing saved
    whole = whole_table(TABLE, 100, 16)
    assert place(src, _ids(1, 2), whole, wanted=_ids(3, 4)) is None  # none wanted
    assert place(src, _ids(1, 2), whole, wanted=_ids()) is None


def test_scatter_writes_the_overlapping_columns_of_the_landing_rows() -> None:
    src = _spec(0, 4, 0, 4)
    dst = _spec(2, 4, 2, 4)  # rows 2..5, columns 2..5
    saved = torch.arange(16, dtype=torch.float32).view(4, 4)  # rows 0..3 in id order
    out = torch.full((4, 4), -1.0)
    assert scatter(out, _place(src, _ids(0, 1, 2, 3), dst), saved)
    want = torch.full((4, 4), -1.0)
    want[0:2, 0:2] = saved[2:4, 2:4]  # global rows 2, 3 and columns 2, 3
    assert torch.equal(out, want)


def test_scatter_takes_saved_tensors_of_every_row_or_of_the_kept_rows_only() -> None:
    src = _spec(0, 4, 0, 2)
    dst = _spec(2, 2, 0, 2)
    ids = _ids(3, 0, 2)
    where = _place(src, ids, dst)
    saved = torch.tensor([[3.0, 3.5], [0.0, 0.5], [2.0, 2.5]])
    every, kept = torch.zeros(2, 2), torch.zeros(2, 2)
    scatter(every, where, saved)
    assert where.keep is not None
    scatter(kept, where, saved[where.keep])
    assert torch.equal(every, torch.tensor([[2.0, 2.5], [3.0, 3.5]]))
    assert torch.equal(kept, every)


def test_scatter_converts_to_the_destination_dtype() -> None:
    spec = _spec(0, 2, 0, 2)
    out = torch.zeros(2, 2, dtype=torch.float32)
    scatter(out, _place(spec, _ids(0, 1), spec), torch.tensor([[1, 2], [3, 4]]).half())
    assert out.dtype == torch.float32
    assert out.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_per_row_state_is_written_only_by_the_shard_that_owns_it() -> None:
    dst = _spec(0, 3, 4, 8)
    owner = _place(_spec(0, 3, 0, 8), _ids(0, 1, 2), dst)
    other = _place(_spec(0, 3, 8, 8), _ids(0, 1, 2), dst)
    momentum = torch.zeros(3)
    assert not scatter(momentum, other, torch.tensor([9.0, 9.0, 9.0]))
    assert torch.equal(momentum, torch.zeros(3))
    assert scatter(momentum, owner, torch.tensor([1.0, 2.0, 3.0]))
    assert momentum.tolist() == [1.0, 2.0, 3.0]


def _record(optimizer: str, states: dict[str, torch.Tensor]) -> ShardRecord:
    spec = _spec(0, 2, 0, 2)
    record, tensors = build_record(
        spec, "s0", ShardContent({"": torch.zeros(2, 2)}, FP32, optimizer, states, {})
    )
    assert set(tensors) == {"s0.w", *(f"s0.{n}" for n in states)}
    return record


def test_optimizer_state_fits_only_the_same_optimizer_with_the_same_states() -> None:
    adagrad = _record("EXACT_ROWWISE_ADAGRAD", {"momentum1": torch.zeros(2)})
    assert states_fit(adagrad, "EXACT_ROWWISE_ADAGRAD", ["momentum1"])
    assert not states_fit(adagrad, "EXACT_ADAGRAD", ["momentum1"])
    assert not states_fit(adagrad, "EXACT_ROWWISE_ADAGRAD", ["momentum1", "prev_iter"])
    adam = _record("ADAM", {"momentum1": torch.zeros(2, 2), "momentum2": torch.zeros(2, 2)})
    assert states_fit(adam, "ADAM", ["momentum2", "momentum1"])  # order does not matter
    assert not states_fit(adam, "ADAM", ["momentum1"])


# Property: any split scattered into any other split reproduces the table.


def _cuts(draw: st.DrawFn, size: int) -> list[tuple[int, int]]:
    """``[start, length)`` blocks that split ``range(size)``."""
    inner = draw(st.sets(st.integers(1, size - 1), max_size=3)) if size > 1 else set()
    bounds = [0, *sorted(inner), size]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


@st.composite
def _splits(draw: st.DrawFn) -> tuple[int, int, list[ShardSpec], list[ShardSpec], int]:
    n, d = draw(st.integers(1, 24)), draw(st.integers(1, 8))

    def grid() -> list[ShardSpec]:
        rows, cols = _cuts(draw, n), _cuts(draw, d)
        return [
            ShardSpec(TABLE, i, "grid", r0, c0, rn, cn, n, d)
            for i, ((r0, rn), (c0, cn)) in enumerate((r, c) for r in rows for c in cols)
        ]

    return n, d, grid(), grid(), draw(st.integers(0, 2**16))


def _col_block(specs: list[ShardSpec], col: int) -> int:
    """The first column of the saved column block that holds ``col``."""
    return next(s.col_offset for s in specs if s.col_offset <= col < s.col_offset + s.cols)


@settings(max_examples=80, deadline=None)
@given(_splits())
def test_any_saved_split_scattered_into_any_other_split_reproduces_the_table(
    case: tuple[int, int, list[ShardSpec], list[ShardSpec], int],
) -> None:
    n, d, saved_specs, dst_specs, seed = case
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(n, d, generator=g)
    moment = torch.randn(n, d, generator=g)  # a per-element state
    per_row = torch.randn(n, generator=g)
    saved = []
    for spec in saved_specs:
        # Stored in any order: rows land by id, not by position.
        order = torch.randperm(spec.rows, generator=g)
        ids = spec.row_offset + order
        cols = slice(spec.col_offset, spec.col_offset + spec.cols)
        # Each column block keeps its own per-row state; tell them apart by column.
        saved.append(
            (spec, ids, table[ids, cols], moment[ids, cols], per_row[ids] + 1000 * spec.col_offset)
        )
    for dst in dst_specs:
        rows = slice(dst.row_offset, dst.row_offset + dst.rows)
        cols = slice(dst.col_offset, dst.col_offset + dst.cols)
        weight = torch.full((dst.rows, dst.cols), float("nan"))
        moment_out = torch.full((dst.rows, dst.cols), float("nan"))
        row_out = torch.full((dst.rows,), float("nan"))
        for spec, ids, w, m, r in saved:
            where = place(spec, ids, dst)
            assert (where is not None) == overlaps(spec, dst)
            if where is not None:
                scatter(weight, where, w)
                scatter(moment_out, where, m)
                scatter(row_out, where, r)
        assert torch.equal(weight, table[rows, cols])
        assert torch.equal(moment_out, moment[rows, cols])
        owner = _col_block(saved_specs, dst.col_offset)
        assert torch.equal(row_out, per_row[rows] + 1000 * owner)


@settings(max_examples=60, deadline=None)
@given(_splits(), st.data())
def test_reading_wanted_rows_of_a_split_table_gives_exactly_those_rows(
    case: tuple[int, int, list[ShardSpec], list[ShardSpec], int], data: st.DataObject
) -> None:
    n, d, saved_specs, _, seed = case
    wanted = _ids(*sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1))))
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(n, d, generator=g)
    dst = whole_table(TABLE, n, d)
    out = torch.full((wanted.numel(), d), float("nan"))
    for spec in saved_specs:
        ids = torch.arange(spec.row_offset, spec.row_offset + spec.rows)
        where = place(spec, ids, dst, wanted)
        if where is not None:
            scatter(out, where, table[ids, spec.col_offset : spec.col_offset + spec.cols])
    assert torch.equal(out, table[wanted])


@pytest.mark.parametrize(
    "fmt", [Format("adaptive", 4), Format("adaptive", 3), Format("fp16", 16), FP32]
)
@pytest.mark.parametrize("saved_ids", ["all", "some"])
def test_weights_decoded_piece_by_piece_land_as_a_whole_decode_lands(
    fmt: Format, saved_ids: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A restore decodes quantized rows a few at a time straight into place, on threads;
    # the result must be the whole decode scattered at once, for rows that land in runs
    # (a whole shard) and scattered (a delta), across a column split.
    g = torch.Generator().manual_seed(1)
    src = ShardSpec(TABLE, 0, "grid", 0, 0, 100, 16, 100, 16)
    ids = (
        torch.arange(100) if saved_ids == "all" else torch.randperm(100, generator=g)[:37].sort()[0]
    )
    rows = torch.randn(ids.numel(), 16, generator=g)
    values = {"": rows} if fmt == FP32 else quantize(rows, fmt.method, fmt.bits).to_tensors()
    content = ShardContent(values, fmt, "sgd", {}, {}, ids=None if saved_ids == "all" else ids)
    rec, tensors = build_record(src, "k", content)
    dst = _spec(20, 70, 4, 12)  # rows 20..89, columns 4..15
    where = _place(src, ids, dst)
    want = torch.full((70, 12), -1.0)
    scatter(want, where, decode_weight(tensors.__getitem__, rec))
    monkeypatch.setattr(geometry, "DECODE_BYTES", 5 * 16 * 4)  # pieces of 5 rows
    for executor in (None, ThreadPoolExecutor(3)):
        got = torch.full((70, 12), -1.0)
        scatter_weight(got, where, rec, tensors.__getitem__, executor)
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", [Format("adaptive", 4), FP32])
def test_saved_rows_land_in_a_cuda_shard_as_in_a_host_one(fmt: Format) -> None:
    # A restore into CUDA shards: read (and decoded) on the host, written on the device.
    g = torch.Generator().manual_seed(2)
    src = ShardSpec(TABLE, 0, "grid", 0, 0, 100, 16, 100, 16)
    ids = torch.randperm(100, generator=g)[:41].sort()[0]
    rows = torch.randn(41, 16, generator=g)
    values = {"": rows} if fmt == FP32 else quantize(rows, fmt.method, fmt.bits).to_tensors()
    states = {"momentum1": torch.rand(41, generator=g)}
    rec, tensors = build_record(src, "k", ShardContent(values, fmt, "sgd", states, {}, ids=ids))
    where = _place(src, ids, _spec(20, 70, 4, 12))
    host, device = torch.zeros(70, 12), torch.zeros(70, 12, device="cuda")
    state_host, state_device = torch.zeros(70), torch.zeros(70, device="cuda")
    for dst, state, pool in (
        (host, state_host, None),
        (device, state_device, ThreadPoolExecutor(2)),
    ):
        scatter_weight(dst, where, rec, tensors.__getitem__, pool)
        scatter(state, where, tensors[rec.states["momentum1"].tensor])
    assert torch.equal(device.cpu(), host) and torch.equal(state_device.cpu(), state_host)
