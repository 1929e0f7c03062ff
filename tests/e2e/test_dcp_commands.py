"""The DCP commands under a real torchrun: ``cnr export --format dcp`` writes the same
checkpoint from two ranks in parallel as from one process, and ``cnr-train import-dcp``
starts a root from it, from which the job resumes and trains on bit-identically."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.e2e.test_train_script import SMALL, _train
from torchrec_cnr import export_state_dict, read_optimizer_state
from torchrec_cnr.commit import Manifest

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _run(*cmd: str, ranks: int = 1) -> subprocess.CompletedProcess[str]:
    if ranks > 1:
        cmd = (str(TORCHRUN), "--standalone", f"--nproc_per_node={ranks}", "-m", *cmd)
    else:
        cmd = (sys.executable, "-m", *cmd)
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=280)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


@pytest.mark.dist
def test_export_in_parallel_then_import_and_resume_bit_identically(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    proc = _train(f"checkpoint.path={a}", *SMALL, "train.steps=40")
    assert proc.returncode == 0, proc.stderr[-3000:]

    parallel, single = tmp_path / "dcp2", tmp_path / "dcp1"
    proc = _run("torchrec_cnr.cli", "export", str(a), "--out", str(parallel), "--format", "dcp",
                "--budget-mb", "1", ranks=2)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 wrote" in proc.stdout and "rank 1 wrote" in proc.stdout
    assert "rank 1 wrote 0 blocks" not in proc.stdout  # both ranks wrote their share
    assert "dcp export:" in proc.stderr  # progress
    proc = _run("torchrec_cnr.cli", "export", str(a), "--out", str(single), "--format", "dcp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _run("torchrec_cnr.cli", "export", str(a), "--out", str(single), "--format", "dcp")
    assert proc.returncode == 2 and "overwrite" in proc.stderr
    for d in (parallel, single):
        dcp_to_torch_save(d, tmp_path / f"{d.name}.pt")
    one = _flat(torch.load(tmp_path / "dcp1.pt", weights_only=False))
    two = _flat(torch.load(tmp_path / "dcp2.pt", weights_only=False))
    assert one.keys() == two.keys()
    for key, value in one.items():
        same = (
            torch.equal(value, two[key]) if isinstance(value, torch.Tensor) else value == two[key]
        )
        assert same, key
    for key, value in export_state_dict(a, 40).items():
        assert torch.equal(one[f"model.{key}"], value), key

    # A root started from the export resumes like the root it came from.
    proc = _run("cnr_train", "import-dcp", "--config", "configs/demo.yaml", "--from", str(parallel),
                "--step", "40", f"checkpoint.path={b}", *SMALL, ranks=2)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = Manifest.load(b).checkpoints
    assert [(e.step, e.kind) for e in entries] == [(40, "full")]
    for root in (a, b):
        proc = _train(
            f"checkpoint.path={root}", *SMALL, "train.steps=60", "train.clean_start=false"
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "resumed from step 40" in proc.stdout
    want, got = export_state_dict(a, 60), export_state_dict(b, 60)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    for table in ("cat_0", "cat_9"):
        sa, sb = read_optimizer_state(a, table, 60), read_optimizer_state(b, table, 60)
        assert all(torch.equal(sa[k], sb[k]) for k in sa if sa[k].dim()), table
