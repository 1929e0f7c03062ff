"""``make bench`` reproduces every recorded result: each result in benchmarks/results/ has
a run in ``python -m benchmarks.runs`` (what the bench target calls) whose command, as
``--list`` prints it, is the result's recorded command with its output in
``out/bench/<its path>``. The runner is run as a command, as ``make bench`` runs it.
Results under ``device/`` ran on a lent GPU machine (``scripts/on_gpu.sh``), which this
machine's ``make bench`` cannot reproduce: each names its GPU instead."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

from tests import REPO

RESULTS = REPO / "benchmarks" / "results"
DEVICE = RESULTS / "device"


def _bench_runs() -> list[list[str]]:
    """The commands ``make bench`` runs, in order, as ``--list`` prints them."""
    listed = subprocess.run(
        [sys.executable, "-m", "benchmarks.runs", "--list"],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return [shlex.split(line) for line in listed.stdout.splitlines()]


def _without_out(argv: list[str]) -> tuple[list[str], str]:
    at = argv.index("--out")
    return argv[:at] + argv[at + 2 :], argv[at + 1]


def test_every_recorded_result_has_a_bench_line_running_its_recorded_command() -> None:
    lines = [_without_out(a) for a in _bench_runs() if "--out" in a]
    results = sorted(RESULTS.rglob("*.json"))
    assert len(results) >= 28
    for path in results:
        recorded = json.loads(path.read_text())
        assert not recorded["smoke"], f"{path.name} is a --smoke run"
        if path.parent == DEVICE:
            assert recorded["environment"].get("gpu"), f"{path.name} names no GPU"
            continue
        argv, _ = _without_out(shlex.split(recorded["command"]))
        want = f"out/bench/{path.relative_to(RESULTS)}"
        assert (argv, want) in lines, (
            f"make bench does not produce {want} with {recorded['command']}"
        )


def test_the_bench_target_renders_the_docs_from_what_it_ran() -> None:
    assert _bench_runs()[-1] == [
        ".venv/bin/python", "-m", "benchmarks.report", "benchmarks/results", "out/bench"
    ]  # fmt: skip


def test_the_bench_target_calls_the_runner() -> None:
    makefile = (REPO / "Makefile").read_text()
    target = makefile.split("\nbench: ", 1)[1].split("\n\n", 1)[0]
    assert "\t$(PY) -m benchmarks.runs --nproc $(NPROC) --out $(BENCH)" in target.splitlines()
