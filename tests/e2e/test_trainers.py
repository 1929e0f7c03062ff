"""The manager inside a trainer's loop, as users run it: torchtnt's ``train()``
(``tests/e2e/tnt_job.py``) and Lightning's ``Trainer.fit`` (``tests/e2e/lightning_job.py``),
each with the library's callback, on TorchRec's ``TestSparseNN``, 2 ranks under ``torchrun
--max-restarts=1``. A job SIGKILLed right after a save returned resumes from the latest
committed step and ends bit-identical to one that never stopped: the same model trained
on the same batches by a plain loop (:func:`_uninterrupted`), which both trainers match."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from tests import REPO, TORCHRUN
from tests.docs.standins import digest
from tests.jobs import make_job
from tests.multiprocess import run_ranks
from torchrec_cnr.manifest import Manifest

STEPS = 30


class _Read:
    """A reader's state after ``position`` batches, as both jobs' readers save it."""

    def __init__(self, position: int) -> None:
        self.position = position

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}


def _uninterrupted(out: str) -> None:
    """On each rank: the jobs' model (``make_job("ebc", optimizer="exact_adagrad",
    seed=1)``) trained ``STEPS`` steps by a plain loop, no checkpoints; its state's digest
    to ``out.<rank>``."""
    job = make_job("ebc", optimizer="exact_adagrad", seed=1)
    job.train(STEPS)
    Path(f"{out}.{dist.get_rank()}").write_text(digest(job.model, job.dense_opt, _Read(STEPS)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Each rank's state after :func:`_uninterrupted`."""
    out = tmp_path_factory.mktemp("uninterrupted") / "state"
    run_ranks(2, _uninterrupted, str(out))
    return [Path(f"{out}.{rank}").read_text() for rank in range(2)]


def _run(job: str, folder: Path, name: str, *args: str) -> tuple[list[str], list[str], str]:
    """The job under torchrun: each rank's final state and resumed step, and its output."""
    out = folder / name
    script = REPO / "tests" / "e2e" / f"{job}_job.py"
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", "--max-restarts=1", str(script),
           "--root", str(folder / f"{name}-ckpt"), "--out", str(out), *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    states = [Path(f"{out}.{rank}").read_text() for rank in range(2)]
    resumed = [Path(f"{out}.{rank}.resumed").read_text() for rank in range(2)]
    return states, resumed, proc.stdout


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", ["tnt", "lightning"])
def test_a_trainer_with_the_callback_killed_mid_commit_resumes_bit_identical(
    job: str, tmp_path: Path, uninterrupted: list[str]
) -> None:
    killed, resumed, out = _run(job, tmp_path, "killed", "--steps", str(STEPS), "--every", "10",
                                "--kill-after", "20")  # fmt: skip
    assert "rank 1 SIGKILLed after the save of step 20" in out
    # Step 20 was committing when the rank died: the restarted job resumed from step 10.
    assert resumed == ["10", "10"]
    assert killed == uninterrupted, "the resumed job must end where one that never stopped does"
    # Every 10 steps, the last step too; what restoring the latest 2 needs is kept.
    manifest = Manifest.load(tmp_path / "killed-ckpt")
    assert manifest.steps()[-2:] == [20, 30]
    assert {e.id for e in manifest.checkpoints} == manifest.needed_ids(2)
