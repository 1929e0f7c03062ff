"""Lazy (copy-on-write) staging: rows copied after ``save()`` returned hold the saved values.

The background copy is held back (``_holding``) while training goes on, so that the
lookup hooks, not the background writer, copy every row a batch updates: the checkpoint
must still be the model at the saved step, bit for bit, on every layout and policy,
with the plain loop and with TorchRec's ``TrainPipelineSparseDist``. Where the premise
does not hold (a batch looked up and not yet updated), the save falls back to eager.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from cnr_train.workload import TableSpec, ZipfBatches, dense_optimizer, dlrm, hand_plan
from tests import reference
from tests.jobs import Job, make_job, restores_exactly, save_reference
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointConfig, CheckpointManager, IOOptions, tracking_sharders
from torchrec_cnr.selection import POLICIES
from torchrec_cnr.staging import LazyStaging, cow, lazy
from torchrec_cnr.tracking import model_state, write_rows

pytestmark = pytest.mark.dist

TABLES = [
    TableSpec("t_tw", 300, 8, "table_wise"),
    TableSpec("t_rw", 500, 8, "row_wise"),
    TableSpec("t_cw", 200, 8, "column_wise"),
    TableSpec("t_trw", 260, 8, "table_row_wise"),
    TableSpec("t_grid", 240, 8, "grid_shard"),
    TableSpec("t_dp", 50, 8, "data_parallel"),
]


@contextmanager
def _holding() -> Iterator[threading.Event]:
    """Holds every lazy checkpoint's background copy until the event is set."""
    gate = threading.Event()
    original = LazyStaging.run

    def held(self: LazyStaging, sink: Any) -> None:
        assert gate.wait(120), "the test never released the background copy"
        original(self, sink)

    LazyStaging.run = held  # type: ignore[method-assign]
    try:
        yield gate
    finally:
        gate.set()
        LazyStaging.run = original  # type: ignore[method-assign]


def _job(root: str, policy: str, seed: int) -> Job:
    return make_job(TABLES, root, seed=seed, data_seed=3, alpha=1.05, policy=policy)


def _hooks_copy_what_training_updates(policy: str, root: str, refs: str) -> None:
    job = _job(root, policy, seed=1)
    done = 0
    for step, trained_after in ((3, 4), (8, 3), (12, 0)):
        job.train(step - done)
        done = step + trained_after
        with _holding() as gate:
            assert job.ckpt.save(step)
            save_reference(job, refs, step)
            pending = job.ckpt.lazy_staging
            assert pending is not None, "every layout but data_parallel stages lazily"
            job.train(trained_after)  # updates rows whose copy is still to come
            for tracker in model_state.trackers(job.model).values():
                with pytest.raises(RuntimeError, match="still being copied"):
                    tracker.set_enabled(False)  # the copy needs the lookup hooks
            gate.set()
            job.ckpt.wait()
        if trained_after:
            assert pending.hook_rows > 0, "the lookup hooks copied nothing"
    job.ckpt.close()
    for step in (3, 8, 12):
        restores_exactly(
            TABLES, root, refs, step, seed=50 + step, data_seed=3, alpha=1.05, policy=policy
        )


@pytest.mark.parametrize("policy", POLICIES)
def test_rows_copied_after_save_returned_hold_the_saved_step(
    policy: str, root: str, refs: Path
) -> None:
    run_ranks(2, _hooks_copy_what_training_updates, policy, root, str(refs))


def _racing(policy: str, root: str, refs: str, seed: int, compiled: bool) -> None:
    # Small pieces and random pauses: the hooks and the background copy interleave
    # differently at every save, with the compiled copier's claims or torch's lock.
    rng = random.Random(seed + dist.get_rank())
    original_chunk, original_block = lazy.CHUNK_ROWS, lazy._Shard.copy_block
    original_copy = cow.Group.copy
    used: list[str] = []

    def slow_block(self: Any, rows: Any, a: int, b: int) -> None:
        used.append("torch")
        time.sleep(rng.random() * 0.002)
        original_block(self, rows, a, b)

    def slow_copy(self: Any, i: int, slot_rows: Any, a: int, b: int) -> int:
        used.append("compiled")
        copied = 0
        while a < b:
            end = min(b, a + rng.randint(1, 9))
            time.sleep(rng.random() * 0.002)
            copied += original_copy(self, i, slot_rows, a, end)
            a = end
        return copied

    lazy.CHUNK_ROWS, lazy._Shard.copy_block = 7, slow_block  # type: ignore[method-assign]
    cow.Group.copy = slow_copy  # type: ignore[method-assign]
    try:
        job = make_job(TABLES, root, seed=seed, data_seed=9, alpha=1.05, policy=policy,
                       interval_steps=1, io=IOOptions(compiled_staging=compiled))  # fmt: skip
        for step in range(1, 13):
            job.train(1)
            assert job.ckpt.maybe_save(step)
            save_reference(job, refs, step)
        job.ckpt.close()
    finally:
        lazy.CHUNK_ROWS, lazy._Shard.copy_block = original_chunk, original_block  # type: ignore[method-assign]
        cow.Group.copy = original_copy  # type: ignore[method-assign]
    assert set(used) == {"compiled" if compiled else "torch"}, set(used)
    for step in (1, 6, 12):
        restores_exactly(TABLES, root, refs, step, seed=70 + step, data_seed=9, policy=policy)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("policy", ["consecutive", "intermittent"])
def test_hooks_racing_the_background_copy_save_every_step_exactly(
    policy: str, compiled: bool, root: str, refs: Path
) -> None:
    run_ranks(2, _racing, policy, root, str(refs), 11, compiled)


def _rows_written_by_hand(policy: str, root: str, refs: str) -> None:
    job = _job(root, policy, seed=4)
    sharded = [t for t in TABLES if t.sharding != "data_parallel"]
    rows = {t.name: torch.tensor([0, t.rows // 2, t.rows - 1]) for t in sharded}
    job.train(3)
    with _holding() as gate:
        assert job.ckpt.save(3)
        save_reference(job, refs, 3)
        for t in sharded:  # after save() returned, before the rows were copied
            written = torch.tensor(
                write_rows(job.model, t.name, rows[t.name], torch.full((3, t.dim), 7.0))
            )
            dist.all_reduce(written)  # every row by some rank (column shards: each part)
            assert int(written) >= 3, (t.name, int(written))
        gate.set()
        job.ckpt.wait()
    with pytest.raises(ValueError, match="no tracked shard of table 't_dp'"):
        write_rows(job.model, "t_dp", torch.tensor([0]), torch.zeros(1, 8))
    job.train(1)
    assert job.ckpt.save(4)
    save_reference(job, refs, 4)
    job.ckpt.close()
    restores_exactly(TABLES, root, refs, 3, seed=60, data_seed=3, alpha=1.05, policy=policy)
    restores_exactly(
        TABLES, root, refs, 4, seed=61, data_seed=3, alpha=1.05, policy=policy
    )  # with the written rows


@pytest.mark.parametrize("policy", ["full", "intermittent"])
def test_rows_written_by_hand_reach_the_next_checkpoint_not_the_saving_one(
    policy: str, root: str, refs: Path
) -> None:
    run_ranks(2, _rows_written_by_hand, policy, root, str(refs))


def _save_between_forward_and_backward(root: str, refs: str) -> None:
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchrec_cnr.staging.stager").addHandler(handler)
    logging.getLogger("torchrec_cnr.staging.stager").setLevel(logging.INFO)
    job = _job(root, "consecutive", seed=2)
    job.train(3)
    job.data.position = 4
    job.dense_opt.zero_grad()
    loss = job.loss(job.model, job.data.batch(dist.get_rank(), 4))
    with _holding() as gate:
        assert job.ckpt.save(4)  # the batch is looked up; its update is still to come
        save_reference(job, refs, 4)
        assert job.ckpt.lazy_staging is None, "a pending update must make the save eager"
        loss.backward()
        job.dense_opt.step()
        gate.set()
        job.ckpt.wait()
    assert any("looked up and not yet updated" in m for m in said), said
    job.train(2)
    assert job.ckpt.save(6) and job.ckpt.lazy_staging is not None, "lazy again after backward"
    job.ckpt.close()
    restores_exactly(TABLES, root, refs, 4, seed=3, data_seed=3, alpha=1.05, policy="consecutive")


def test_a_save_between_a_lookup_and_its_update_falls_back_to_eager(root: str, refs: Path) -> None:
    run_ranks(2, _save_between_forward_and_backward, root, str(refs))


class _DataLoader:
    """TorchRec ``Batch``es of the synthetic reader, for TorchRec's pipeline."""

    def __init__(self, data: ZipfBatches) -> None:
        self.data = data

    def __iter__(self) -> _DataLoader:
        return self

    def __next__(self) -> Any:
        from torchrec.datasets.utils import Batch

        b = self.data.next(dist.get_rank())
        return Batch(dense_features=b.dense, sparse_features=b.sparse, labels=b.labels)


def _pipeline(root: str, refs: str) -> None:
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.models.dlrm import DLRMTrain

    tables = TABLES[:2]
    torch.manual_seed(0)
    module = DLRMTrain(dlrm(tables, 4, torch.device("meta"), torch.device("cpu")))
    sharders = tracking_sharders(
        {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    )
    plan = hand_plan(module, {t.name: str(t.sharding) for t in tables}, 2, sharders)
    model = DistributedModelParallel(
        module, plan=plan, sharders=sharders, device=torch.device("cpu")
    )
    torch.manual_seed(1)
    opt = dense_optimizer(model)
    pipeline = TrainPipelineSparseDist(model, opt, device=torch.device("cpu"))
    batches = iter(_DataLoader(ZipfBatches(tables, batch_size=16, alpha=1.05, seed=4)))
    config = CheckpointConfig(path=root, policy="intermittent")
    saved = []
    with CheckpointManager(model, config, {"dense_opt": opt}) as ckpt:
        for step in range(1, 13):
            pipeline.progress(batches)
            if step % 4 == 0:
                with _holding() as gate:
                    assert ckpt.save(step)
                    reference.save(reference.take(model, {"dense_opt": opt}), Path(refs), step)
                    pending = ckpt.lazy_staging
                    assert pending is not None
                    for _ in range(2):
                        pipeline.progress(batches)  # looks up the next batch, updates rows
                    gate.set()
                    ckpt.wait()
                assert pending.hook_rows > 0
                saved.append(step)
    for step in saved:
        with CheckpointManager(model, config, {"dense_opt": opt}) as ckpt:
            assert ckpt.restore(step=step) == step
        reference.assert_model_matches(
            model, {"dense_opt": opt}, reference.load_all(Path(refs), step)
        )


def test_train_pipeline_sparse_dist_saves_lazily_and_exactly(root: str, refs: Path) -> None:
    run_ranks(2, _pipeline, root, str(refs))


def _partial_restore_while_staging(root: str, refs: str) -> None:
    job = _job(root, "consecutive", seed=4)
    job.train(3)
    assert job.ckpt.save(3)
    job.ckpt.wait()
    save_reference(job, refs, 3)
    job.train(2)
    with _holding() as gate:
        assert job.ckpt.save(5)
        save_reference(job, refs, 5)
        assert job.ckpt.lazy_staging is not None
        job.train(2)
        # The restore must first let the pending copy finish (it waits for the job):
        # release it from another thread while the restore waits.
        threading.Timer(0.5, gate.set).start()
        assert job.ckpt.restore(ranks=[0]) == 5
    if dist.get_rank() == 0:  # rank 0's shards hold step 5 again; the dense state goes on
        want = {(s[0].table, s[0].row_offset, s[0].col_offset): s[1]
                for s in reference.load_all(Path(refs), 5)[0]["shards"]}  # fmt: skip
        for shard in model_state.local_shards(job.model):
            key = (shard.spec.table, shard.spec.row_offset, shard.spec.col_offset)
            assert torch.equal(shard.weight, want[key]), key
    job.ckpt.close()
    restores_exactly(TABLES, root, refs, 5, seed=5, data_seed=3, alpha=1.05, policy="consecutive")


def test_a_partial_restore_while_rows_are_staged_waits_for_them(root: str, refs: Path) -> None:
    run_ranks(2, _partial_restore_while_staging, root, str(refs))


def _late_bits(policy: str, root: str, refs: str) -> None:
    from torchrec_cnr.tracking import tracker

    submit = tracker._Marker.submit

    def late(self: Any, work: Any) -> None:  # the worker thread marks each batch late
        def slow() -> None:
            time.sleep(0.05)
            work()

        submit(self, slow)

    tracker._Marker.submit = late  # type: ignore[method-assign]
    lazy_only = [t for t in TABLES if t.sharding != "data_parallel"]
    job = make_job(lazy_only, root, seed=1, data_seed=3, alpha=1.05, policy=policy)
    for step in range(1, 5):
        job.train(1)
        assert job.ckpt.save(step)
        assert job.ckpt.lazy_staging is not None
        save_reference(job, refs, step)
    job.ckpt.close()
    for step in range(1, 5):
        restores_exactly(
            lazy_only, root, refs, step, seed=50 + step, data_seed=3, alpha=1.05, policy=policy
        )


@pytest.mark.parametrize("policy", ["consecutive", "intermittent"])
def test_a_save_holds_the_rows_of_lookups_still_being_marked(
    policy: str, root: str, refs: Path
) -> None:
    """Every shard staged lazily (no eager shard whose selection waits for the tracker):
    the bits of the last batches, still on the tracker's thread when save() begins, are
    in the checkpoint. It lost them once under load (the README's quick start)."""
    run_ranks(2, _late_bits, policy, root, str(refs))
