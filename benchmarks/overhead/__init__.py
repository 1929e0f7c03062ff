"""End-to-end overhead: the training throughput that checkpointing costs, asked four ways of
one training job (the DLRM of :mod:`cnr_train.workload`, Zipf ids, the tracker on in
every arm), fp32 or 4-bit checkpoints, on 1 training rank (a core free for the writer) or 2.
One flag picks the question:

- ``--save-cost``: one full checkpoint's cost, measured alone many times (:mod:`.save_cost`).
- ``--paired``: the loss at each interval, resolving 1% (:mod:`.paired`).
- ``--gil``: which threads hold the GIL while commits run back to back (:mod:`.gil`).
- ``--floor``: a checkpoint every few seconds against a memcpy of its bytes (:mod:`.floor`).
"""

from __future__ import annotations

import statistics
import time

from benchmarks.harness import Bench
from benchmarks.measure import StepLoop, timed

LOSS_BOUND = 0.01  # the throughput target: at most 1% lost at the headline interval


def interval_key(interval_s: float) -> str:
    """An interval's key in ``measurements``: no dot, which a target's key would split."""
    return f"{interval_s:g}s".replace(".", "_")


def warm_trainer(b: Bench) -> tuple[StepLoop, float]:
    """The model trained ``--warmup-steps``, and its seconds per step (median of 5 chunks)."""
    a = b.args
    trainer = StepLoop.warm(a, a.batch, a.warmup_steps)
    chunk = max(1, a.probe_steps // 5)
    step_s = statistics.median(timed(lambda: trainer.train(chunk))[0] / chunk for _ in range(5))
    b.log(f"{b.world} rank(s): {step_s * 1e3:.1f} ms per step")
    return trainer, step_s


def split_steps(took: list[float], ends: list[float],
                windows: list[tuple[float, float]]) -> tuple[list[float], list[float]]:  # fmt: skip
    """The seconds of the steps (each's seconds and end, on :func:`now`'s clock) that
    overlap one of ``windows`` (spans from a save to its commit), and of the others."""
    inside: list[float] = []
    clean: list[float] = []
    for t, e in zip(took, ends):
        (inside if any(e >= lo and e - t <= hi for lo, hi in windows) else clean).append(t)
    return inside, clean


def pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.2%}"


def now() -> float:
    return time.time()  # the clock of CheckpointInfo.committed_at
