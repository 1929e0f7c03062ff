"""Every benchmark and experiment of ``benchmarks/`` end to end in ``--smoke`` mode: tiny
sizes, the same code path. Each must exit 0 and write a result that parses, with
measurements and every declared target evaluated. Verdicts are not checked: timings of
tiny runs on a shared machine are noise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import CASES, EXPERIMENTS, SINGLE_PROCESS
from benchmarks.report import render, section
from benchmarks.results import load

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
RUNS = [
    *((c, f"benchmarks.{c}", ()) for c in CASES),
    ("quantization_vs_greedy", "benchmarks.quantization", ("--vs-greedy",)),
    ("save_cost", "benchmarks.overhead", ("--save-cost",)),
    ("overhead_paired", "benchmarks.overhead", ("--paired",)),
    (
        "serving_fanout",
        "benchmarks.serving",
        ("--followers", "1", "2", "--modes", "copy", "--served", "fp32"),
    ),  # fmt: skip
    ("policy_bytes", "benchmarks.policies", ("--figure",)),
    *((e, f"benchmarks.experiments.{e}", ()) for e in EXPERIMENTS),
]
PARAMS = [
    pytest.param(
        *run,
        id=run[0],
        marks=() if run[1].rsplit(".", 1)[-1] in SINGLE_PROCESS else pytest.mark.dist,
    )
    for run in RUNS
]


@pytest.mark.timeout(300)  # seconds alone; minutes on a machine that is busy
@pytest.mark.parametrize(("name", "module", "extra"), PARAMS)
def test_smoke_run_writes_a_result_with_measurements_and_evaluated_targets(
    tmp_path: Path, name: str, module: str, extra: tuple[str, ...]
) -> None:
    out = tmp_path / f"{name}.json"
    if module.rsplit(".", 1)[-1] in SINGLE_PROCESS:
        launcher = [sys.executable, "-m", module]
    else:
        launcher = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", module]
    cmd = [*launcher, *extra, "--smoke", "--out", str(out), "--scratch", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]

    result = load(out)
    assert result["smoke"] is True
    assert f"-m {module}" in result["command"] and "--smoke" in result["command"]
    assert result["environment"]["cpu_count"] and result["environment"]["versions"]["torch"]
    assert result["measurements"] and result["tables"]
    assert all(t["rows"] for t in result["tables"]), result["tables"]
    for t in result["targets"]:
        assert t["verdict"] in ("PASS", "MISS", "MIXED"), t
        assert t["measured"] is not None and t["bound"] is not None, t
    # The report renders it (smoke results are only left out of the docs by default).
    assert result["command"] in render(f"<!-- result: {name} -->", {name: result})
    assert section(result)
