"""What a lent GPU machine runs, tried on CPU so that it is known to work before GPU time
is spent on it: ``scripts/gpu_check.py``, the full-stack check (its cases with ``--device
cpu``), and ``benchmarks.gpu``, the stall, cadence and peers (``--smoke``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_check_passes_on_cpu_and_records_what_it_ran(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    cases = ["base", "optimizer=exact_sgd", "policy=consecutive", "staging=eager", "bits=4"]
    cmd = [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--no-pytest",
           "--rows", "3000", "--batch", "256", "--out", str(out), "--cases", *cases,
           "--result", str(tmp_path / "result.json")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["ok"] and record["device"] == "cpu" and record["pytest"] is None
    assert {"torch", "torchrec", "fbgemm_gpu"} <= record["versions"].keys()
    ran = {r["name"]: r for r in record["cases"]}
    assert list(ran) == [*cases, "follower (fp32, FloatTarget)", "dcp.async_save + DcpStager"]
    for name in cases:
        assert ran[name]["problems"] == [] and ran[name]["checkpoints"] == [2, 4, 6, 8, 10, 12]
    # The same, as a result docs/benchmarks.md renders: a row per case, the targets judged.
    result = json.loads((tmp_path / "result.json").read_text())
    assert [row[0] for row in result["tables"][0]["rows"]] == list(ran)
    assert [t["verdict"] for t in result["targets"]] == ["PASS", "n/a"]  # the tests did not run


def test_the_gpu_benchmark_runs_on_cpu_and_judges_every_target(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--smoke", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    m = result["measurements"]
    assert m["device"] == "cpu" and [r["fraction"] for r in m["stall"]] == [0.05, 1.0]
    assert all(r["save_s"] > 0 and r["floor_s"] > 0 for r in m["stall"])
    assert m["cadence"]["1s"]["plain_steps_per_s"] > 0
    assert isinstance(m["peers"]["torchrec_cnr save()"], float)
    # Every peer is a time or the failure it met; each target has a verdict of its figures.
    assert all(isinstance(v, float) or v.startswith("fails: ") for v in m["peers"].values())
    assert len(result["targets"]) == 4
    assert all(t["verdict"] in ("PASS", "MISS", "MIXED") for t in result["targets"])
