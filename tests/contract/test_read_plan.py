"""Reads as a plan (``read/plan.py``): a plan of frozen items carried out under one
memory budget. What fits is held by a new reader (the old one is unchanged), groups are
held whole or not at all, what does not fit is verified (a damaged one fails before
anything is held), and held tensors are exactly the stored ones. A follower's scattered
rows are streamed (``stream``), as stored, and never held."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from cnr_train.workload import TableSpec
from tests.faults import SlowReads
from tests.jobs import make_job
from tests.multiprocess import run_ranks
from torchrec_cnr.errors import CheckpointReadError, ChecksumError
from torchrec_cnr.read import ChainReader, MemoryBudget, ReadItem, ReadPlan, carry_out
from torchrec_cnr.read import items as items_module
from torchrec_cnr.read.items import held_by_reads
from torchrec_cnr.read.plan import stream
from torchrec_cnr.snapshot import rows_path
from torchrec_cnr.storage import open_storage

pytestmark = pytest.mark.dist

TABLES = [TableSpec("a", 400, 8, "table_wise"), TableSpec("b", 300, 8, "row_wise")]


def _save(root: str) -> None:
    job = make_job(TABLES, root, seed=1, data_seed=2, policy="consecutive", interval_steps=2)
    job.run(1, 4)
    job.ckpt.close()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("plan") / "ckpt")
    run_ranks(2, _save, root)
    return root


def _items(chain: ChainReader) -> list[ReadItem]:
    """Every stored row tensor of every link, whole."""
    return [
        ReadItem(n, rec.spec.rank, name)
        for n in range(len(chain.links))
        for rec in chain.link_records(n)
        for name in rec.row_names
    ]


def test_a_plan_within_its_budget_is_held_by_a_new_reader_exactly(saved: str) -> None:
    with ChainReader.open(saved) as chain:
        assert len(chain.links) == 2, "a baseline and a delta"
        items = _items(chain)
        plan = ReadPlan(tuple((item,) for item in items + items[:1]))  # a repeat is read once
        budget = MemoryBudget(None)
        held = carry_out(chain, plan, budget)
        assert not chain.held, "the reader carried out from is unchanged"
        assert set(held.chain.held) == {item.key for item in items}
        assert held.deferred == () and held.spare_bytes is None
        assert budget.used == sum(t.nbytes for t in held.chain.held.values())
        for (n, rank, name), tensor in held.chain.held.items():
            assert torch.equal(tensor, chain.reader(n).rows(rank, name))
        with pytest.raises(TypeError):
            held.chain.held[(0, 0, "x")] = torch.zeros(1)  # type: ignore[index]


def test_over_the_budget_groups_are_deferred_whole_and_spans_hold_their_rows(saved: str) -> None:
    with ChainReader.open(saved) as chain:
        items = _items(chain)
        sizes = {item.key: chain.nbytes(*item.key) for item in items}
        first, rest = items[0], items[1:]
        span = ReadItem(first.link, first.rank, first.tensor, (3, 7))
        budget = MemoryBudget(sizes[first.key] // 2)
        plan = ReadPlan(((span,), tuple(rest)))  # the rest as one group: larger than the budget
        held = carry_out(chain, plan, budget)
        assert set(held.chain.held) == {span.key}
        rows = chain.reader(first.link).rows(first.rank, first.tensor)
        assert torch.equal(held.chain.held[span.key], rows[3:7])
        assert held.deferred == tuple(rest), "a group over the budget is not held in part"
        assert held.spare_bytes == budget.left == sizes[first.key] // 2 - rows[3:7].nbytes


def test_hold_all_holds_over_the_budget_and_counts_it(saved: str) -> None:
    with ChainReader.open(saved) as chain:
        items = _items(chain)
        budget = MemoryBudget(1)
        held = carry_out(chain, ReadPlan(((items[0],),), hold_all=True), budget)
        assert set(held.chain.held) == {items[0].key}
        assert budget.used == chain.nbytes(*items[0].key) and budget.left == 0


def test_reads_at_once_share_one_budget_and_give_back_what_they_held(saved: str) -> None:
    before = held_by_reads()
    with ChainReader.open(saved) as chain:
        items = _items(chain)
        sizes = {item.key: chain.nbytes(*item.key) for item in items}
        bound = 2 * sizes[items[0].key]
        other = MemoryBudget(bound)  # another read of the process: a compaction, say
        assert other.take(sizes[items[0].key] + 1)
        assert held_by_reads() == before + sizes[items[0].key] + 1
        with MemoryBudget(bound) as budget:  # alone, the item would fit this bound
            held = carry_out(chain, ReadPlan(((items[0],),)), budget)
            assert held.deferred == (items[0],) and not held.chain.held
            assert held.spare_bytes == budget.left == bound - sizes[items[0].key] - 1
            assert budget.share() == bound - sizes[items[0].key] - 1  # all the rest
            late = MemoryBudget(bound)
            assert late.share() == bound // 4, "all of it held: a read goes on in a quarter"
            del late
        assert held_by_reads() == before + sizes[items[0].key] + 1, "given back as it ends"
        del other  # a dropped budget gives back what it took
        assert held_by_reads() == before
        with MemoryBudget(bound) as budget:
            assert carry_out(chain, ReadPlan(((items[0],),)), budget).deferred == ()
        unbounded = MemoryBudget(None)
        assert unbounded.take(10**12) and unbounded.share() is None, "never refused"
        assert held_by_reads() == before + 10**12 and MemoryBudget(bound).left == 0
        unbounded.release()
    assert held_by_reads() == before


def test_a_forked_child_starts_a_ledger_of_its_own_even_if_a_thread_held_its_lock() -> None:
    parent = MemoryBudget(1000)
    assert parent.take(1000)
    with items_module._LEDGER:  # a thread of the parent in the ledger as it forks
        pid = os.fork()
        if pid == 0:  # the child: any failure, or a wait on the inherited lock, exits non-zero
            signal.alarm(10)
            ok = False
            try:
                child = MemoryBudget(1000)
                ok = child.take(600) and held_by_reads() == 600 and child.share() == 1000
            finally:
                os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert held_by_reads() >= 1000, "the parent's ledger is as it was"
    parent.release()


def test_a_damaged_deferred_tensor_fails_the_plan(saved: str, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(saved, root)
    with ChainReader.open(str(root)) as chain:
        item = _items(chain)[-1]
        segments = chain.reader(item.link)._segments(rows_path(item.rank, item.tensor))
        assert segments is not None
        _, _, stored = segments[0]
        at = Path(root, chain.links[item.link].id, stored.location)
    assert stored.byte_range is not None
    raw = bytearray(at.read_bytes())
    raw[stored.byte_range[0]] ^= 0xFF
    at.write_bytes(bytes(raw))
    with ChainReader.open(str(root)) as chain:
        with pytest.raises(ChecksumError, match=item.tensor):
            carry_out(chain, ReadPlan(((item,),)), MemoryBudget(0))


def test_scattered_rows_are_streamed_as_stored_and_never_held(saved: str) -> None:
    with ChainReader.open(saved) as chain:
        items = _items(chain)
        rows = [chain.reader(i.link).rows(i.rank, i.tensor) for i in items]
        picked = [torch.tensor([0, 2, 3, r.shape[0] - 1]) for r in rows]
        scattered = [ReadItem(i.link, i.rank, i.tensor, positions=p) for i, p in zip(items, picked)]
        waits = stream(chain, scattered)
        for wait, stored, at in zip(waits, rows, picked):
            assert torch.equal(wait(), stored[at])
        assert not chain.held
        with pytest.raises(AssertionError, match="stream"):
            carry_out(chain, ReadPlan(((scattered[0],),)), MemoryBudget(None))


def test_the_links_are_read_at_once_and_a_failure_raises_once_every_read_has_ended(
    saved: str,
) -> None:
    # A restore reads the baseline into the staging buffers beside the deltas' reads: when
    # a delta's read fails, none may still read into them (the next save stages there).
    with ChainReader.open(saved) as chain:
        gone = chain.links[1].id

    def data(name: str) -> bool:
        return "/data/" in name

    storage = SlowReads(open_storage(saved), lambda name: data(name) and gone in name, 0.2, data)
    with ChainReader.open(storage) as chain:
        plan = ReadPlan(tuple((item,) for item in _items(chain)))
        storage.began.clear()
        storage.ended.clear()
        with pytest.raises(CheckpointReadError, match="its object is gone"):
            carry_out(chain, plan, MemoryBudget(None))
        storage.assert_none_ends_later()
    delta_began = min(t for name, t in storage.began if gone in name)
    baseline_ended = max(t for name, t in storage.ended if gone not in name)
    assert delta_began < baseline_ended, "the delta's reads waited for the baseline's"
