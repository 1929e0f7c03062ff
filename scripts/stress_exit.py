"""Every job exits 0: two jobs run many times while other processes load every core.

    python scripts/stress_exit.py --runs 50 --out out/stress_exit.json

The jobs (each under ``torchrun --standalone --nproc_per_node=2``):

- ``overhead``: the overhead benchmark's smoke run (``-m benchmarks.overhead --smoke``);
- ``save_restore``: the demo DLRM at 2,000 rows a table, each run restoring the root the
  run before it left and saving twice more (``scripts/train.py``).

A run counts as an abort when the process died of a signal or printed ``terminate
called``; every other non-zero exit counts as a failure. Not part of ``make test``: 50
runs of both take about an hour on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node=2"]


def _load(stop: mp.synchronize.Event) -> None:
    while not stop.is_set():  # a busy core, at the jobs' priority
        sum(i * i for i in range(10_000))


def _command(job: str, run: int, scratch: Path) -> list[str]:
    if job == "overhead":
        out = scratch / f"overhead_{run}.json"
        return [*TORCHRUN, "-m", "benchmarks.overhead", "--smoke", "--out", str(out),
                "--scratch", str(scratch / f"overhead_{run}")]  # fmt: skip
    return [*TORCHRUN, "scripts/train.py", "--config", "configs/demo.yaml",
            f"checkpoint.path={scratch / 'root'}", "model.max_rows=2000", "failure.steps=[]",
            f"train.steps={40 * (run + 1)}", "train.clean_start=false", "train.metrics_path=null",
            "train.figure_path=null", "eval.batches=2"]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--jobs", nargs="+", default=["overhead", "save_restore"])
    parser.add_argument("--loaders", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    stop = mp.Event()
    loaders = [mp.Process(target=_load, args=(stop,), daemon=True) for _ in range(args.loaders)]
    for p in loaders:
        p.start()
    counts: dict[str, dict[str, int]] = {}
    failures: list[dict[str, object]] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for job in args.jobs:
                scratch = Path(tmp) / job
                scratch.mkdir()
                tally = counts.setdefault(job, {"runs": 0, "exit_0": 0, "aborts": 0, "failed": 0})
                for run in range(args.runs):
                    began = time.perf_counter()
                    proc = subprocess.run(_command(job, run, scratch), cwd=REPO, env=env,
                                          capture_output=True, text=True, timeout=900)  # fmt: skip
                    text = proc.stdout + proc.stderr
                    aborted = proc.returncode < 0 or "terminate called" in text
                    tally["runs"] += 1
                    tally["exit_0"] += proc.returncode == 0
                    tally["aborts"] += aborted
                    tally["failed"] += proc.returncode != 0 and not aborted
                    if proc.returncode != 0 or aborted:
                        failures.append({"job": job, "run": run, "rc": proc.returncode,
                                         "tail": text[-3000:]})  # fmt: skip
                    print(f"{job} {run + 1}/{args.runs}: exit {proc.returncode}"
                          f"{' ABORT' if aborted else ''} ({time.perf_counter() - began:.0f} s)",
                          flush=True)  # fmt: skip
    finally:
        stop.set()
        for p in loaders:
            p.join()
    result = {"command": " ".join(sys.argv), "loaders": args.loaders, "counts": counts,
              "failures": failures}  # fmt: skip
    print(json.dumps(counts, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
