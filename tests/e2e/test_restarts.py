"""Restarts as users run them: ``torchrun --max-restarts``, a rank SIGKILLed right after a
``save()`` returned (while that checkpoint commits in the background), and the restarted
job ends bit for bit where a job that never failed ends. For the README's quick start as
written (TorchRec's ``TestSparseNN``, the library's launcher) and for the app."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests import TORCHRUN
from tests.docs.markdown import blocks
from tests.docs.runner import runs
from tests.docs.standins import Env
from tests.e2e.test_train_script import SMALL, run_app
from torchrec_cnr.manifest import Manifest


def _quick_start(folder: Path, kill_after: int) -> tuple[list[str], list[str]]:
    """The README's quick start as ``train.py`` under the README's torchrun command, rank 1
    SIGKILLed after the save of step ``kill_after``: each rank's state when the job ends,
    and when its first attempt had trained to ``kill_after`` uninterrupted."""
    run = next(r for r in runs(blocks("README.md")) if r.name == "quickstart")
    folder.mkdir()
    (folder / "train.py").write_text(run.script(Env(tmp=str(folder), out=str(folder / "state"))))
    env = dict(os.environ, OMP_NUM_THREADS="1", DOCS_TEST_STEPS="300")
    env["DOCS_TEST_KILL_AFTER"] = str(kill_after)
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", "--max-restarts=3", "train.py"]
    proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"rank 1 SIGKILLed after the save of step {kill_after}" in proc.stdout
    ended, uninterrupted = (
        [(folder / f"state.{rank}{suffix}").read_text() for rank in range(2)]
        for suffix in ("", ".uninterrupted")
    )
    return ended, uninterrupted


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_the_quick_start_killed_mid_commit_resumes_and_ends_bit_identical(tmp_path: Path) -> None:
    # The quick start ends restored to step 200. The killed job's first attempt trained to
    # step 200 and saved it; rank 1 died while that save committed.
    ended, uninterrupted = _quick_start(tmp_path / "killed", 200)
    assert ended == uninterrupted, "the restarted job must end where the uninterrupted one was"
    # The killed attempt never committed step 200: the restarted attempt (a newer writer
    # generation) resumed from step 100 and wrote it again.
    entries = {
        e.step: e.id for e in Manifest.load(tmp_path / "killed" / "ckpt" / "run1").checkpoints
    }
    assert sorted(entries) == [100, 200, 300]
    assert entries[100].endswith("-g0001") and entries[200].endswith("-g0002")


def clean_run(folder: Path, *overrides: str) -> dict[str, Any]:
    """Runs the app uninterrupted (checkpoints every 20 steps) on the root ``folder/a``;
    returns its metrics and stdout."""
    clean = run_app(
        f"checkpoint.path={folder / 'a'}", *overrides, f"train.metrics_path={folder / 'a.json'}"
    )
    assert clean.returncode == 0, clean.stderr[-3000:]
    metrics = json.loads((folder / "a.json").read_text())
    assert metrics["resumed_from"] == 0
    return {**metrics, "stdout": clean.stdout}


def assert_failed_run_matches(tmp_path: Path, clean: dict[str, Any], *overrides: str) -> None:
    """Runs the app with rank 1 SIGKILLed right after the save of step 40 returned
    (checkpoints every 20 steps), under ``torchrun --max-restarts=1``, on the root
    ``tmp_path/b``.

    Asserts that step 40 never committed (the restarted job resumed from step 20) and that
    it ends in the state of the uninterrupted run ``clean`` (:func:`clean_run`), bit for bit.
    """
    failed = run_app(
        f"checkpoint.path={tmp_path / 'b'}",
        *overrides,
        "failure.steps=[40]",
        f"train.metrics_path={tmp_path / 'b.json'}",
        restarts=1,
    )
    assert failed.returncode == 0, failed.stderr[-3000:]
    assert "injected failure after step 40, while its checkpoint commits: SIGKILL" in failed.stdout
    assert "resumed from step 20 (restart 1)" in failed.stdout, "step 40 must not have committed"
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["resumed_from"] == 20 and clean["resumed_from"] == 0
    assert clean["digest"] == b["digest"], "the resumed run must end in the same state, bit for bit"
    assert clean["auc"] == b["auc"] and clean["logloss"] == b["logloss"]


@pytest.fixture(scope="module")
def clean_app(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The demo's configuration, shrunk (:data:`SMALL`), run uninterrupted for the test
    below that compares a killed run with it: its folder (its root is ``a``), and its
    metrics and stdout. The test only reads its root. (The job in torchtitan's option
    names is killed on a Criteo file: ``tests/e2e/test_criteo_data.py``.)"""
    folder = tmp_path_factory.mktemp("clean_app")
    return folder, clean_run(folder, *SMALL)


@pytest.mark.dist
@pytest.mark.timeout(600)  # three jobs under torchrun, clean_app's among them
def test_the_app_trains_restores_bit_exact_and_killed_mid_commit_resumes_bit_identical(
    tmp_path: Path, clean_app: tuple[Path, dict[str, Any]]
) -> None:
    """The demo's configuration, shrunk: the uninterrupted run checkpoints and restores
    its last checkpoint bit-exact into a fresh model, the killed one resumes bit-identical,
    and the root goes on in a later run."""
    folder, clean = clean_app
    assert_failed_run_matches(tmp_path, clean, *SMALL)
    assert "restore check: step 60 into a fresh model: bit-exact" in clean["stdout"]
    assert 0.5 < clean["auc"] <= 1 and clean["logloss"] > 0
    assert "x |" in clean["stdout"] and "one full fp32 checkpoint is" in clean["stdout"]
    manifest = Manifest.load(folder / "a")
    assert manifest.steps() == [20, 40, 60]
    assert [e.kind for e in manifest.checkpoints][0] == "full"

    # A later run resumes from the committed step 60 and goes on to 80: on the killed
    # run's root (the clean one is shared), which holds 20, 40 and 60 as well.
    root = tmp_path / "b"
    assert Manifest.load(root).steps() == [20, 40, 60]
    proc = run_app(f"checkpoint.path={root}", *SMALL, "train.steps=80", "train.clean_start=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 60" in proc.stdout
    assert Manifest.load(root).steps() == [20, 40, 60, 80]
