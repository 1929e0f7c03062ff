"""One writer per root: a second job is refused until it takes over deliberately; from
then on the first may no longer commit or delete, and no committed checkpoint is ever
damaged while both write, on every storage backend."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import REPO
from tests.distributed.other_job import TABLES
from tests.faults import Fault, FaultyStorage
from tests.jobs import make_job, restores_exactly, save_reference
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointError
from torchrec_cnr.cli import main as cnr
from torchrec_cnr.manifest import Manifest


def _same_process_takes_over(root: str) -> None:
    first = make_job(TABLES, root, seed=1, data_seed=3)
    first.train(2)
    first.ckpt.save(2)
    first.ckpt.wait()
    # A second manager in the same process (a job that rebuilt its model) takes over.
    second = make_job(TABLES, root, seed=2, data_seed=3, keep_last=1, policy="full")
    assert second.ckpt.restore() == 2
    second.train(2)
    second.ckpt.save(4)
    second.ckpt.wait()
    first.train(4)
    first.ckpt.save(6)
    with pytest.raises(
        CheckpointError,
        match=r"was taken over: generation 2 \(.*\) writes it now, so this job's generation 1 may not commit",
    ):
        first.ckpt.wait()
    second.ckpt.close()
    first.ckpt.close()


@pytest.mark.dist
def test_a_newer_manager_takes_over_and_the_older_may_no_longer_commit(every_root: str) -> None:
    run_ranks(2, _same_process_takes_over, every_root)
    assert Manifest.load(every_root).steps() == [4], "keep_last=1 of the newer writer"
    assert cnr(["verify", every_root]) == 0


def _write_fails_after_take_over(root: str) -> None:
    # The job that takes a root over removes what older writers left uncommitted: the older
    # job's write in flight then fails (here: injected), and the reason it is given is the
    # takeover, on every rank, with nothing deleted.
    faulty = FaultyStorage(root, Fault("make_durable", "step0000000006"))
    first = make_job(TABLES, root, seed=1, data_seed=3, storage=faulty)
    first.train(2)
    first.ckpt.save(2)
    first.ckpt.wait()
    second = make_job(TABLES, root, seed=2, data_seed=3)
    assert second.ckpt.restore() == 2
    second.ckpt.save(4)
    second.ckpt.wait()
    first.ckpt.save(6)
    with pytest.raises(
        CheckpointError, match=r"was taken over: generation 2 .* nothing was deleted"
    ):
        first.ckpt.wait()
    second.ckpt.close()
    first.ckpt.close()


@pytest.mark.dist
def test_a_write_failing_after_a_take_over_names_the_take_over(tmp_path: Path) -> None:
    run_ranks(2, _write_fails_after_take_over, str(tmp_path / "ckpt"))
    assert Manifest.load(str(tmp_path / "ckpt")).steps() == [2, 4]


def _refused_while_held(root: str, holder_pid: int) -> None:
    job = make_job(TABLES, seed=2, data_seed=3)
    # Refused as the manager is built, before the job trains a step, on every rank alike.
    with pytest.raises(
        CheckpointError,
        match=rf"held by another live job, generation 1 \(host .*, pid {holder_pid}, started .*\).*take_over=True",
    ):
        job.attach(root)
    # A job that only reads it (an evaluation) restores while the other writes.
    job.attach(root, read_only=True)
    assert job.ckpt.restore() is not None
    with pytest.raises(CheckpointError, match="read_only=True"):
        job.ckpt.save(1000)
    job.ckpt.close()


def _takes_over_and_saves(root: str, refs: str) -> None:
    job = make_job(TABLES, root, seed=2, data_seed=3, take_over=True)
    start = job.ckpt.restore()
    assert start is not None
    for step in range(start + 1, start + 6):
        job.train(1)
        job.ckpt.save(step)
        job.ckpt.wait()
        save_reference(job, refs, step)
        time.sleep(0.1)  # the other job keeps trying meanwhile
    job.ckpt.close()


@pytest.mark.dist
def test_a_second_live_job_is_refused_until_it_takes_over_and_nothing_committed_is_damaged(
    every_root: str, refs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    control = tmp_path / "control"
    control.mkdir()
    other = subprocess.Popen(
        [sys.executable, "-m", "tests.distributed.other_job", every_root, str(control)],
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        deadline = time.monotonic() + 120
        while not (control / "ready").exists():
            assert other.poll() is None, "the other job died"
            assert time.monotonic() < deadline, "the other job never committed"
            time.sleep(0.1)
        # The CLI's compaction goes through the same fence: refused, naming the holder.
        assert cnr(["compact", every_root]) == 2
        assert re.search(
            rf"held by another live job, generation 1 \(host .*, pid {other.pid}, "
            r"started .*\).*cnr compact --take-over",
            capsys.readouterr().err,
        )
        run_ranks(2, _refused_while_held, every_root, other.pid)
        run_ranks(2, _takes_over_and_saves, every_root, str(refs))
        time.sleep(1)  # a few more attempts of the other job after the takeover
        (control / "stop").write_text("")
        assert other.wait(timeout=120) == 0
    finally:
        if other.poll() is None:
            other.kill()
    saves = (control / "saves").read_text().splitlines()
    refused = [i for i, line in enumerate(saves) if "refused" in line]
    assert refused, f"the other job was never refused: {saves[-3:]}"
    assert all("refused" in line for line in saves[refused[0] :]), "refused once, refused always"
    assert "was taken over: generation 2" in saves[refused[0]]
    # Every committed checkpoint is intact, and the new writer's all restore exactly.
    assert cnr(["verify", every_root]) == 0
    ours = sorted(int(p.stem.split("-")[1]) for p in refs.glob("ref-*-0.pt"))
    assert len(ours) == 5 and Manifest.load(every_root).steps()[-5:] == ours
    for step in (ours[0], ours[-1]):
        run_ranks(2, restores_exactly, TABLES, every_root, str(refs), step, seed=7, data_seed=3)
