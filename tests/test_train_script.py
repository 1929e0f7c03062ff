"""scripts/train.py under a real torchrun, and its config handling."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_cnr import config_file
from torchrec_cnr.job import JobConfig
from torchrec_cnr.manifest import Manifest

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _train(*overrides: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc_per_node=2",
        "scripts/train.py",
        "--config",
        "configs/demo.yaml",
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)


@pytest.mark.dist
def test_demo_config_trains_checkpoints_and_restores_bit_exact_under_torchrun(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    proc = _train(f"checkpoint.path={root}", "train.steps=60", "checkpoint.interval_steps=20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restore check: step 60 into a fresh model: bit-exact" in proc.stdout
    manifest = Manifest.load(root)
    assert manifest.steps() == [20, 40, 60]
    assert [e["kind"] for e in manifest.checkpoints][0] == "full"

    # A second run resumes from the committed step 60 and goes on to 80.
    proc = _train(
        f"checkpoint.path={root}",
        "train.steps=80",
        "checkpoint.interval_steps=20",
        "train.clean_start=false",
        "train.resume=true",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 60" in proc.stdout
    assert Manifest.load(root).steps() == [20, 40, 60, 80]


def test_unknown_config_key_stops_the_script_naming_it() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/train.py",
            "--config",
            "configs/demo.yaml",
            "checkpoint.polcy=full",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "checkpoint.polcy" in proc.stderr


def test_config_file_maps_yaml_and_overrides_onto_dataclasses() -> None:
    cfg = config_file.load(
        JobConfig, REPO / "configs/demo.yaml", ["checkpoint.policy=consecutive", "train.steps=7"]
    )
    assert cfg.checkpoint.policy == "consecutive" and cfg.train.steps == 7
    assert cfg.model.shardings[1] == "column_wise"


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.steps=many", "train.steps must be int"),
        ("checkpoint.policy=weekly", "policy must be one of"),
        ("model.rows=0", "model.rows must be >= 1"),
        ("data.nope=1", "data.nope"),
        ("train", "must look like key.path=value"),
    ],
)
def test_invalid_config_values_raise_config_error_naming_the_key(
    override: str, needle: str
) -> None:
    with pytest.raises(config_file.ConfigError, match=needle.replace(".", r"\.")):
        config_file.load(JobConfig, REPO / "configs/demo.yaml", [override])
