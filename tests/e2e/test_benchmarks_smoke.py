"""Every benchmark and experiment of ``benchmarks/`` end to end in ``--smoke`` mode: tiny
sizes, the same code path. Each must succeed and write a result that parses, with
measurements and every declared target evaluated, that ``python -m benchmarks.report``
renders. Verdicts are not checked: timings of tiny runs on a shared machine are noise.

The benchmarks are checked from outside, as a user runs them: the cases are those ``python
-m benchmarks.runs --list`` prints (what ``make bench`` runs), each runs as ``python -m
benchmarks.<name> --smoke ...`` would (its module run as ``__main__`` with those
arguments), and the test reads the files it writes. Each runs on the tests' ranks
(:mod:`tests.multiprocess`: gloo ranks started by the library's launcher, as torchrun's
are), 2 of them for the cases ``make bench`` runs under torchrun and 1 for the others; the
harness runs a case on the group it finds, so that the suite pays for each case's work and
not for starting and importing torchrec again for each.
"""

from __future__ import annotations

import json
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO
from tests.multiprocess import run_ranks


def _bench_modules() -> dict[str, bool]:
    """Each module ``make bench`` runs (less ``benchmarks.``) -> whether it runs in one
    process (``python -m``) in every run, from ``python -m benchmarks.runs --list``."""
    listed = subprocess.run(
        [sys.executable, "-m", "benchmarks.runs", "--list"],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    found: dict[str, bool] = {}
    for line in listed.stdout.splitlines():
        argv = shlex.split(line)
        at = argv.index("-m")
        module = argv[at + 1].removeprefix("benchmarks.")
        if module != "report":
            alone = not any(a.endswith("torchrun") for a in argv[:at])
            found[module] = found.get(module, True) and alone
    return found


_MODULES = _bench_modules()
CASES = sorted(m for m in _MODULES if not m.startswith("experiments."))
EXPERIMENTS = sorted(m.split(".", 1)[1] for m in _MODULES if m.startswith("experiments."))
SINGLE_PROCESS = {m for m, alone in _MODULES.items() if alone}
"""Cases run by ``python -m`` in one process (serving, shards...); the others by torchrun."""

CASE_EXTRA = {"checkpoint": ("--policies", "full", "intermittent"), "overhead": ("--paired",)}
"""Arguments a case's smoke run adds, as its recorded runs do (``benchmarks.runs --list``):
the checkpoint case's two policies (each policy is the same code path, and the four of
``measure.POLICIES`` took two minutes on two busy cores); the overhead case's question (one
flag of four, each run below)."""

RUNS = [
    *((c, f"benchmarks.{c}", CASE_EXTRA.get(c, ())) for c in CASES),
    ("quantization_vs_greedy", "benchmarks.quantization", ("--vs-greedy",)),
    ("save_cost", "benchmarks.overhead", ("--save-cost",)),
    ("overhead_gil", "benchmarks.overhead", ("--gil",)),
    # One interval, as the recorded 2-rank floor runs: each interval builds a manager per
    # format, which with a writer process starts a process (and imports torchrec) per rank.
    ("overhead_floor", "benchmarks.overhead", ("--floor", "--intervals", "0.3")),
    (
        "overhead_floor_process",
        "benchmarks.overhead",
        ("--floor", "--intervals", "0.3", "--background", "process"),
    ),  # fmt: skip
    # One training rank, as the recorded fanout runs: the followers are the subject
    # (``serving`` trains on two).
    (
        "serving_fanout",
        "benchmarks.serving",
        ("--followers", "1", "2", "--modes", "copy", "--served", "fp32", "--nproc", "1"),
    ),  # fmt: skip
    # Followers that start once the job has committed: a job that outlasts their start.
    # Copy mode: joining is the same code path in each (``serving``'s smoke runs swap mode).
    # Two training ranks: one alone ends its 800 steps before followers that start on a
    # busy machine serve an update after their first (the run then fails).
    (
        "serving_join",
        "benchmarks.serving",
        ("--join-after", "2", "--steps", "800", "--interval-steps", "40", "--modes", "copy"),
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


def _run_module(module: str, argv: list[str]) -> None:
    """``python -m module *argv`` on this rank: the module run as ``__main__`` with those
    arguments; it must exit 0."""
    saved = sys.argv
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as ended:
        assert ended.code in (0, None), f"python -m {module} exited {ended.code}"
    finally:
        sys.argv = saved


def _report(folder: Path, template: str) -> str:
    """``template`` as ``python -m benchmarks.report`` renders it from the results in
    ``folder``, smoke runs included."""
    path = folder.parent / "template.md"
    path.write_text(template)
    command = [sys.executable, "-m", "benchmarks.report", str(folder), "--allow-smoke",
               "--render", str(path)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


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
    run_ranks(ranks, _run_module, module, argv)

    result = json.loads(out.read_text())
    assert result["format_version"] == 1
    assert result["smoke"] is True
    assert f"-m {module}" in result["command"] and "--smoke" in result["command"]
    assert result["environment"]["cpu_count"] and result["environment"]["versions"]["torch"]
    assert result["measurements"] and result["tables"]
    assert all(t["rows"] for t in result["tables"]), result["tables"]
    for t in result["targets"]:
        # Every key a target names was recorded (the harness refuses to write a result
        # otherwise); a value may be None where the benchmark could not estimate it this
        # run (a tiny arm whose every step overlapped a commit on a busy machine has no
        # clean steps to pace it by), and its verdict is n/a.
        if t["verdict"] == "n/a":
            assert None in (t["measured"], t["reference_value"]), t
            continue
        assert t["verdict"] in ("PASS", "MISS", "MIXED"), t
        assert t["measured"] is not None and t["bound"] is not None, t
    # The report renders it (smoke results are only left out of the docs by default).
    alone = tmp_path / "report" / f"{name}.json"
    alone.parent.mkdir()
    alone.write_bytes(out.read_bytes())
    section = _report(alone.parent, f"<!-- result: {name} -->\n")
    assert result["command"] in section and "Environment:" in section
