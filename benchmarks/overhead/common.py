"""What the questions of :mod:`benchmarks.overhead` share: the warmed-up training loop, the
throughput target and how figures are keyed and printed."""

from __future__ import annotations

import statistics
import time

from benchmarks.harness import Bench
from benchmarks.measure import StepLoop, timed, uniform_model
from cnr_train.workload import ZipfBatches

LOSS_BOUND = 0.01
"""The throughput target: at most 1% lost at the headline interval."""


def interval_key(interval_s: float) -> str:
    """An interval's key in ``measurements``: no dot, which a target's key would split."""
    return f"{interval_s:g}s".replace(".", "_")


def warm_trainer(b: Bench) -> tuple[StepLoop, float]:
    """The model trained ``--warmup-steps``, and its seconds per step: the median of a few
    chunks, so that another tenant's burst in one chunk does not set K."""
    a = b.args
    work = uniform_model(a)
    trainer = StepLoop(work, ZipfBatches(work.tables, a.batch, seed=0), b.rank)
    trainer.train(a.warmup_steps)
    chunk = max(1, a.probe_steps // 5)
    step_s = statistics.median(timed(lambda: trainer.train(chunk))[0] / chunk for _ in range(5))
    b.log(f"{b.world} rank(s): {step_s * 1e3:.1f} ms per step")
    return trainer, step_s


def pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.2%}"


def now() -> float:
    return time.time()  # the clock of CheckpointInfo.committed_at
