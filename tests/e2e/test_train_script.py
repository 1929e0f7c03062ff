"""scripts/train.py under a real torchrun, and its config handling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cnr_train import config_file
from cnr_train.config import JobConfig
from tests import REPO, TORCHRUN
from torchrec_cnr.manifest import Manifest


def run_app(*overrides: str, restarts: int = 0) -> subprocess.CompletedProcess[str]:
    """``scripts/train.py`` on ``configs/demo.yaml`` with ``overrides``, under torchrun on
    2 ranks (``--max-restarts=restarts``)."""
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc_per_node=2",
        f"--max-restarts={restarts}",
        "scripts/train.py",
        "--config",
        "configs/demo.yaml",
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)


SMALL = (
    "model.max_rows=2000",
    "model.dim=16",
    "train.steps=60",
    "checkpoint.interval_steps=20",
    "checkpoint.quantize.method=none",
    "eval.batches=4",
    "failure.steps=[]",
    "train.figure_path=null",
)


@pytest.mark.dist
def test_quantized_demo_restores_the_quantizer_round_trip_and_draws_the_bytes(
    tmp_path: Path,
) -> None:
    figure = tmp_path / "bytes.png"
    proc = run_app(
        f"checkpoint.path={tmp_path / 'ckpt'}",
        *(o for o in SMALL if not o.startswith(("checkpoint.quantize", "train.figure"))),
        f"train.figure_path={figure}",
        f"train.metrics_path={tmp_path / 'm.json'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rows stored as adaptive 2-bit" in proc.stdout, proc.stdout
    assert "every row as stored (the quantizer's round trip of the live row), state bit-exact" in (
        proc.stdout
    )
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["restore_checked"] and not metrics["restore_exact"]
    assert metrics["written_reduction"] > 1 and metrics["stored_reduction"] > 1
    assert figure.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.dist
def test_auto_interval_records_cpr_decision_and_saves_at_that_interval(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    proc = run_app(
        f"checkpoint.path={root}",
        *SMALL,
        "train.steps=80",
        "checkpoint.interval_steps=auto",
        "checkpoint.recovery.probe_step=10",
        "checkpoint.recovery.mtbf_s=4.0",
        "checkpoint.recovery.pls_target=0.05",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "interval auto:" in proc.stderr
    entries = Manifest.load(root).checkpoints
    assert entries[0].step == 10
    decision = entries[-1].interval_decision
    assert decision is not None
    assert decision.mode in ("partial", "full")
    assert decision.interval_s == pytest.approx(
        decision.partial_interval_s if decision.mode == "partial" else decision.full_interval_s
    )
    every = decision.interval_steps
    # Due at every multiple of the interval after the probe's step (one below 10 is past),
    # and the last step, which the app saves off the interval too.
    due = [step for step in range(every, 81, every) if step > 10]
    due += [] if due and due[-1] == 80 else [80]
    assert [e.step for e in entries[1:]] == due


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
        JobConfig,
        REPO / "configs/demo.yaml",
        ["checkpoint.policy=consecutive", "train.steps=7", "checkpoint.timeouts.lease_ttl_s=30"],
    )
    assert cfg.checkpoint.policy == "consecutive" and cfg.train.steps == 7
    assert cfg.checkpoint.timeouts.lease_ttl_s == 30.0
    assert cfg.sharding.types[1] == "column_wise" and cfg.failure.steps == [230]


def test_config_keys_that_moved_still_read_with_a_deprecation_warning() -> None:
    moved = ["serve.swap=false", "serve.memory_budget_mb=8", "checkpoint.io.object_kb=128"]
    with pytest.warns(DeprecationWarning) as said:
        cfg = config_file.load(JobConfig, REPO / "configs/demo.yaml", moved)
    assert cfg.serve.follower.swap is False and cfg.serve.follower.memory_budget_mb == 8
    assert cfg.checkpoint.io.object_mb == 0.125
    text = " ".join(str(w.message) for w in said)
    assert "write serve.follower.swap" in text and "write serve.follower.memory_budget_mb" in text
    assert "object_kb" in text
    with pytest.raises(config_file.ConfigError, match="both set"), pytest.warns(DeprecationWarning):
        config_file.load(JobConfig, None, ["serve.swap=true", "serve.follower.swap=false"])


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_builds_a_job_config(path: Path) -> None:
    cfg = config_file.load(JobConfig, path)
    assert cfg.checkpoint.path and cfg.train.steps >= 1


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.steps=many", "train.steps must be int"),
        ("checkpoint.policy=weekly", "policy must be one of"),
        ("model.max_rows=0", "model.max_rows must be >= 1"),
        ("data.nope=1", "data.nope"),
        ("train", "must look like key.path=value"),
        ("data.eval_path=/x", "eval_path needs path"),
        ("checkpoint.timeouts.lease_ttl_s=0", "checkpoint.timeouts.lease_ttl_s must be > 0"),
        ("checkpoint.io.lease_ttl_s=30", "checkpoint.io.lease_ttl_s"),
        ("checkpoint.io.threads=0", "checkpoint.io.threads must be a positive int"),
        ("checkpoint.io.object_mb=0", "checkpoint.io.object_mb must be at least"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last must be"),
    ],
)
def test_invalid_config_values_raise_config_error_naming_the_key(
    override: str, needle: str
) -> None:
    with pytest.raises(config_file.ConfigError, match=needle.replace(".", r"\.")):
        config_file.load(JobConfig, REPO / "configs/demo.yaml", [override])


def test_real_data_needs_the_26_criteo_tables() -> None:
    with pytest.raises(config_file.ConfigError, match="data.path needs model.tables: criteo"):
        config_file.load(
            JobConfig, REPO / "configs/demo.yaml", ["model.tables=uniform", "data.path=/x.txt"]
        )


def test_the_app_imports_with_collections_off_then_on_its_modules_frozen() -> None:
    # What the imports made is frozen, not walked by the collections that would run while
    # it is made; collections are on again afterwards (a process left without them would
    # never free a reference cycle).
    code = "import gc, cnr_train.cli; print(gc.isenabled(), gc.get_freeze_count())"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    enabled, frozen = got.stdout.split()
    assert enabled == "True" and int(frozen) > 100_000, got.stdout
