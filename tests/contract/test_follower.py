"""A follower keeps a serving model at the latest committed checkpoint, reading only the
rows that changed, on every policy, module and layout, fp32 and quantized.

- fp32 target: after every update, the served model's state dict equals
  ``export_state_dict(root)`` bit for bit (it is what a full reload would load).
- quantized target (TorchRec's ``quantize_embeddings``): the served rows dequantize to
  what a restore gives for 4-bit checkpoints served as INT4.
- An update reads only rows changed since the served step; a follower that fell behind
  reads each row once; a cold one reads the chain once.
- Robust: compaction and keep_last racing the follower, a rewind, a take-over, a damaged
  file (the last good step stays served), a mismatched model (nothing changes).
- Consistent: a lookup served while updates apply sees the rows of exactly the step
  ``follower.step`` names, across every table, fp32 and INT4/INT2.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.jobs import make_job
from tests.models import unsharded
from tests.multiprocess import run_ranks
from torchrec_cnr import (
    CheckpointConfig,
    CheckpointManager,
    IOOptions,
    ModelMismatchError,
    QuantizeConfig,
    export_state_dict,
)
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.offline import list_checkpoints
from torchrec_cnr.quantization import quantize
from torchrec_cnr.selection import POLICIES
from torchrec_cnr.selection.policy import PolicyName
from torchrec_cnr.serving import (
    FloatTarget,
    Follower,
    FollowerOptions,
    PendingUpdate,
    QuantizedTarget,
)
from torchrec_cnr.serving.follower import STEP_THROUGH
from torchrec_cnr.serving.options import SWAP_SHARE, available_memory, swap_mode
from torchrec_cnr.snapshot import buffers
from torchrec_cnr.storage import Storage, StorageWrapper, open_storage

EVERY = 2


def _train(root: str, kind: str, policy: PolicyName, last: int, config: dict[str, Any]) -> None:
    """Trains from the root's latest checkpoint (or from scratch) to ``last``, saving every
    ``EVERY`` steps: each call is a job that restores, as a restarted one does."""
    job = make_job(kind, optimizer="exact_rowwise_adagrad", seed=1)
    cfg = CheckpointConfig(path=root, policy=policy, interval_steps=EVERY, **config)
    with CheckpointManager(job.model, cfg, job.app_state) as ckpt:
        job.run((ckpt.restore() or 0) + 1, last, ckpt=ckpt)


def _served(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_serves_the_root(model: nn.Module, root: str) -> None:
    want = export_state_dict(root)
    got = _served(model)
    assert set(want) <= set(got), sorted(set(want) - set(got))
    bad = [k for k, v in want.items() if not torch.equal(v, got[k])]
    assert not bad, f"served tensors differ from the checkpoint: {bad}"


@pytest.mark.dist
@pytest.mark.parametrize(
    ("kind", "policy", "swap"),
    [(k, p, False) for k in ("ebc", "ec") for p in POLICIES]
    + [("ebc", "intermittent", True), ("ec", "consecutive", True)],
)
def test_fp32_follower_serves_exactly_the_latest_checkpoint_after_every_update(
    kind: str, policy: PolicyName, swap: bool, root: str
) -> None:
    model, _, _ = unsharded(kind, device="cpu")
    follower = Follower(root, FloatTarget(model), FollowerOptions(swap=swap))
    assert follower.poll() is None  # a fresh root: nothing to serve yet
    for last in (4, 6, 12):
        run_ranks(2, _train, root, kind, policy, last, {})
        assert follower.poll() == last
        _assert_serves_the_root(model, root)
    reports = follower.reports
    assert reports[0].cold and not any(r.cold for r in reports[1:])
    assert (follower.spare_bytes > 0) == swap == follower.swap
    manifest = Manifest.load(root)
    latest = manifest.latest()
    assert latest is not None
    total = sum(t.num_embeddings for t in manifest.record(latest).tables.values())
    assert all(r.rows < total for r in reports[1:]), [r.rows for r in reports]
    follower.close()


@pytest.mark.dist
def test_a_follower_reads_only_changed_rows_and_each_row_once_when_behind(root: str) -> None:
    run_ranks(2, _train, root, "ebc", "intermittent", 4, {})
    model, _, _ = unsharded("ebc", device="cpu")
    follower = Follower(root, FloatTarget(model))
    follower.poll()
    run_ranks(2, _train, root, "ebc", "intermittent", 56, {})  # 52 steps, 26 checkpoints behind
    follower.poll()
    _assert_serves_the_root(model, root)
    report = follower.reports[-1]
    assert not report.cold
    # Each changed row is read once, not once per checkpoint that changed it.
    changed = [i.rows_changed or 0 for i in list_checkpoints(root) if i.step > 4]
    assert max(changed) <= report.rows < sum(changed)
    follower.close()


@pytest.mark.dist
def test_one_behind_on_a_long_consecutive_chain_costs_what_it_does_on_a_short_one(
    root: str,
) -> None:
    """Format 7: a warm update reads the target's record, not its chain's."""
    run_ranks(2, _train, root, "ebc", "consecutive", 40, {})  # one chain of 20 checkpoints
    assert Manifest.load(root).latest().depth == 20  # type: ignore[union-attr]
    model, _, _ = unsharded("ebc", device="cpu")
    follower = Follower(root, FloatTarget(model))
    requests = {}
    for step in (4, 40):  # chains of 2 and of 20 checkpoints
        follower.pin(step - EVERY)
        follower.pin(step)
        assert not follower.reports[-1].cold
        requests[step] = follower.reports[-1].requests
    follower.unpin()
    _assert_serves_the_root(model, root)
    # Reading the 18 more links' records would take 18 more requests.
    assert requests[40] <= requests[4] + 4, requests
    follower.close()


def _baseline_after_five(sizes: Sequence[float]) -> bool:
    return len(sizes) >= 5


class _DataBytes(StorageWrapper):
    """Counts the bytes read from the checkpoints' data objects (not their indexes)."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.bytes = 0
        self._lock = threading.Lock()

    def read_into(self, name: str, offset: int, out: memoryview, cached: bool = False) -> None:
        super().read_into(name, offset, out, cached)
        if "/data/" in name:
            with self._lock:
                self.bytes += len(out)


@pytest.mark.dist
def test_far_behind_a_new_baseline_an_update_reads_the_changed_rows_from_it(root: str) -> None:
    """The target a full baseline, the follower five deltas behind: each changed row is
    read from the target, column-wise tables too, not from every checkpoint since that
    changed it (the survivors of older deltas lie scattered through them)."""
    run_ranks(2, _train, root, "ebc", "intermittent", 14, {"baseline_rule": _baseline_after_five})
    manifest = Manifest.load(root)
    entries = {e.step: manifest.record(e) for e in manifest.checkpoints}
    assert entries[14].kind == "full" and entries[4].kind == "delta"
    model, _, _ = unsharded("ebc", device="cpu")
    storage = _DataBytes(open_storage(root))
    follower = Follower(storage, FloatTarget(model))
    follower.pin(14)
    cold = storage.bytes
    follower.pin(4)
    storage.bytes = 0
    follower.pin(14)
    warm = follower.reports[-1]
    _assert_serves_the_root(model, root)
    assert follower.reports[0].cold and not warm.cold
    total = sum(t.num_embeddings for t in entries[14].tables.values())
    # Each changed row is read about once, its bytes at most twice (the reader merges
    # nearby runs): far under the whole tables a cold read takes.
    assert storage.bytes <= 2 * cold * warm.rows / total, (storage.bytes, cold, warm.rows, total)
    follower.close()


BUDGET = 32 * 1024
"""A follower's memory budget, in bytes, far under one update of these tables."""
BUDGET_MB = BUDGET / 2**20
"""The same in MB, as :class:`FollowerOptions` takes it."""


@pytest.mark.dist
@pytest.mark.parametrize(
    ("served", "bound"), [("fp32", "own"), ("int4", "own"), ("fp32", "every_read")]
)
def test_an_update_over_the_memory_budget_is_served_exactly_in_pieces(
    served: str, bound: str, root: str, tmp_path: Path
) -> None:
    # The follower's own budget, or the bound of every read (IOOptions.read_memory_mb).
    spill = tmp_path / "spill"
    spill.mkdir()
    model, target = _serving_target(served)
    if bound == "own":
        options = FollowerOptions(memory_budget_mb=BUDGET_MB, spill_dir=str(spill))
    else:
        options = FollowerOptions(io=IOOptions(read_memory_mb=BUDGET_MB), spill_dir=str(spill))
    follower = Follower(root, target, options)
    whole_model, whole = _serving_target(served)
    unbounded = Follower(root, whole)  # what the same updates serve held whole
    for last in (4, 8, 10):
        run_ranks(2, _train, root, "ebc", "intermittent", last, {})
        assert follower.poll() == unbounded.poll() == last
        for key, slot in target.tables().items():  # as served: dequantized for INT4
            ids = torch.arange(slot.num_embeddings)
            assert torch.equal(target.read_rows(key, ids), whole.read_rows(key, ids)), key
        if served == "fp32":  # the dense tensors too
            got, want = _served(model), _served(whole_model)
            assert [k for k in want if not torch.equal(got[k], want[k])] == []
        assert list(spill.iterdir()) == []  # each file unlinked once mapped
    assert all(r.spilled_bytes and r.held_bytes <= BUDGET for r in follower.reports), [
        (r.rows, r.spilled_bytes, r.held_bytes) for r in follower.reports
    ]
    assert [r.rows for r in follower.reports] == [r.rows for r in unbounded.reports]
    assert all(r.held_bytes > BUDGET for r in unbounded.reports)  # the budget did bind
    if served == "fp32":
        _assert_serves_the_root(model, root)
    follower.close()
    unbounded.close()


@pytest.mark.dist
def test_a_piece_the_gate_refuses_refuses_the_update_and_changes_nothing(root: str) -> None:
    model, target = _serving_target("fp32")
    pieces: dict[int, int] = {}  # step -> pieces of rows the gate saw

    def gate(update: PendingUpdate) -> str | None:
        if update.rows:
            pieces[update.step] = pieces.get(update.step, 0) + 1
        # The second piece of step 6: the first is prepared and spilled by then.
        return "bad piece" if update.step == 6 and pieces[6] == 2 else None

    follower = Follower(root, target, FollowerOptions(accept=gate, memory_budget_mb=BUDGET_MB))
    run_ranks(2, _train, root, "ebc", "consecutive", 4, {})
    assert follower.poll() == 4
    before = _served(model)
    run_ranks(2, _train, root, "ebc", "consecutive", 6, {})
    assert follower.poll() == 4
    assert pieces[4] > 1 and pieces[6] == 2, pieces
    assert [(r.step, r.reason) for r in follower.refused] == [(6, "bad piece")]
    after = _served(model)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    follower.close()


def test_a_memory_budget_must_be_positive_and_is_for_copy_mode(root: str) -> None:
    model, target = _serving_target("fp32")
    for bad in (0, -1, float("nan"), float("inf"), True, "8"):
        with pytest.raises(ValueError, match="memory_budget_mb must be > 0"):
            FollowerOptions(memory_budget_mb=bad)  # type: ignore[arg-type]
    assert FollowerOptions(memory_budget_mb=BUDGET_MB).memory_budget_bytes == BUDGET
    assert FollowerOptions(memory_budget_mb=1.5).memory_budget_bytes == 3 << 19
    with pytest.raises(ValueError, match="bounds copy mode"):
        FollowerOptions(memory_budget_mb=BUDGET_MB, swap=True)
    absent = FollowerOptions(memory_budget_mb=BUDGET_MB, spill_dir=f"{root}/absent")
    with pytest.raises(ValueError, match="is not a folder"):
        Follower(root, target, absent)
    with pytest.raises(ValueError, match="options must be a FollowerOptions"):
        Follower(root, target, {"swap": True})  # type: ignore[arg-type]


@pytest.mark.dist
def test_the_arguments_a_follower_took_before_its_options_still_work_deprecated(
    root: str, tmp_path: Path
) -> None:
    spill = str(tmp_path)
    model, target = _serving_target("fp32")

    def gate(update: PendingUpdate) -> str | None:
        return None

    with pytest.warns(DeprecationWarning, match=r"Follower\(accept=, swap=, memory_budget=, "
                      r"spill_dir=\.\.\.\) is deprecated"):  # fmt: skip
        follower = Follower(root, target, accept=gate, swap=False, memory_budget=BUDGET,
                            spill_dir=spill)  # fmt: skip
    want = FollowerOptions(accept=gate, swap=False, memory_budget_mb=BUDGET_MB, spill_dir=spill)
    assert follower.options == want
    for name, value in (("accept", gate), ("memory_budget", BUDGET), ("spill_dir", spill)):
        with pytest.warns(DeprecationWarning, match=f"Follower.{name} is deprecated"):
            assert getattr(follower, name) == value
    io = IOOptions(threads=3)
    with pytest.warns(DeprecationWarning, match=r"Follower\(io=\.\.\.\)"):
        reading = Follower(root, _serving_target("fp32")[1], io)  # type: ignore[arg-type]
    assert reading.options == FollowerOptions(io=io)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        Follower(root, target, memory_budget_bytes=1)
    with pytest.raises(TypeError, match="not both"):
        Follower(root, target, FollowerOptions(), swap=True)
    run_ranks(2, _train, root, "ebc", "intermittent", 4, {})
    assert follower.poll() == reading.poll() == 4  # they serve as ever
    _assert_serves_the_root(model, root)
    follower.close()
    reading.close()


def test_by_default_a_follower_swaps_where_the_second_copy_fits_in_half_the_free_memory(
    root: str,
) -> None:
    model, target = _serving_target("fp32")
    free = available_memory()
    assert free > 0
    chosen = FollowerOptions()
    assert chosen.swap is None
    assert swap_mode(chosen, int(SWAP_SHARE * free) // 2)
    assert not swap_mode(chosen, int(SWAP_SHARE * free) * 2), "no room: copy mode"
    assert not swap_mode(FollowerOptions(memory_budget_mb=BUDGET_MB), 1), "a budget: copy mode"
    bounded = FollowerOptions(io=IOOptions(read_memory_mb=BUDGET_MB))
    assert not swap_mode(bounded, 1), "the bound of every read: copy mode"
    assert bounded.memory_budget_bytes == BUDGET
    assert swap_mode(dataclasses.replace(bounded, swap=True), 1), "swap mode as asked"
    assert swap_mode(FollowerOptions(swap=True), 2**62) and not swap_mode(
        FollowerOptions(swap=False), 1
    )
    with pytest.raises(ValueError, match="swap must be a bool or None"):
        FollowerOptions(swap="yes")  # type: ignore[arg-type]
    follower = Follower(root, target)  # a small model: it fits
    assert follower.swap and follower.spare_bytes == 0, "the spare comes with the first step"
    follower.close()
    copying = Follower(root, _serving_target("fp32")[1], FollowerOptions(swap=False))
    assert not copying.swap and copying.spare_bytes == 0
    copying.close()


_INTERMITTENT_TABLES = [("a", 20000, "table_wise"), ("b", 20001, "row_wise")]


def _intermittent_tables() -> list[Any]:
    from cnr_train.workload import TableSpec

    return [TableSpec(name, rows, 16, layout) for name, rows, layout in _INTERMITTENT_TABLES]


def _intermittent(root: str) -> None:
    from tests.jobs import make_job

    job = make_job(_intermittent_tables(), root, seed=1, policy="intermittent", batch_size=64,
                   alpha=1.05)  # fmt: skip
    for step in range(2, 17, 2):
        job.train(2)
        job.ckpt.save(step)
    job.ckpt.close()


def _runs(positions: torch.Tensor) -> int:
    """Runs of consecutive stored rows among ascending ``positions``."""
    return 1 + int((positions[1:] != positions[:-1] + 1).sum()) if positions.numel() else 0


@pytest.mark.dist
def test_one_checkpoint_behind_a_cumulative_delta_costs_the_requests_of_a_consecutive_one(
    root: str,
) -> None:
    """Format 5: the rows changed since the served checkpoint are read as one run per
    stored tensor, however they lie among the delta's other rows."""
    from cnr_train.serve import serving_model
    from torchrec_cnr.read.chain import ChainReader

    run_ranks(2, _intermittent, root)
    manifest = Manifest.load(root)
    entries = manifest.checkpoints
    assert [e.kind for e in entries[:2]] == ["full", "delta"]
    served = serving_model(_intermittent_tables(), 4, "fp32")
    follower = Follower(root, FloatTarget(served))
    first: int | None = None
    scattered = tails = 0
    for before, after in zip(entries, entries[1:]):
        follower.pin(before.step)
        follower.pin(after.step)
        report = follower.reports[-1]
        assert not report.cold and report.step == after.step
        want = export_state_dict(root, after.step)
        got = _served(served)
        assert all(torch.equal(v, got[k]) for k, v in want.items()), after.step
        if after.kind != "delta":
            continue
        records = [r for r in manifest.shards(after) if r.recent == "tail" and r.recent_rows]
        if first is None:  # the first delta stores exactly its changes: contiguous
            assert not records
            first = report.requests
            continue
        tails = max(tails, len(records))
        # Two requests per tail at most: its ids, and its rows (a piece boundary may split
        # them); the old layout needed one per run of changed rows among the others.
        assert report.requests <= first + 2 * len(records), (after.step, report.requests, first)
        with ChainReader.open(root, after.step) as chain:
            n = len(chain.links) - 1
            for rec in records:
                ids = chain.saved_ids(n, rec)
                recent = ids[rec.saved_rows - rec.recent_rows :]
                scattered += _runs(torch.searchsorted(torch.sort(ids).values, recent))
    assert tails and scattered > 20 * tails, "the changed rows must lie scattered"
    # Several checkpoints behind: each row is read once, from the newest checkpoint that
    # changed it (one run each), not from among the target's other rows: per checkpoint
    # its index, its record and its shard records (format 7), per stored shard its changed
    # ids and a run of rows.
    follower.pin(entries[1].step)
    follower.pin(entries[-1].step)
    report = follower.reports[-1]
    want = export_state_dict(root, entries[-1].step)
    got = _served(served)
    assert all(torch.equal(v, got[k]) for k, v in want.items())
    runs = sum(
        bool(r.recent_rows or r.recent == "stored") for e in entries[2:] for r in manifest.shards(e)
    )
    bound = first + 2 * runs + 3 * len(entries[2:]) if first is not None else 0
    assert report.requests <= bound, (report.requests, bound)
    follower.close()


def test_a_format_4_root_is_followed_and_read_as_it_was_written(tmp_path: Path) -> None:
    """``tests/data/format_v4``: an intermittent root written before cumulative deltas
    stored their changes last (2 ranks, tables a: 600 x 8 table-wise, c: 401 x 8
    row-wise), with what ``export_state_dict`` gave at each step then."""
    import shutil

    from cnr_train.serve import serving_model
    from cnr_train.workload import TableSpec

    data = Path(__file__).parents[1] / "data" / "format_v4"
    root = str(shutil.copytree(data / "ckpt", tmp_path / "ckpt"))
    expected = torch.load(data / "expected.pt", weights_only=True)
    assert json.loads((data / "ckpt" / "manifest.json").read_text())["format_version"] == 4
    tables = [TableSpec("a", 600, 8, "table_wise"), TableSpec("c", 401, 8, "row_wise")]
    served = serving_model(tables, 4, "fp32")
    follower = Follower(root, FloatTarget(served))
    for step, want in sorted(expected.items()):
        assert follower.pin(step) == step
        got = _served(served)
        assert all(torch.equal(v, got[k]) for k, v in want.items()), step
        assert all(torch.equal(v, export_state_dict(root, step)[k]) for k, v in want.items())
    assert not any(r.cold for r in follower.reports[1:])
    follower.close()


@pytest.mark.dist
@pytest.mark.parametrize("policy", ["consecutive", "intermittent"])
def test_quantized_follower_serves_4_bit_checkpoint_rows_as_stored(
    policy: PolicyName, root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each poll is two checkpoints behind: rows come from the newest checkpoint that
    # changed them, the same 4-bit bytes the target's chain stores. Consecutive: every
    # warm read (codes, scales and biases) into buffers reused from update to update.
    if policy == "consecutive":
        monkeypatch.setattr(buffers, "MIN_BYTES", 0)
    four_bit = {"quantize": QuantizeConfig(method="adaptive", bits=4, min_rows=0)}
    from torchrec.inference.modules import quantize_embeddings

    model, _, _ = unsharded("ebc", device="cpu")
    served = quantize_embeddings(copy.deepcopy(model), dtype=torch.quint4x2, inplace=True)
    target = QuantizedTarget(served)
    follower = Follower(root, target)
    for last in (4, 8, 12):
        run_ranks(2, _train, root, "ebc", policy, last, four_bit)
        assert follower.poll() == last
        want = export_state_dict(root)
        manifest = Manifest.load(root)
        latest = manifest.latest()
        assert latest is not None
        shards = manifest.shards(latest)
        whole = {  # tables whose every stored row is a whole served row
            shape.state_dict_key
            for name, shape in manifest.record(latest).tables.items()
            if all(r.spec.cols == shape.embedding_dim for r in shards if r.spec.table == name)
        }
        assert len(whole) >= 4
        for key, slot in target.tables().items():
            got = target.read_rows(key, torch.arange(slot.num_embeddings))
            if key in whole:  # the stored 4-bit row itself, no second rounding
                assert torch.equal(got, want[key]), key
            else:  # split by column, or fp32 (data parallel): our adaptive quantizer's
                expected = quantize(want[key], "adaptive", 4).dequantize()
                assert torch.equal(got, expected), key
    follower.close()


def _compact_and_retire(root: str) -> None:
    job = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=1)
    cfg = CheckpointConfig(
        path=root, policy="consecutive", interval_steps=1, keep_last=1, compact_every=2
    )
    with CheckpointManager(job.model, cfg, job.app_state) as ckpt:
        start = ckpt.restore() or 0
        for step in range(start + 1, start + 25):
            job.step(step)
            ckpt.maybe_save(step)


@pytest.mark.dist
def test_keep_last_and_compaction_racing_a_follower_never_break_it(root: str) -> None:
    model, _, _ = unsharded("ebc", device="cpu")
    follower = Follower(root, FloatTarget(model))
    stop = threading.Event()
    errors: list[BaseException] = []

    def poll_at_random() -> None:
        import random

        rnd = random.Random(3)
        while not stop.is_set():
            try:
                follower.poll()
            except Exception as e:  # a file retired between plan and read: next poll
                errors.append(e)
            stop.wait(rnd.uniform(0.0, 0.2))

    thread = threading.Thread(target=poll_at_random)
    thread.start()
    try:
        run_ranks(2, _compact_and_retire, root)
    finally:
        stop.set()
        thread.join()
    follower.poll()
    _assert_serves_the_root(model, root)
    assert len(follower.reports) >= 2
    follower.close()


def _rewind(root: str) -> None:
    job = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=1)
    cfg = CheckpointConfig(path=root, policy="intermittent", interval_steps=EVERY)
    with CheckpointManager(job.model, cfg, job.app_state) as ckpt:
        assert ckpt.restore(step=4) == 4
        for step in range(5, 7):
            job.step(step + 100)  # other data: the job diverges from the served one
            ckpt.maybe_save(step)


def _take_over(root: str) -> None:
    job = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=2)
    cfg = CheckpointConfig(path=root, policy="intermittent", interval_steps=EVERY, take_over=True)
    with CheckpointManager(job.model, cfg, job.app_state) as ckpt:
        for step in range(1, 5):  # a new job that starts afresh: a new baseline
            job.step(step)
            ckpt.maybe_save(step)


@pytest.mark.dist
def test_a_rewind_and_a_take_over_are_followed_exactly(root: str) -> None:
    run_ranks(2, _train, root, "ebc", "intermittent", 10, {})
    model, _, _ = unsharded("ebc", device="cpu")
    follower = Follower(root, FloatTarget(model))
    assert follower.poll() == 10
    run_ranks(2, _rewind, root)
    assert follower.poll() == 6
    assert follower.reports[-1].rewind and not follower.reports[-1].cold
    _assert_serves_the_root(model, root)
    run_ranks(2, _take_over, root)
    assert follower.poll() == 4
    _assert_serves_the_root(model, root)
    follower.close()


@pytest.mark.dist
def test_a_damaged_file_fails_the_update_and_the_last_good_step_stays_served(
    root: str,
) -> None:
    run_ranks(2, _train, root, "ebc", "consecutive", 4, {})
    model, _, _ = unsharded("ebc", device="cpu")
    follower = Follower(root, FloatTarget(model))
    follower.poll()
    good = _served(model)
    run_ranks(2, _train, root, "ebc", "consecutive", 6, {})
    latest = Manifest.load(root).latest()
    assert latest is not None
    storage = open_storage(root)
    data = [n for n in (Path(root) / latest.id / "data").iterdir()]
    for path in data:
        path.unlink()  # every data object of the new checkpoint is gone
    with pytest.raises(Exception, match=latest.id):
        follower.poll()
    assert follower.step == 4
    assert all(torch.equal(v, good[k]) for k, v in _served(model).items())
    assert storage.exists(f"{latest.id}/.snapshot_metadata")
    follower.close()


@pytest.mark.dist
def test_a_model_that_does_not_match_is_refused_before_anything_changes(root: str) -> None:
    run_ranks(2, _train, root, "ebc", "consecutive", 4, {})
    model, _, _ = unsharded("ec", device="cpu")  # another model
    before = _served(model)
    follower = Follower(root, FloatTarget(model))
    with pytest.raises(ModelMismatchError, match="in the checkpoint but not in the model"):
        follower.poll()
    assert all(torch.equal(v, before[k]) for k, v in _served(model).items())
    follower.close()


def _constant_steps(root: str, steps: int) -> None:
    """Every row of every table, and every dense tensor, holds the step at each save."""
    from torchrec_cnr.tracking import model_state

    job = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=1)
    cfg = CheckpointConfig(path=root, policy="full")
    with CheckpointManager(job.model, cfg, job.app_state) as ckpt, torch.no_grad():
        for step in range(1, steps + 1):
            for shard in model_state.local_shards(job.model):
                shard.weight.fill_(float(step))
                if shard.recent is not None:  # written behind the tracker's back: say so
                    shard.recent.fill_(-1)
            for tensor in model_state.dense_state(job.model).values():
                tensor.fill_(float(step))  # data-parallel tables among them
            ckpt.save(step)
            ckpt.wait()
            time.sleep(0.3)  # let the follower apply this step before the next


def _serving_target(served: str) -> tuple[Any, Any]:
    """The unsharded model served as fp32, or as TorchRec's INT4 or INT2 model."""
    model, _, _ = unsharded("ebc", device="cpu")
    if served == "fp32":
        return model, FloatTarget(model)
    from torchrec.inference.modules import quantize_embeddings

    dtype = torch.quint4x2 if served == "int4" else torch.quint2x4
    quantized = quantize_embeddings(model, dtype=dtype, inplace=True)
    return quantized, QuantizedTarget(quantized)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("served", "swap", "budget"),
    [("fp32", False, None), ("int4", False, None), ("int2", False, None), ("fp32", True, None),
     ("int4", True, None), ("fp32", False, BUDGET_MB), ("int4", False, BUDGET_MB)],
)  # fmt: skip
def test_every_lookup_sees_the_rows_of_the_step_follower_step_names(
    served: str, swap: bool, budget: float | None, root: str
) -> None:
    # Every row of every table holds its checkpoint's step (exact in every format: a
    # constant row quantizes to its fp16 bias), so a lookup that reads the rows of one
    # step while follower.step names another is caught, whichever table it reads first.
    _, target = _serving_target(served)
    keys = {k: torch.arange(slot.num_embeddings) for k, slot in target.tables().items()}
    follower = Follower(root, target, FollowerOptions(swap=swap, memory_budget_mb=budget))
    exclusive = follower._lock.exclusive

    @contextlib.contextmanager
    def held_then_paused() -> Iterator[None]:
        # Widen the moment after an update lets lookups in: whatever the follower still
        # does then (naming the served step, say) is what a lookup would see torn.
        with exclusive():
            yield
        time.sleep(0.005)

    follower._lock.exclusive = held_then_paused  # type: ignore[method-assign]
    seen: list[tuple[int, set[float]]] = []
    errors: list[Exception] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            time.sleep(0.001)  # between requests
            with follower.serving():
                step = follower.step
                if step is None:  # still the model's own initial values
                    continue
                values = {
                    float(v) for k, ids in keys.items() for v in target.read_rows(k, ids).unique()
                }
            seen.append((step, values))

    def follow() -> None:
        while not stop.wait(0.01):
            try:
                follower.poll()
            except Exception as e:
                errors.append(e)

    threads = [threading.Thread(target=serve), threading.Thread(target=follow)]
    for t in threads:
        t.start()
    try:
        run_ranks(2, _constant_steps, root, 6)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert follower.poll() == 6
    if budget is not None:  # every row changes at every step: each update is spilled
        assert all(r.spilled_bytes and r.held_bytes <= BUDGET for r in follower.reports)
    torn = [(step, v) for step, v in seen if v != {float(step)}]
    assert not torn, f"lookups saw rows of another step than follower.step: {torn[:3]}"
    if len(follower.reports) >= 3:  # on a loaded machine the follower may take few steps
        assert len({step for step, _ in seen}) >= 2, "the server must have seen updates land"
    follower.close()


def _poll_into(follower: Follower, steps: list[int | None], i: int) -> None:
    steps[i] = follower.poll()


@pytest.mark.dist
def test_several_followers_follow_one_s3_root_at_once(s3_root: str) -> None:
    models = [unsharded("ebc", device="cpu")[0] for _ in range(3)]
    followers = [Follower(s3_root, FloatTarget(m)) for m in models]
    for last in (4, 8):
        run_ranks(2, _train, s3_root, "ebc", "intermittent", last, {})
        steps: list[int | None] = [None] * len(followers)
        threads = [
            threading.Thread(target=_poll_into, args=(f, steps, i)) for i, f in enumerate(followers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert steps == [last] * len(followers)
        for model in models:
            _assert_serves_the_root(model, s3_root)
    assert all(not f.reports[-1].cold for f in followers)
    for f in followers:
        f.close()


class _CountedSwaps(FloatTarget):
    """A float target that counts its swaps."""

    swaps = 0

    def swap(self) -> None:
        self.swaps += 1
        super().swap()


@pytest.mark.dist
def test_swap_mode_serves_a_commit_landed_during_the_first_read_before_making_the_spare(
    root: str,
) -> None:
    """Swap mode: where a commit lands while the first step is read, the poll that served
    that step leaves the second copy unmade; the next serves the commit in place, then
    makes it, and later updates are swapped in. A follower caught up at the end of its
    first poll makes the copy then."""
    run_ranks(2, _train, root, "ebc", "consecutive", 2, {})
    model, _, _ = unsharded("ebc", device="cpu")
    target = _CountedSwaps(model)
    landed: list[int] = []

    def gate(update: PendingUpdate) -> str | None:
        if not landed:  # the job commits again while the first step is read
            landed.append(update.plan.target.step)
            run_ranks(2, _train, root, "ebc", "consecutive", 2 + EVERY, {})
        return None

    follower = Follower(root, target, FollowerOptions(accept=gate, swap=True))
    assert follower.poll() == 2 and follower.spare_bytes == 0
    assert follower.poll() == 2 + EVERY
    assert follower.spare_bytes > 0 and target.swaps == 0, "served in place, then the copy"
    _assert_serves_the_root(model, root)
    run_ranks(2, _train, root, "ebc", "consecutive", 2 + 2 * EVERY, {})
    assert follower.poll() == 2 + 2 * EVERY and target.swaps == 1
    _assert_serves_the_root(model, root)
    caught_up = Follower(root, FloatTarget(unsharded("ebc", device="cpu")[0]),
                         FollowerOptions(swap=True))  # fmt: skip
    assert caught_up.poll() == 2 + 2 * EVERY and caught_up.spare_bytes > 0
    for f in (follower, caught_up):
        f.close()


@pytest.mark.dist
@pytest.mark.parametrize("swap", [False, True])
def test_rows_read_into_reused_buffers_serve_exactly_and_rows_a_gate_keeps_stay_as_read(
    root: str, swap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm updates read into buffers reused from one update to the next (every read,
    here, however small): each step is served exactly, and the rows the gate kept of one
    update are not overwritten by the updates after it."""
    monkeypatch.setattr(buffers, "MIN_BYTES", 0)
    model, _, _ = unsharded("ebc", device="cpu")
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows as read, a copy)

    def gate(update: PendingUpdate) -> str | None:
        if update.step == 6:
            kept.extend((t, t.clone()) for _, _, rows in update.rows for t in rows.tensors())
        return None

    follower = Follower(root, FloatTarget(model), FollowerOptions(accept=gate, swap=swap))
    for last in (2, 4, 6, 8, 10, 12):
        run_ranks(2, _train, root, "ebc", "consecutive", last, {})
        assert follower.poll() == last
        _assert_serves_the_root(model, root)
    assert kept and all(torch.equal(t, copy) for t, copy in kept)
    assert not any(r.cold for r in follower.reports[1:])
    follower.close()


@pytest.mark.dist
def test_a_few_commits_behind_a_follower_serves_each_in_turn_exactly(root: str) -> None:
    """At most STEP_THROUGH commits behind, one poll serves every commit in commit order,
    each exactly (what each update saw served is checked against that step's export);
    further behind, it goes straight to the latest; a refused commit among them is
    passed over for the latest at the next poll."""
    model, _, _ = unsharded("ebc", device="cpu")
    seen: list[tuple[int, dict[str, torch.Tensor]]] = []
    refuse: set[int] = set()

    def gate(update: PendingUpdate) -> str | None:
        seen.append((update.plan.target.step, _served(model)))
        return "refused by the test" if update.plan.target.step in refuse else None

    follower = Follower(root, FloatTarget(model), FollowerOptions(accept=gate, swap=False))
    run_ranks(2, _train, root, "ebc", "consecutive", 2, {})
    assert follower.poll() == 2
    last = 2 + EVERY * STEP_THROUGH
    run_ranks(2, _train, root, "ebc", "consecutive", last, {})
    assert follower.poll() == last
    stepped = list(range(2 + EVERY, last + 1, EVERY))
    assert [r.step for r in follower.reports[1:]] == stepped
    _assert_serves_the_root(model, root)
    for (step, before), previous in zip(seen[1:], [2, *stepped[:-1]], strict=True):
        want = export_state_dict(root, step=previous)
        assert all(torch.equal(v, before[k]) for k, v in want.items()), (step, previous)
    # Further behind than STEP_THROUGH: the latest at once.
    further = last + EVERY * (STEP_THROUGH + 1)
    run_ranks(2, _train, root, "ebc", "consecutive", further, {})
    assert follower.poll() == further
    assert [r.step for r in follower.reports[len(stepped) + 1 :]] == [further]
    # A refused commit among a few: the next poll serves the latest instead.
    refuse.add(further + EVERY)
    run_ranks(2, _train, root, "ebc", "consecutive", further + 2 * EVERY, {})
    assert follower.poll() == further
    assert [r.step for r in follower.refused] == [further + EVERY]
    assert follower.poll() == further + 2 * EVERY
    _assert_serves_the_root(model, root)
    follower.close()
