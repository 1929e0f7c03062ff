"""``--floor`` of :mod:`benchmarks.overhead`: a checkpoint every few seconds on tables large
against what an interval's lookups touch, its cost to training beside that of a memcpy of
the same bytes, the floor on a machine whose memory bandwidth training shares.

At each of ``--intervals``, fp32 and 4-bit checkpoints of ``--policy`` (lazy staging,
written as ``--background`` says): pairs of stretches with and without a checkpoint
(:func:`benchmarks.overhead.paired.checkpoint_pairs`), then with and without a thread that
copies the fp32 checkpoints' median bytes once. A memcpy's cost to training is within the
noise of the estimate, so the floor is the copy's own time, the most it could cost.

Targets, at the interval nearest 2 s: lost <= 1%; a checkpoint costs <= 2x the floor.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import torch

from benchmarks.harness import Bench, Outcome
from benchmarks.measure import QUANTS, StepLoop, max_over_ranks, timed
from benchmarks.overhead.common import LOSS_BOUND, interval_key, now, pct, warm_trainer
from benchmarks.overhead.paired import alternating, checkpoint_pairs, spread, step_cost
from benchmarks.results import Goal, Table
from torchrec_cnr import CheckpointConfig

FLOOR_FACTOR = 2.0
"""The target: a checkpoint costs training at most this many memcpys of its rows."""


def _copy_stretch(
    trainer: StepLoop, buffers: tuple[torch.Tensor, torch.Tensor] | None, steps: int
) -> dict[str, Any]:
    """``steps`` steps, a thread copying ``buffers`` (source, destination) started after
    the middle one if given: the slowest rank's seconds, the copy's cost to training
    (:func:`step_cost`) and its own seconds."""
    span: list[float] = []
    ends: list[float] = []
    copier: list[threading.Thread] = []

    def copy() -> None:
        assert buffers is not None
        buffers[1].copy_(buffers[0])
        span.append(now())

    def after(step: int) -> None:
        if buffers is not None and len(ends) == steps // 2:
            began = time.perf_counter()
            span.append(now())
            copier.append(threading.Thread(target=copy, name="floor-memcpy"))
            copier[0].start()
            span.append(time.perf_counter() - began)  # the call's own time, a stall
        ends.append(now())

    def train() -> list[float]:
        took = trainer.train(steps, after)
        for t in copier:
            t.join()
        return took

    seconds, took = timed(train)
    out: dict[str, Any] = {"seconds": seconds}
    if copier:
        start, stall, end = span
        cost = step_cost(took, ends, start, end, stall)
        out["cost_s"], out["copy_s"] = max_over_ranks(cost, end - start)
    return out


def _floor_pairs(b: Bench, trainer: StepLoop, nbytes: int, steps: int, n: int) -> dict[str, Any]:
    """``n`` pairs of stretches with and without the copy, their order alternating. Its
    buffers are touched first: a fresh destination would time page faults, not a copy."""
    buffers = (torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8))
    got = alternating(b, n, lambda w: _copy_stretch(trainer, buffers if w else None, steps))
    losses = [loss for loss, _ in got]
    costs = [copying["cost_s"] for _, copying in got]
    copies = [copying["copy_s"] for _, copying in got]
    known = [c for c in costs if c == c]  # NaN: no reference pace
    return {"cost_s": statistics.median(known) if known else None, "cost_each_s": known,
            "resolution_s": spread(known), "copy_s": statistics.median(copies),
            "loss": statistics.median(losses), "resolution": spread(losses)}  # fmt: skip


def run(b: Bench) -> Outcome:
    """Each interval and format: a checkpoint's cost and its floor's."""
    a = b.args
    trainer, step_s = warm_trainer(b)
    intervals: dict[str, dict[str, Any]] = {}
    for target in a.intervals:
        k = max(2, round(target / step_s))
        n = max(3, round(a.pair_s / (2 * target)))
        arms: dict[str, Any] = {}
        for quant in QUANTS:
            cfg = CheckpointConfig(path=str(b.scratch / f"floor_{quant}"), policy=a.policy,
                                   interval_steps=k, quantize=QUANTS[quant], staging="lazy",
                                   keep_last=2, background=a.background)  # fmt: skip
            r = checkpoint_pairs(b, trainer, cfg, k, k, n)
            cost = statistics.median(r["cost_each_s"]) if r["cost_each_s"] else None
            arms[quant] = {"cost_s": cost, "loss": None if cost is None else cost / (k * step_s),
                           "mb": statistics.median(r["mb_each"]),
                           "fraction": statistics.median(r["fraction_each"]),
                           "stall_s": r["stall_s"], "checkpoints": len(r["cost_each_s"]),
                           "hook_s": statistics.median(r["hook_each_s"] or [0.0])}  # fmt: skip
        nbytes = round(arms["fp32"]["mb"] * 1e6)
        floor = _floor_pairs(b, trainer, nbytes, k, n)
        for arm in arms.values():
            known = arm["cost_s"] is not None
            arm["over_floor"] = arm["cost_s"] / floor["copy_s"] if known else None
        intervals[interval_key(target)] = {
            "target_s": target, "interval_s": k * step_s, "interval_steps": k, "pairs": n,
            "memcpy_mb": nbytes / 1e6, "memcpy": floor, **arms,
        }  # fmt: skip
        for quant, arm in arms.items():
            b.log(f"{target:g} s {quant}: {arm['fraction']:.2%} of rows, {arm['mb']:.0f} MB, "
                  f"costs {_ms(arm['cost_s'])} ms ({pct(arm['loss'])}), memcpy of "
                  f"{nbytes / 1e6:.0f} MB takes {_ms(floor['copy_s'])} ms, costs "
                  f"{_ms(floor['cost_s'])} ms")  # fmt: skip
    m = {"mode": "floor", "policy": a.policy, "background": a.background,
         "world_size": b.world, "step_s": step_s,
         "model": {"tables": a.tables, "rows": a.rows, "dim": a.dim, "batch": a.batch},
         "intervals": intervals}  # fmt: skip
    return Outcome(m, [_table(m)], _targets(m))


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.1f}"


def _table(m: dict[str, Any]) -> Table:
    rows = [
        {**iv[q], "interval_s": iv["interval_s"], "quant": q, "memcpy_mb": iv["memcpy_mb"],
         "memcpy_cost_s": iv["memcpy"]["cost_s"], "memcpy_spread_s": iv["memcpy"]["resolution_s"],
         "memcpy_s": iv["memcpy"]["copy_s"], "pairs": iv["pairs"]}
        for iv in m["intervals"].values()
        for q in QUANTS
    ]  # fmt: skip
    mdl = m["model"]
    return Table.of(
        f"A checkpoint's cost to training beside a memcpy of its bytes ({m['world_size']} "
        f"training rank(s), {mdl['tables']} x {mdl['rows']:,} x {mdl['dim']} fp32 tables, "
        f"{m['policy']}, lazy staging)",
        rows,
        {
            "interval s": "interval_s",
            "checkpoint": "quant",
            "rows stored": lambda r: pct(r["fraction"]),
            "MB": "mb",
            "cost ms (median)": lambda r: _ms(r["cost_s"]),
            "lost": lambda r: pct(r["loss"]),
            "memcpy MB": "memcpy_mb",
            "memcpy cost ms": lambda r: _ms(r["memcpy_cost_s"]),
            "± (95%)": lambda r: _ms(r["memcpy_spread_s"]),
            "memcpy ms (floor)": lambda r: _ms(r["memcpy_s"]),
            "cost / floor": "over_floor",
            "stall ms (median)": lambda r: r["stall_s"] * 1e3,
            "copy-on-write ms": lambda r: r["hook_s"] * 1e3,
            "checkpoints": "checkpoints",
            "pairs": "pairs",
        },
        "Cost: the training thread's time in the call that started the checkpoint (save) "
        "or the copy (a thread start), plus what the steps until its commit (or the copy's "
        "end) took beyond the mean of the stretch's other steps; median over pairs. Lost: "
        "that over the interval. The memcpy copies the fp32 checkpoint's median bytes once, "
        "on its own thread; its cost is estimated the same way (± its 95% interval), and "
        "the floor is its own time, the most it could cost. Copy-on-write: the training "
        "thread's time copying rows before their update (median, part of the cost). A stretch without a checkpoint puts its rows into the next "
        "delta: deltas hold two intervals' rows.",
    )


def _targets(m: dict[str, Any]) -> list[Goal]:
    ivs = m["intervals"]
    two = min(ivs, key=lambda k: abs(ivs[k]["target_s"] - 2))
    s = f"{ivs[two]['interval_s']:.1f} s"
    out = []
    for q in QUANTS:
        at = f"intervals.{two}.{q}"
        if ivs[two][q]["loss"] is not None:
            out.append(Goal(f"{q}: throughput lost <= 1% at {s}", f"{at}.loss", "<=", LOSS_BOUND))
        if ivs[two][q]["over_floor"] is not None:
            out.append(Goal(f"{q}: a checkpoint costs <= {FLOOR_FACTOR:g}x a memcpy of the "
                            f"changed rows at {s}", f"{at}.over_floor", "<=", FLOOR_FACTOR))  # fmt: skip
    return out
