"""Every benchmark and experiment of ``benchmarks/`` end to end in ``--smoke`` mode: tiny
sizes, the same code path. Each must succeed and write a result that parses, with
measurements and every declared target evaluated. Verdicts are not checked: timings of
tiny runs on a shared machine are noise.

Each runs its module's ``main`` on the tests' ranks (:mod:`tests.multiprocess`: gloo
ranks started by the library's launcher, as torchrun's are), 2 of them for the cases
``make bench`` runs under torchrun and 1 for the others; the harness runs a case on the
group it finds (see ``benchmarks.harness.main``), so that the suite pays for each case's
work and not for starting and importing torchrec again for each.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from benchmarks.harness import main
from benchmarks.report import render, section
from benchmarks.results import load, lookup
from benchmarks.runs import RUNS as BENCH_RUNS
from tests.multiprocess import run_ranks

_MODULES = {r.module for r in BENCH_RUNS}
CASES = sorted(m for m in _MODULES if not m.startswith("experiments."))
EXPERIMENTS = sorted(m.split(".", 1)[1] for m in _MODULES if m.startswith("experiments."))
SINGLE_PROCESS = {
    m for m in _MODULES if all(r.launcher == "python" for r in BENCH_RUNS if r.module == m)
}
RUNS = [
    *((c, f"benchmarks.{c}", ()) for c in CASES),
    ("quantization_vs_greedy", "benchmarks.quantization", ("--vs-greedy",)),
    ("save_cost", "benchmarks.overhead", ("--save-cost",)),
    ("overhead_paired", "benchmarks.overhead", ("--paired",)),
    ("overhead_gil", "benchmarks.overhead", ("--gil",)),
    ("overhead_floor", "benchmarks.overhead", ("--floor",)),
    ("overhead_floor_process", "benchmarks.overhead", ("--floor", "--background", "process")),
    (
        "serving_fanout",
        "benchmarks.serving",
        ("--followers", "1", "2", "--modes", "copy", "--served", "fp32"),
    ),  # fmt: skip
    # Followers that start once the job has committed: a job that outlasts their start.
    (
        "serving_join",
        "benchmarks.serving",
        ("--join-after", "2", "--steps", "800", "--interval-steps", "40"),
    ),  # fmt: skip
    ("policy_bytes", "benchmarks.policies", ("--figure",)),
    *((e, f"benchmarks.experiments.{e}", ()) for e in EXPERIMENTS),
]
MISSING = object()
PARAMS = [
    pytest.param(
        *run,
        id=run[0],
        marks=() if run[1].rsplit(".", 1)[-1] in SINGLE_PROCESS else pytest.mark.dist,
    )
    for run in RUNS
]


def _main(module: str, argv: list[str]) -> None:
    case = importlib.import_module(module)
    assert main(case.CASE, case.__doc__, argv) == 0


@pytest.mark.timeout(300)  # seconds alone; minutes on a machine that is busy
@pytest.mark.parametrize(("name", "module", "extra"), PARAMS)
def test_smoke_run_writes_a_result_with_measurements_and_evaluated_targets(
    tmp_path: Path, name: str, module: str, extra: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Background commits at training's priority: on a busy machine, niced ones can starve
    # until no step of a tiny arm is left outside a commit to measure the arm against.
    monkeypatch.setenv("TORCHREC_CNR_NICE", "0")
    out = tmp_path / f"{name}.json"
    ranks = 1 if module.rsplit(".", 1)[-1] in SINGLE_PROCESS else 2
    argv = [*extra, "--smoke", "--out", str(out), "--scratch", str(tmp_path)]
    run_ranks(ranks, _main, module, argv)

    result = load(out)
    assert result["smoke"] is True
    assert f"-m {module}" in result["command"] and "--smoke" in result["command"]
    assert result["environment"]["cpu_count"] and result["environment"]["versions"]["torch"]
    assert result["measurements"] and result["tables"]
    assert all(t["rows"] for t in result["tables"]), result["tables"]
    for t in result["targets"]:
        # Every key a target names was recorded; a value may be None where the benchmark
        # could not estimate it this run (a tiny arm whose every step overlapped a commit
        # on a busy machine has no clean steps to pace it by), and its verdict is n/a.
        keys = [t["measured_key"], *([t["reference"]] if isinstance(t["reference"], str) else [])]
        for key in keys:
            assert lookup(result["measurements"], key, MISSING) is not MISSING, (key, t)
        if t["verdict"] == "n/a":
            assert None in (t["measured"], t["reference_value"]), t
            continue
        assert t["verdict"] in ("PASS", "MISS", "MIXED"), t
        assert t["measured"] is not None and t["bound"] is not None, t
    # The report renders it (smoke results are only left out of the docs by default).
    assert result["command"] in render(f"<!-- result: {name} -->", {name: result})
    assert section(result)
