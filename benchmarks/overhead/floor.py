"""``--floor`` of :mod:`benchmarks.overhead`: a checkpoint every few seconds on large tables,
its cost to training beside a memcpy of the same bytes (the floor where training shares the
memory bandwidth).

At each of ``--intervals``, fp32 and 4-bit checkpoints of ``--policy`` (lazy staging,
``--background``, ``--compact-every``): pairs of stretches with and without ``--per-stretch``
checkpoints an interval apart (:func:`benchmarks.overhead.paired.checkpoint_pairs`), then
with and without a thread copying the fp32 checkpoints' median bytes as often; the floor
is the copy's own time. With several checkpoints a stretch, the first of each (which holds
two intervals' rows) is left out. Targets at the interval nearest 2 s: lost <= 1%, a
checkpoint costs <= 2x the floor.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import torch

from benchmarks.harness import Bench, Outcome
from benchmarks.measure import QUANTS, StepLoop, max_over_ranks, timed
from benchmarks.overhead import LOSS_BOUND, interval_key, now, pct, warm_trainer
from benchmarks.overhead.paired import alternating, checkpoint_pairs, spread, step_costs
from benchmarks.results import Goal, Table
from torchrec_cnr import CheckpointConfig

FLOOR_FACTOR = 2.0  # the target: a checkpoint costs training at most this many memcpys of its rows


def _copy_stretch(trainer: StepLoop, buffers: tuple[torch.Tensor, torch.Tensor] | None, steps: int,
                  k: int) -> dict[str, Any]:  # fmt: skip
    """``steps`` steps, a thread copying ``buffers`` (source, destination) started in the
    middle of every ``k`` if given: the slowest rank's seconds, and each copy's cost to
    training (:func:`step_costs`) and own seconds."""
    spans: list[list[float]] = []  # each copy's start and end, on now()'s clock
    stalls: list[float] = []
    ends: list[float] = []
    copiers: list[threading.Thread] = []

    def copy(span: list[float]) -> None:
        assert buffers is not None
        buffers[1].copy_(buffers[0])
        span.append(now())

    def after(step: int) -> None:
        if buffers is not None and len(ends) % k == k // 2:
            for t in copiers:  # one copy at a time, as one checkpoint at a time
                t.join()
            began = time.perf_counter()
            spans.append([now()])
            copiers.append(threading.Thread(target=copy, args=(spans[-1],), name="floor-memcpy"))
            copiers[-1].start()
            stalls.append(time.perf_counter() - began)  # the call's own time, a stall
        ends.append(now())

    def train() -> list[float]:
        took = trainer.train(steps, after)
        for t in copiers:
            t.join()
        return took

    seconds, took = timed(train)
    out: dict[str, Any] = {"seconds": seconds}
    if spans:
        windows = [(a, b) for a, b in spans]
        out["costs_s"] = max_over_ranks(*step_costs(took, ends, windows, stalls))
        out["copies_s"] = max_over_ranks(*(b - a for a, b in windows))
    return out


def _floor_pairs(b: Bench, trainer: StepLoop, nbytes: int, steps: int, k: int,
                 n: int) -> dict[str, Any]:  # fmt: skip
    """``n`` pairs of stretches with and without the copies, their order alternating. Its
    buffers are touched first: a fresh destination would time page faults, not a copy."""
    buffers = (torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8))
    got = alternating(b, n, lambda w: _copy_stretch(trainer, buffers if w else None, steps, k))
    losses = [loss for loss, _ in got]
    costs = [c for _, copying in got for c in copying["costs_s"] if c == c]  # NaN: no pace
    copies = [c for _, copying in got for c in copying["copies_s"]]
    return {"cost_s": statistics.median(costs) if costs else None, "cost_each_s": costs,
            "resolution_s": spread(costs), "copy_s": statistics.median(copies),
            "loss": statistics.median(losses), "resolution": spread(losses)}  # fmt: skip


def run(b: Bench) -> Outcome:
    """Each interval and format: a checkpoint's cost and its floor's."""
    a = b.args
    trainer, step_s = warm_trainer(b)
    intervals: dict[str, dict[str, Any]] = {}
    m_each = a.per_stretch
    for target in a.intervals:
        k = max(2, round(target / step_s))
        n = max(3, round(a.pair_s / (2 * target * m_each)))
        arms: dict[str, Any] = {}
        for quant in QUANTS:
            cfg = CheckpointConfig(path=str(b.scratch / f"floor_{quant}"), policy=a.policy,
                                   interval_steps=k, quantize=QUANTS[quant], staging="lazy",
                                   keep_last=2 * m_each + 2, background=a.background,
                                   compact_every=a.compact_every)  # fmt: skip
            # With several checkpoints a stretch, each holds one interval's rows but the
            # first (it also holds those of the stretch before): its cost is left out.
            r = checkpoint_pairs(b, trainer, cfg, m_each * k, k, n, skip=min(1, m_each - 1))
            cost = statistics.median(r["cost_each_s"]) if r["cost_each_s"] else None
            arms[quant] = {"cost_s": cost, "loss": None if cost is None else cost / (k * step_s),
                           "mb": statistics.median(r["mb_each"]),
                           "fraction": statistics.median(r["fraction_each"]),
                           "stall_s": r["stall_s"], "stall_max_s": r["stall_max_s"],
                           "checkpoints": len(r["cost_each_s"]),
                           "compactions": r["compactions"], "pair_loss": r["loss"],
                           "pair_resolution": r["resolution"],
                           "hook_s": statistics.median(r["hook_each_s"] or [0.0])}  # fmt: skip
        nbytes = round(arms["fp32"]["mb"] * 1e6)
        floor = _floor_pairs(b, trainer, nbytes, m_each * k, k, n)
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
         "per_stretch": m_each, "compact_every": a.compact_every,
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
    cadence = m.get("per_stretch", 1)
    how = (f", {cadence} checkpoints a stretch" if cadence > 1 else "") + (
        f", compact_every={m['compact_every']}" if m.get("compact_every") else "")  # fmt: skip
    return Table.of(
        f"A checkpoint's cost to training beside a memcpy of its bytes ({m['world_size']} "
        f"training rank(s), {mdl['tables']} x {mdl['rows']:,} x {mdl['dim']} fp32 tables, "
        f"{m['policy']}, lazy staging{how})", rows,
        {"interval s": "interval_s", "checkpoint": "quant",
         "rows stored": lambda r: pct(r["fraction"]), "MB": "mb",
         "cost ms (median)": lambda r: _ms(r["cost_s"]), "lost": lambda r: pct(r["loss"]),
         "memcpy MB": "memcpy_mb", "memcpy cost ms": lambda r: _ms(r["memcpy_cost_s"]),
         "± (95%)": lambda r: _ms(r["memcpy_spread_s"]),
         "memcpy ms (floor)": lambda r: _ms(r["memcpy_s"]), "cost / floor": "over_floor",
         "stall ms (median)": lambda r: r["stall_s"] * 1e3,
         "(worst)": lambda r: r["stall_max_s"] * 1e3 if "stall_max_s" in r else None,
         "copy-on-write ms": lambda r: r["hook_s"] * 1e3,
         "lost, pair times": lambda r: pct(r.get("pair_loss")),
         "± (95%), pair times": lambda r: pct(r.get("pair_resolution")),
         "compactions": "compactions", "checkpoints": "checkpoints",
         "pairs": "pairs"},
        "Cost: the training thread's time in the call that started the checkpoint (save) or the "
        "copy (a thread start), plus what the steps until its commit (or the copy's end) took "
        "beyond the mean of the stretch's other steps; median over pairs. Lost: that over the "
        "interval. The memcpy copies the fp32 checkpoint's median bytes on its own thread, as "
        "often as the checkpoints are taken; its cost is estimated the same way (± its 95% "
        "interval), and the floor is its own time, the most it could cost. Copy-on-write: the "
        "training thread's time copying rows before their update (median, part of the cost). "
        "Stall: the training thread's time in save() (median, worst). Pair times: 1 - (time "
        "without) / (time with), median over pairs. Compactions: landed during the run. "
        + ("A stretch holds several checkpoints one interval apart; the first of each, which "
        "also holds the rows of the stretch before, is left out."
        if cadence > 1 else "A stretch without a checkpoint puts its rows into the next "
        "delta: deltas hold two intervals' rows."),
    )  # fmt: skip


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
