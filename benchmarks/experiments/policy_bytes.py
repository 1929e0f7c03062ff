"""Check-N-Run Figs. 15 and 16: bytes written and stored per interval, per policy, plotted.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=2 \\
        -m benchmarks.experiments.policy_bytes --out out/bench/experiments/policy_bytes.json

The measurement is :mod:`benchmarks.policies`' (see it for the workload), with the same
arguments; this adds ``fig15_16.png`` and ``results.csv`` beside the JSON result, in
``out/bench/experiments/policy_bytes/``.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks import policies
from benchmarks.harness import Bench, Case, Outcome, main, pyplot, save_figure, write_csv


def _figure(b: Bench, m: dict[str, Any]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for policy, rows in m["intervals"].items():
        xs = [r["interval"] for r in rows]
        axes[0].plot(xs, [r["written_rel"] for r in rows], marker="o", label=policy)
        axes[1].plot(xs, [r["stored_rel"] for r in rows], marker="o", label=policy)
    axes[0].set_title("Fig. 15: written per interval")
    axes[1].set_title("Fig. 16: stored after each interval")
    for ax in axes:
        ax.set_xlabel("interval")
        ax.set_ylabel("x one full checkpoint")
        ax.legend()
    save_figure(fig, b.artifacts / "fig15_16.png")


def run(b: Bench) -> Outcome:
    m = policies.measure(b)
    if b.rank == 0:
        rows = [r for per in m["intervals"].values() for r in per]
        write_csv(b.artifacts / "results.csv", rows)
        _figure(b, m)
    return Outcome(m, policies.tables(m))


CASE = Case(
    name="experiments.policy_bytes",
    title="Bytes written and stored per policy, plotted (Check-N-Run Figs. 15 and 16)",
    arguments=policies.arguments,
    smoke=policies.SMOKE,
    run=run,
    kind="experiment",
)

if __name__ == "__main__":
    sys.exit(main(CASE, __doc__))
