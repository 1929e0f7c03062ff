"""Stock ``dcp.async_save`` of a TorchRec model with the library's stager, as a user's
``train.py`` runs it under torchrun (``tests/e2e/dcp_stager_job.py``): both of DCP's
executors, ShardedTensors and DTensors; the job trains on at once, and stock ``dcp.load``
gives back the state of the call bit for bit, on 2 ranks and on 1; a staging failure on
one rank fails the save on every rank."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests import REPO, TORCHRUN

JOB = REPO / "tests" / "e2e" / "dcp_stager_job.py"


def _torchrun(ranks: int, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={ranks}", str(JOB), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_async_save_with_the_stager_holds_the_state_of_the_call_and_loads_at_any_world_size(
    tmp_path: Path,
) -> None:
    root, out = str(tmp_path / "dcp"), str(tmp_path / "result")
    cases = ["thread", "process-dtensor"]
    saved = _torchrun(2, "--root", root, "--cases", *cases, "fails", "--out", out)
    assert saved.returncode == 0, saved.stdout[-2000:] + saved.stderr[-4000:]
    for rank in range(2):
        result = json.loads(Path(f"{out}.{rank}").read_text())
        for case in cases:  # a copy of the dense state only: the rows are copy-on-write
            assert result[case]["copied_bytes"] < result[case]["copy_on_write_bytes"] / 5
    loaded = _torchrun(1, "--root", root, "--cases", *cases, "--check-only")
    assert loaded.returncode == 0, loaded.stdout[-2000:] + loaded.stderr[-4000:]
