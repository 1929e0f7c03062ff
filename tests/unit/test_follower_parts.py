"""Each part of the follower alone, on a stored root (``tests/data/format_v6``: tables
a: 600 x 8 and c: 401 x 8, a checkpoint every second step up to 24, with what
``export_state_dict`` gave at each step):

- ``locate``: a table's rows read cold (all of them, and a third at a time), and warm
  from a served step, are the target's, each row read once; the reads queued for several
  tables are each waited for, even after one fails;
- ``fetch``: an update over the memory budget is read in pieces, each shown to the gate,
  and a refused piece stops the read;
- ``apply``: copy and swap mode serve exactly the step applied, swap mode through the
  replay of the previous update onto the spare copy; the lock lets a writer in only
  once readers are out, and holds new readers off while a writer waits;
- ``poller``: failing polls are counted and back off up to the cap, a success resets it;
- ``counters``: idle polls and refusals.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from cnr_train.serve import serving_model
from cnr_train.workload import TableSpec
from torchrec_cnr import CnrError
from torchrec_cnr.iocontext import IOContext
from torchrec_cnr.manifest import Entry, Manifest
from torchrec_cnr.read import ChainReader
from torchrec_cnr.serving import FloatTarget, PendingUpdate, RefusedUpdate
from torchrec_cnr.serving.apply import Applier, SharedLock
from torchrec_cnr.serving.counters import Counters
from torchrec_cnr.serving.fetch import UpdateReader, _need
from torchrec_cnr.serving.locate import read_table
from torchrec_cnr.serving.plan import plan_update
from torchrec_cnr.serving.poller import Poller
from torchrec_cnr.snapshot.reader import settle
from torchrec_cnr.storage import Storage, open_storage

pytestmark = pytest.mark.timeout(120)

DATA = Path(__file__).parents[1] / "data" / "format_v6"
TABLES = [TableSpec("a", 600, 8, "table_wise"), TableSpec("c", 401, 8, "row_wise")]
Expected = dict[int, dict[str, torch.Tensor]]


@pytest.fixture
def stored(tmp_path: Path) -> tuple[Storage, Expected]:
    """The consecutive root (each checkpoint a delta since the one before), and what each
    of its steps holds."""
    root = shutil.copytree(DATA / "consecutive", tmp_path / "ckpt")
    expected: Expected = torch.load(DATA / "consecutive.pt", weights_only=True)
    return open_storage(str(root)), expected


@pytest.fixture
def io() -> Iterator[IOContext]:
    context = IOContext(None)
    yield context
    context.close()


def _entry(manifest: Manifest, step: int) -> Entry:
    (entry,) = [e for e in manifest.checkpoints if e.step == step]
    return manifest.record(entry)


def _values(rows: object) -> torch.Tensor:
    values = getattr(rows, "values")  # noqa: B009 (StoredRows: fp32, or quantized parts)
    return values if values is not None else rows.dequantize()  # type: ignore[attr-defined]


def test_locate_reads_each_rows_latest_version_once_cold_and_warm(
    stored: tuple[Storage, Expected], io: IOContext
) -> None:
    storage, expected = stored
    manifest = Manifest.load(storage)
    latest = _entry(manifest, 24)
    chain = ChainReader(storage, manifest, latest, io, verify=False, lazy=True)
    for table, shape in latest.tables.items():  # cold: every row, from the whole chain
        pieces = settle(read_table(chain, table, None, []))
        ids = torch.cat([ids for ids, _ in pieces])
        assert torch.equal(torch.sort(ids).values, torch.arange(shape.num_embeddings)), table
        got = torch.zeros(shape.num_embeddings, shape.embedding_dim)
        for part, rows in pieces:
            got[part] = _values(rows)
        assert torch.equal(got, expected[24][shape.state_dict_key]), table
        # A third of the rows at a time (found by search, not by a mask of the table's
        # rows as most of a table is): the same rows, each once.
        for third in torch.arange(shape.num_embeddings).tensor_split(3):
            pieces = settle(read_table(chain, table, third, []))
            ids = torch.cat([ids for ids, _ in pieces])
            assert torch.equal(torch.sort(ids).values, third), table
            for part, rows in pieces:
                assert torch.equal(_values(rows), got[part]), table

    served = _entry(manifest, 16)
    plan = plan_update(manifest, chain, served, served.id)
    assert plan is not None and not plan.cold and [e.step for e in plan.newer] == [24, 22, 20, 18]
    for table, wanted in plan.rows.items():  # warm: only the rows changed since step 16
        key = latest.tables[table].state_dict_key
        pieces = settle(read_table(chain, table, wanted, plan.newer))
        ids = torch.cat([ids for ids, _ in pieces])
        assert torch.equal(torch.sort(ids).values, wanted), table  # each once
        state = expected[16][key].clone()
        for part, rows in pieces:
            state[part] = _values(rows)
        assert torch.equal(state, expected[24][key]), table


def test_settle_waits_for_every_read_and_raises_the_first_failure() -> None:
    # A follower queues every table's reads before it waits for any: where one fails,
    # the others must still be waited for, so that none writes into its buffers later.
    calls: list[int] = []

    def read(i: int, fail: bool) -> Callable[[], int]:
        def finish() -> int:
            calls.append(i)
            if fail:
                raise OSError(f"read {i} failed")
            return i * 10

        return finish

    assert settle([read(0, False), read(1, False)]) == [0, 10]
    calls.clear()
    with pytest.raises(OSError, match="read 1 failed"):
        settle([read(0, False), read(1, True), read(2, True), read(3, False)])
    assert calls == [0, 1, 2, 3]


def test_fetch_reads_an_update_over_the_budget_in_pieces_each_shown_to_the_gate(
    stored: tuple[Storage, Expected], io: IOContext, tmp_path: Path
) -> None:
    storage, expected = stored
    manifest = Manifest.load(storage)
    latest = _entry(manifest, 24)
    target = FloatTarget(serving_model(TABLES, 4, "fp32"))

    whole = UpdateReader(storage, io, target).read(manifest, latest, None)
    assert whole is not None and whole.plan.cold and whole.spill is None
    assert whole.count == 600 + 401 and set(whole.dense) < set(expected[24])

    seen: list[PendingUpdate] = []

    def gate(update: PendingUpdate) -> str | None:
        seen.append(update)
        return "third piece" if refuse and len(seen) == 3 else None

    budget = 100 * (2 * 4 * 8 + 8)  # 100 rows of dim 8 in each piece
    # While the process holds the whole update (another read, as far as the ledger of
    # reads knows), a read within the budget gets a quarter of it: pieces of 25 rows.
    refuse = False
    shared = UpdateReader(storage, io, target, gate, budget, str(tmp_path))
    update = shared.read(manifest, latest, None)
    assert update is not None and update.spill is not None and update.count == whole.count
    assert len(seen) == 24 + 17 and update.spill.held_bytes <= budget // 4
    count = whole.count
    del whole, update  # what they held is given back
    for refuse in (False, True):
        seen.clear()
        reader = UpdateReader(storage, io, target, gate, budget, str(tmp_path))
        update = reader.read(manifest, latest, None)
        assert update is not None and update.spill is not None and update.rows == []
        assert all(sum(int(ids.numel()) for _, ids, _ in u.rows) <= 100 for u in seen)
        if refuse:
            assert update.refused == "third piece" and len(seen) == 3
            spilled = sum(int(ids.numel()) for _, ids, _ in update.spill.pieces)
            assert spilled == 200  # two pieces of table a; the refused one not spilled
        else:
            assert update.refused is None and update.count == count
            assert update.spill.held_bytes <= budget
            assert len(seen) == 6 + 5  # 600 rows, then 401, 100 at a time
        del update  # not held while the next is read


def test_fetch_counts_only_the_rows_a_warm_update_reads_against_the_budget(
    stored: tuple[Storage, Expected], io: IOContext
) -> None:
    storage, _ = stored
    manifest = Manifest.load(storage)
    latest = _entry(manifest, 24)
    chain = ChainReader(storage, manifest, latest, io, verify=False, lazy=True)
    served = _entry(manifest, 22)
    plan = plan_update(manifest, chain, served, served.id)
    assert plan is not None and not plan.cold
    unchanged = next(t for t in plan.rows if t.endswith(".c"))
    del plan.rows[unchanged]  # a warm plan that does not name a table reads none of it
    budget = 100 * (2 * 4 * 8 + 8)  # 100 rows of dim 8: table a's 60 fit, c's 401 do not
    assert _need(plan, latest) <= budget
    plan.cold = True  # every row of both tables: over the budget
    assert _need(plan, latest) > budget


def test_apply_serves_exactly_the_step_applied_in_copy_and_swap_mode(
    stored: tuple[Storage, Expected], io: IOContext
) -> None:
    storage, expected = stored
    manifest = Manifest.load(storage)
    for swap in (False, True):
        model = serving_model(TABLES, 4, "fp32")
        target = FloatTarget(model)
        applier = Applier(target, swap=swap)
        assert applier.served is None and applier.spare_bytes == 0 and applier.swap == swap
        reader = UpdateReader(storage, io, target)
        # Cold, then two warm updates: in swap mode the third is written into the copy
        # the first served, which the second's rows are replayed onto first.
        for step in (12, 18, 24):
            update = reader.read(manifest, _entry(manifest, step), applier.served)
            assert update is not None and update.plan.cold == (step == 12)
            blocked, held = applier.apply(update)
            assert applier.served is not None and applier.served.step == step
            assert target.swapping == (swap and step != 12), "the spare comes after the first"
            applier.make_spare()
            assert (applier.spare_bytes == target.table_bytes()) == swap == target.swapping
            assert blocked >= 0 and held > 0
            got = model.state_dict()
            bad = [k for k, v in expected[step].items() if not torch.equal(v, got[k])]
            assert not bad, (swap, step, bad)


def test_the_shared_lock_admits_a_writer_once_readers_are_out_and_holds_new_readers_off() -> None:
    lock = SharedLock()
    events: list[str] = []

    def write() -> None:
        with lock.exclusive():
            events.append("write")

    def late_read() -> None:
        with lock.shared():
            events.append("late read")

    with lock.shared():
        writer = threading.Thread(target=write)
        writer.start()
        deadline = time.monotonic() + 5
        while lock._waiting != 1 and time.monotonic() < deadline:  # waiting on the readers
            time.sleep(0.001)
        assert lock._waiting == 1, "the writer never waited"
        reader = threading.Thread(target=late_read)
        reader.start()
        time.sleep(0.05)
        assert events == [], "neither the writer nor a later reader got in past a reader"
        events.append("read done")
    writer.join(5)
    reader.join(5)
    assert events == ["read done", "write", "late read"]


def test_the_poller_backs_off_while_polls_fail_and_resets_on_success() -> None:
    calls: list[float] = []

    def poll() -> None:
        calls.append(time.monotonic())
        if len(calls) <= 3:
            raise OSError(f"store down ({len(calls)})")

    poller = Poller(poll, "root", max_backoff_s=0.08)
    poller.interval_s = 0.01
    assert [poller.wait_after(n) for n in (0, 1, 2, 3, 20)] == [0.01, 0.02, 0.04, 0.08, 0.08]
    poller.start(0.01)
    with pytest.raises(CnrError, match="already polling"):
        poller.start(0.01)
    deadline = time.monotonic() + 10
    while len(calls) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    poller.stop()
    assert not poller.running and len(calls) >= 6
    assert poller.failures == 3 and poller.last_error is None  # the fourth poll succeeded
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert gaps[0] >= 0.02 and gaps[1] >= 0.04 and gaps[2] >= 0.08, gaps  # backed off

    def fail() -> None:
        raise OSError("store down")

    failing = Poller(fail, "root")
    failing.start(0.01)
    while failing.failures == 0:
        time.sleep(0.01)
    failing.stop()
    assert isinstance(failing.last_error, OSError)


def test_counters_count_idle_polls_and_remember_the_last_refusal() -> None:
    counters = Counters()
    counters.polls += 2
    counters.count_idle(1)
    counters.count_idle(1)
    assert (counters.polls, counters.idle_polls, counters.idle_requests) == (2, 2, 2)
    assert not counters.refused_last("ckpt-6")
    counters.refused.append(RefusedUpdate(6, "ckpt-6", "bad"))
    assert counters.refused_last("ckpt-6") and not counters.refused_last("ckpt-8")
