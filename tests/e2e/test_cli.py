"""The ``cnr`` command as users run it, a process of its own: what it prints into a pipe
that closes early and into a log, what it counts, and the files it writes."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests import BIN
from tests.jobs import make_job
from tests.multiprocess import run_ranks
from tests.reference import latest_tables
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.manifest import Manifest


def _full_save(root: str) -> None:
    # TorchRec's TestSparseNN with a table of every layout: column-wise ones among them.
    job = make_job("ebc", optimizer="exact_adagrad", seed=1)
    with CheckpointManager(job.model, CheckpointConfig(path=root, policy="full")) as ckpt:
        job.step(1)
        ckpt.save(1)


@pytest.fixture(scope="module")
def full_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("cli") / "ckpt")
    run_ranks(2, _full_save, root)
    return root


def _cnr(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "cnr"), *args], capture_output=True, text=True, timeout=120, **kwargs
    )


@pytest.mark.dist
def test_inspect_counts_the_rows_of_the_tables_not_of_their_shards(full_root: str) -> None:
    manifest = Manifest.load(full_root)
    latest = manifest.latest()
    assert latest is not None
    entry = manifest.record(latest)
    shards = manifest.shards(entry)
    assert any(r.spec.cols < r.spec.embedding_dim for r in shards), "column-wise shards"
    every_row = sum(t.num_embeddings for t in entry.tables.values())
    out = _cnr("inspect", full_root)
    assert out.returncode == 0, out.stderr
    line = next(s for s in out.stdout.splitlines() if s.split()[:2] == ["1", "full"])
    assert int(line.split()[4]) == every_row, (line, every_row)


@pytest.mark.dist
def test_inspect_into_a_pipe_that_closes_ends_without_a_traceback(full_root: str) -> None:
    proc = subprocess.Popen(
        [str(BIN / "cnr"), "inspect", full_root],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # as `| head` does once it has its lines
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.dist
def test_export_progress_goes_to_a_log_a_line_each_and_its_files_follow_the_umask(
    full_root: str, tmp_path: Path
) -> None:
    log = tmp_path / "export.log"
    out = tmp_path / "model.safetensors"
    with log.open("w") as stderr:
        done = subprocess.run(
            [str(BIN / "cnr"), "export", full_root, "--out", str(out), "--format", "safetensors"],
            stderr=stderr, stdout=subprocess.PIPE, text=True, timeout=120,
            preexec_fn=lambda: os.umask(0o022),
        )  # fmt: skip
    assert done.returncode == 0, log.read_text()
    lines = [s for s in log.read_text().splitlines() if "export:" in s]
    tables = len(latest_tables(full_root))
    assert len(lines) == tables, lines
    assert all(re.fullmatch(r"export: \d+/\d+ tables \(\S+\)", s) for s in lines), lines
    assert out.stat().st_mode & 0o777 == 0o644
    torch_out = tmp_path / "model.pt"
    assert _cnr("export", full_root, "--out", str(torch_out)).returncode == 0
    assert torch_out.stat().st_mode & 0o777 == out.stat().st_mode & 0o777
