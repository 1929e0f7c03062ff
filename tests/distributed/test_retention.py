"""``keep_last``: a root keeps exactly what restoring its last N checkpoints needs, on
every storage backend, and every checkpoint it keeps restores bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from cnr_train.workload import TableSpec
from tests.faults import Fault, FaultyStorage
from tests.jobs import assert_restores, make_job, save_reference
from tests.multiprocess import run_ranks
from torchrec_cnr.cli import main as cnr
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.storage import open_storage

TABLES = [TableSpec("a", 500, 16, "table_wise"), TableSpec("b", 4001, 16, "row_wise")]


def _save(root: str, refs: str, policy: str) -> None:
    job = make_job(TABLES, root, seed=1, data_seed=2, policy=policy, keep_last=2, interval_steps=2)
    for step in range(1, 13):
        job.train(1)
        if job.ckpt.maybe_save(step):
            job.ckpt.wait()
            save_reference(job, refs, step)
    job.ckpt.close()


def _restores(root: str, refs: str, step: int) -> None:
    job = make_job(TABLES, root, seed=9, data_seed=2)
    assert_restores(job, refs, step)
    job.ckpt.close()


@pytest.mark.dist
@pytest.mark.parametrize("policy", ["consecutive", "intermittent"])
def test_keep_last_keeps_what_the_last_restores_need_and_nothing_else(
    policy: str, any_root: str, refs: Path
) -> None:
    run_ranks(2, _save, any_root, str(refs), policy)
    manifest = Manifest.load(any_root)
    assert manifest.steps()[-2:] == [10, 12]
    needed = manifest.needed_ids(2)
    assert {e.id for e in manifest.checkpoints} == needed
    assert set(open_storage(any_root).children()) == needed, "every other directory is deleted"
    assert cnr(["verify", any_root]) == 0
    for step in (10, 12):
        run_ranks(2, _restores, any_root, str(refs), step)


def _save_while_deleting_fails(root: str, refs: str) -> None:
    faulty = FaultyStorage(root, Fault("delete_tree"))
    job = make_job(TABLES, root, seed=1, data_seed=2, policy="full", keep_last=1, storage=faulty)
    for step in (2, 4):
        job.train(2)
        job.ckpt.save(step)
        job.ckpt.wait()  # committed: retention's failure is no failure of the save
        save_reference(job, refs, step)
    job.ckpt.close()


@pytest.mark.dist
def test_a_checkpoint_whose_retention_fails_after_its_commit_is_saved_and_restores(
    root: str, refs: Path
) -> None:
    run_ranks(2, _save_while_deleting_fails, root, str(refs))
    assert Manifest.load(root).steps() == [4], "the manifest forgot step 2 before its files went"
    assert len(open_storage(root).children()) == 2, "step 2's files stay: deleting them failed"
    assert cnr(["verify", root]) == 0
    run_ranks(2, _restores, root, str(refs), 4)
