"""Every recorded result's run, as data, and the runner that makes them all again:

    .venv/bin/python -m benchmarks.runs                 # what make bench runs (hours)
    .venv/bin/python -m benchmarks.runs --list          # the commands, one a line

:data:`RUNS` holds one :class:`Run` per result in ``benchmarks/results/``, in the order
they run; the runner starts each with its launcher (torchrun on ``--nproc`` ranks, torchrun
on one rank, or one process), ``OMP_NUM_THREADS=1``, its output under ``out/bench/``, and
stops at the first that fails. Last it renders the docs from what it ran
(:data:`REPORT`). ``make bench`` calls it. A command the runner prints is the one a result
records (:func:`benchmarks.harness.command_line`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Launcher = Literal["torchrun", "torchrun1", "python"]

OUT = "out/bench"  # where the results go, relative to the repository
BIN = ".venv/bin"  # the virtual environment's scripts, as a printed command names them


@dataclass(frozen=True)
class Run:
    """One benchmark or experiment run: ``launcher -m benchmarks.<module> args --out out``."""

    module: str
    """The module under ``benchmarks`` (``experiments.cpr`` for an experiment)."""
    launcher: Launcher
    """``torchrun`` on ``--nproc`` ranks, ``torchrun1`` on one rank, or ``python`` (one
    process that starts what it needs)."""
    out: str
    """The result file, relative to the output folder (``experiments/cpr.json``)."""
    args: str = ""
    """The arguments before ``--out``, as typed in a shell."""

    def argv(self, nproc: int = 2, out: str = OUT) -> list[str]:
        """The command, as printed: ``OMP_NUM_THREADS=1``, then the launcher's words."""
        launcher = {
            "torchrun": [f"{BIN}/torchrun", "--standalone", f"--nproc_per_node={nproc}"],
            "torchrun1": [f"{BIN}/torchrun", "--standalone", "--nproc_per_node=1"],
            "python": [f"{BIN}/python"],
        }[self.launcher]
        args = shlex.split(self.args)
        return ["OMP_NUM_THREADS=1", *launcher, "-m", f"benchmarks.{self.module}", *args,
                "--out", f"{out}/{self.out}"]  # fmt: skip


RUNS: tuple[Run, ...] = (
    Run("policies", "torchrun", "policies.json"),
    Run("tracking", "torchrun", "tracking.json", "--rounds 30"),
    Run("quantization", "python", "quantization.json"),
    Run("quantization", "python", "quantization_vs_greedy.json", "--vs-greedy"),
    Run("checkpoint", "torchrun", "checkpoint.json",
        "--policies full intermittent --repeats 1 --restore-repeats 1 --rounds 5"),
    Run("checkpoint", "torchrun1", "checkpoint_1rank.json",
        "--policies full --repeats 1 --restore-repeats 1 --rounds 3"),
    Run("stall", "torchrun", "stall.json"),
    Run("stall", "torchrun", "stall_1gb.json", "--rows 500000 --repeats 5"),
    Run("stall", "torchrun", "stall_4gb.json", "--rows 2000000 --repeats 5"),
    Run("stall", "torchrun", "stall_8gb.json", "--rows 4000000 --repeats 5"),
    Run("scaling", "torchrun", "scaling.json"),
    Run("storage", "torchrun", "storage.json"),
    Run("history", "torchrun", "history.json", "--policies intermittent"),
    Run("history", "torchrun", "history_consecutive.json", "--policies consecutive"),
    Run("shards", "python", "shards.json"),
    Run("offline", "torchrun", "offline.json"),
    Run("dcp_interop", "torchrun", "dcp_interop.json", "--rounds 5"),
    Run("dcp_stager", "torchrun", "dcp_stager.json"),
    Run("serving", "python", "serving.json"),
    Run("serving", "python", "serving_5s.json", "--interval-steps 30 --steps 300 --modes copy"),
    Run("serving", "python", "serving_fresh.json",
        "--tables 8 --interval-steps 6 --steps 120 --policies intermittent consecutive "
        "--served fp32 int4 --modes swap"),
    Run("serving", "python", "serving_fresh_process.json",
        "--tables 8 --interval-steps 6 --steps 120 --policies consecutive --served fp32 int4 "
        "--modes swap --background process"),
    Run("serving", "python", "serving_join.json",
        "--policies consecutive --served fp32 int4 --modes copy swap --nproc 1 "
        "--interval-steps 30 --steps 600 --join-after 5"),
    Run("serving", "python", "serving_join_s3.json",
        "--storage s3 --policies consecutive --served fp32 int4 --modes copy --nproc 1 "
        "--interval-steps 30 --steps 600 --join-after 5"),
    Run("serving", "python", "serving_s3.json",
        "--storage s3 --served int4 --modes copy --steps 60"),
    Run("serving", "python", "serving_budget.json", "--modes budget --budget-mb 16"),
    Run("serving", "python", "serving_fanout_fs.json",
        "--policies consecutive --served fp32 --modes copy --followers 1 4 --nproc 1 "
        "--interval-steps 48 --steps 1200 --requests-per-s 1 --storage fs"),
    Run("serving", "python", "serving_fanout_s3.json",
        "--policies consecutive --served fp32 --modes copy --followers 1 4 --nproc 1 "
        "--interval-steps 48 --steps 1200 --requests-per-s 1 --storage s3"),
    Run("overhead", "torchrun1", "overhead_paired_1rank.json", "--paired --intervals 5 10 30"),
    Run("overhead", "torchrun", "overhead_paired_2rank.json", "--paired --intervals 5 10 30"),
    Run("overhead", "torchrun1", "save_cost.json", "--save-cost --saves 16"),
    Run("overhead", "torchrun1", "overhead_gil.json", "--gil --gil-s 60"),
    Run("overhead", "torchrun1", "overhead_floor_1rank.json",
        "--floor --tables 8 --rows 1000000 --intervals 2 5 10 --pair-s 60 --per-stretch 3 "
        "--compact-every 10 --policy consecutive"),
    Run("overhead", "torchrun", "overhead_floor_2rank.json",
        "--floor --tables 8 --rows 1000000 --intervals 2 --pair-s 60 --per-stretch 3 "
        "--compact-every 10 --policy consecutive"),
    Run("overhead", "torchrun1", "overhead_floor_process_1rank.json",
        "--floor --tables 8 --rows 1000000 --intervals 2 5 10 --pair-s 60 --per-stretch 3 "
        "--compact-every 10 --policy consecutive --background process"),
    Run("overhead", "torchrun", "overhead_floor_process_2rank.json",
        "--floor --tables 8 --rows 1000000 --intervals 2 --pair-s 60 --per-stretch 3 "
        "--compact-every 10 --policy consecutive --background process"),
    Run("experiments.quantized_restores", "torchrun", "experiments/quantized_restores.json"),
    Run("policies", "torchrun", "experiments/policy_bytes.json", "--figure"),
    Run("experiments.cpr", "torchrun", "experiments/cpr.json"),
)  # fmt: skip

REPORT = (f"{BIN}/python", "-m", "benchmarks.report", "benchmarks/results", "{out}")
"""The last command: docs/benchmarks.md, docs/experiments.md and the README's figures,
rendered from the recorded results with what this run wrote replacing them."""


def commands(nproc: int = 2, out: str = OUT) -> list[list[str]]:
    """Every command the runner runs, in order, the report's last."""
    return [*(r.argv(nproc, out) for r in RUNS), [a.replace("{out}", out) for a in REPORT]]


def _executable(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """A printed command as ``(environment, argv)`` to run: its leading ``NAME=value``
    words set, and ``.venv/bin/x`` this Python's ``x`` (the one that runs the runner)."""
    env = dict(os.environ)
    while "=" in argv[0]:
        name, _, value = argv[0].partition("=")
        env[name], argv = value, argv[1:]
    program = argv[0]
    if program.startswith(f"{BIN}/"):
        program = str(Path(sys.executable).with_name(program.removeprefix(f"{BIN}/")))
    return env, [program, *argv[1:]]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.runs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--nproc", type=int, default=2, help="ranks of the torchrun runs")
    p.add_argument("--out", default=OUT, help="where the results go")
    p.add_argument("--list", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    for command in commands(args.nproc, args.out.rstrip("/")):
        line = shlex.join(command)
        if args.list:
            print(line)
            continue
        print(line, file=sys.stderr, flush=True)
        env, run = _executable(command)
        done = subprocess.run(run, env=env)
        if done.returncode != 0:
            print(f"failed (exit {done.returncode}): {line}", file=sys.stderr)
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
