"""``keep_last``: a root keeps exactly what restoring its last N checkpoints needs, on
every storage backend, and every checkpoint it keeps restores bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from cnr_train.workload import TableSpec
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
