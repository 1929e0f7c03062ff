"""``make bench`` reproduces every recorded result: each result in benchmarks/results/ has
a line in the Makefile's bench target that runs its recorded command into
``out/bench/<its path>``."""

from __future__ import annotations

import json
import shlex

from benchmarks import bench_runs
from tests import REPO

RESULTS = REPO / "benchmarks" / "results"


def _without_out(argv: list[str]) -> tuple[list[str], str]:
    at = argv.index("--out")
    return argv[:at] + argv[at + 2 :], argv[at + 1]


def test_every_recorded_result_has_a_bench_line_running_its_recorded_command() -> None:
    lines = [_without_out(a) for a in bench_runs() if "--out" in a]
    results = sorted(RESULTS.rglob("*.json"))
    assert len(results) >= 28
    for path in results:
        recorded = json.loads(path.read_text())
        assert not recorded["smoke"], f"{path.name} is a --smoke run"
        argv, _ = _without_out(shlex.split(recorded["command"]))
        want = f"out/bench/{path.relative_to(RESULTS)}"
        assert (argv, want) in lines, (
            f"make bench does not produce {want} with {recorded['command']}"
        )


def test_the_bench_target_renders_the_docs_from_what_it_ran() -> None:
    assert bench_runs()[-1] == [
        ".venv/bin/python", "-m", "benchmarks.report", "benchmarks/results", "out/bench"
    ]  # fmt: skip
