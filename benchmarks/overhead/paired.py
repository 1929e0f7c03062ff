"""``--paired`` of :mod:`benchmarks.overhead`: throughput lost at each interval, resolving 1%
(lazy, intermittent, fp32 and 4-bit): pairs of adjacent stretches of K steps, one with a
checkpoint in its middle, in alternating order; the median over pairs and its 95% interval.
Also saves asked for every 2 steps, ``on_busy`` "wait" and "skip". Target: fp32 at the
interval nearest 10 s loses <= 1%, resolved to ± 0.5%.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import Bench, Outcome
from benchmarks.measure import QUANTS, StepLoop, from_rank0, max_over_ranks, rmtree, timed
from benchmarks.overhead import LOSS_BOUND, interval_key, now, pct, split_steps, warm_trainer
from benchmarks.results import Goal, Table
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.config import OnBusy
from torchrec_cnr.offline import list_checkpoints

NOTCH = 1.58  # a median's 95% interval is about ± 1.58 IQR / sqrt(n) (McGill's notches)
BUSY_STEPS = 2
"""The busy arms save every 2 steps: each save asked for while the previous one commits."""


def _segment(b: Bench, trainer: StepLoop, ckpt: CheckpointManager | None, steps: int,
             k: int, skip: int = 0) -> dict[str, Any]:  # fmt: skip
    """``steps`` steps from a multiple of ``k``, ``ckpt.maybe_save`` after each if given, then
    ``wait()``: the slowest rank's seconds, the saves asked for and made, the stall of each,
    the last checkpoint, and each save's cost from the step times (:func:`step_costs`) and
    its copy-on-write time, but the first ``skip`` saves'."""
    trainer.align(k)
    stalls: list[float] = []
    ends: list[float] = []
    saved_at: list[float] = []
    steps_saved: list[int] = []
    hooks: list[float] = []  # the training thread's copy-on-write of each save
    made = 0

    def after(step: int) -> None:
        nonlocal made
        if ckpt is not None and step % k == 0:
            if saved_at:
                hooks.append(ckpt.lazy_staging.hook_s if ckpt.lazy_staging else 0.0)
            saved_at.append(now())
            steps_saved.append(step)
            began = time.perf_counter()
            made += ckpt.maybe_save(step)
            stalls.append(time.perf_counter() - began)
        ends.append(now())

    def train() -> list[float]:
        took = trainer.train(steps, after)
        if ckpt is not None:
            ckpt.wait()
        return took

    seconds, took = timed(train)
    out: dict[str, Any] = {"seconds": seconds, "asked": len(stalls), "made": made, "stalls": stalls}
    if ckpt is not None and made:
        every = from_rank0(lambda: list_checkpoints(str(ckpt.config.path)))
        saved = [c for c in every if c.compacted_from is None]
        out["compacted"] = [c.id for c in every if c.compacted_from is not None]
        last = saved[-1]
        out.update(kind=last.kind, mb=last.bytes / 1e6, fraction=last.saved_fraction)
        by_step = {c.step: c for c in saved}
        if made == len(stalls) and all(s in by_step for s in steps_saved):  # each committed
            lazy = ckpt.lazy_staging
            hooks.append(lazy.hook_s if lazy else 0.0)
            ours = [by_step[s] for s in steps_saved]
            windows = [(t, c.committed_at) for t, c in zip(saved_at, ours)]
            costs = step_costs(took, ends, windows, stalls)[skip:]
            out["costs_s"] = max_over_ranks(*costs) if costs else []
            out["hooks_s"] = max_over_ranks(*hooks[skip:]) if costs else []
            out["mb_each"] = [c.bytes / 1e6 for c in ours[skip:]]
            out["fraction_each"] = [c.saved_fraction for c in ours[skip:]]
            if made == 1:
                out["cost_s"], out["hook_s"] = out["costs_s"][0], out["hooks_s"][0]
                out["step_loss"] = out["cost_s"] / seconds
    return out


def step_costs(took: list[float], ends: list[float], windows: list[tuple[float, float]],
               stalls: list[float]) -> list[float]:  # fmt: skip
    """Each checkpoint's cost to training: its stall plus what the steps from its save to
    its commit (``windows``) took beyond the mean of the stretch's steps outside every
    window; NaN where fewer than 10 steps are outside (no reference pace)."""
    _, clean = split_steps(took, ends, windows)
    if len(clean) < 10:
        return [math.nan] * len(windows)
    pace = statistics.fmean(clean)
    return [stall + sum(inside) - pace * len(inside)
            for (inside, _), stall in ((split_steps(took, ends, [w]), st)
                                       for w, st in zip(windows, stalls))]  # fmt: skip


def spread(values: list[float]) -> float:
    """The 95% interval of the median of ``values``: ± 1.58 IQR / sqrt(n)."""
    if len(values) < 2:
        return math.nan
    q1, _, q3 = statistics.quantiles(values, n=4)
    return NOTCH * (q3 - q1) / math.sqrt(len(values))


def alternating(
    b: Bench, pairs: int, stretch: Callable[[bool], dict[str, Any]]
) -> list[tuple[float, dict[str, Any]]]:
    """``pairs`` pairs of adjacent stretches, ``stretch(True)`` (with the event) and
    ``stretch(False)``, in alternating order, each pair on a settled machine: per pair, the
    loss 1 - (time without) / (time with) and the stretch with the event."""
    out = []
    for i in range(pairs):
        b.settle()
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {w: stretch(w) for w in order}
        out.append((1 - got[False]["seconds"] / got[True]["seconds"], got[True]))
    return out


def checkpoint_pairs(b: Bench, trainer: StepLoop, cfg: CheckpointConfig, steps: int, k: int,
                     pairs: int, skip: int = 0) -> dict[str, Any]:  # fmt: skip
    """``pairs`` pairs of adjacent stretches of ``steps`` steps, with checkpoints every ``k``
    and without, in alternating order, after a baseline: the loss per pair, 1 - (time
    without) / (time with), and from step times (:func:`step_costs` over its time); the
    cost of each checkpoint but the first ``skip`` of each stretch."""
    rmtree(Path(cfg.path))
    losses, saving = [], []
    with CheckpointManager(trainer.work.model, cfg) as ckpt:
        ckpt.save(trainer.step)
        ckpt.wait()
        for loss, with_ckpt in alternating(
            b, pairs, lambda w: _segment(b, trainer, ckpt if w else None, steps, k, skip)
        ):
            losses.append(loss)
            saving.append(with_ckpt)
    rmtree(Path(cfg.path))
    stalls = [t for s in saving for t in s["stalls"]]
    stall, worst = max_over_ranks(statistics.median(stalls), max(stalls))
    known = [s for s in saving if not math.isnan(s.get("cost_s", math.nan))]
    step_losses = [s["step_loss"] for s in known]
    each = [(c, h) for s in saving for c, h in zip(s.get("costs_s", []), s.get("hooks_s", []))
            if not math.isnan(c)]  # fmt: skip
    return {
        "loss": statistics.median(losses), "loss_each": losses, "resolution": spread(losses),
        "step_loss": statistics.median(step_losses) if step_losses else None,
        "step_loss_each": step_losses,
        "step_resolution": spread(step_losses) if step_losses else None,
        "cost_each_s": [c for c, _ in each], "hook_each_s": [h for _, h in each],
        "saves_asked": sum(s["asked"] for s in saving),
        "saves_made": sum(s["made"] for s in saving),
        "compactions": len({c for s in saving for c in s.get("compacted", [])}),
        "stall_s": stall, "stall_max_s": worst, "kinds": [s.get("kind") for s in saving],
        "mb_each": [m for s in saving for m in s.get("mb_each", [s["mb"]] if "mb" in s else [])],
        "fraction_each": [f for s in saving
                          for f in s.get("fraction_each", [s["fraction"]] if "fraction" in s else [])],
    }  # fmt: skip


def run(b: Bench) -> Outcome:
    """The loss at each interval, fp32 and 4-bit, and with saves asked for too fast."""
    a = b.args
    trainer, step_s = warm_trainer(b)

    def config(name: str, k: int, quant: str, on_busy: OnBusy = "wait") -> CheckpointConfig:
        return CheckpointConfig(path=str(b.scratch / name), policy="intermittent",
                                interval_steps=k, on_busy=on_busy, quantize=QUANTS[quant],
                                staging="lazy", keep_last=2)  # fmt: skip

    intervals: dict[str, dict[str, dict[str, Any]]] = {}
    for target in a.intervals:
        k = max(2, round(target / step_s))
        pairs = max(3, round(a.pair_s / (2 * target)))
        for quant in QUANTS:
            cfg = config(f"{interval_key(target)}_{quant}", k, quant)
            r = checkpoint_pairs(b, trainer, cfg, k, k, pairs)
            r.update(target_s=target, interval_s=k * step_s, interval_steps=k, quant=quant,
                     pairs=pairs)  # fmt: skip
            intervals.setdefault(interval_key(target), {})[quant] = r
            b.log(f"{target:g} s {quant}: lost {r['loss']:.2%} ± {r['resolution']:.2%} over "
                  f"{pairs} pairs, from step times {pct(r['step_loss'])} ± "
                  f"{pct(r['step_resolution'])}, stall {r['stall_s'] * 1e3:.1f} ms")  # fmt: skip
    pooled = {}  # one checkpoint's cost, every interval's pairs together
    for quant in QUANTS:
        costs = [c for iv in intervals.values() for c in iv[quant]["cost_each_s"]]
        # None measured (a loaded machine: too few steps outside the commits): NaN, a failed target.
        cost = statistics.median(costs) if costs else math.nan
        pooled[quant] = {"cost_s": cost, "spread_s": spread(costs),
                         "checkpoints": len(costs)}  # fmt: skip
        for iv in intervals.values():
            r = iv[quant]
            r["pooled_loss"] = pooled[quant]["cost_s"] / r["interval_s"]
            r["pooled_resolution"] = pooled[quant]["spread_s"] / r["interval_s"]
        b.log(f"{quant}: a checkpoint costs {pooled[quant]['cost_s'] * 1e3:.0f} ± "
              f"{pooled[quant]['spread_s'] * 1e3:.0f} ms over {len(costs)}")  # fmt: skip
    busy = {}
    on_busy: OnBusy
    for on_busy in ("wait", "skip"):
        cfg = config(f"busy_{on_busy}", BUSY_STEPS, "fp32", on_busy)
        with warnings.catch_warnings():  # "skip" warns at each save it skips
            warnings.simplefilter("ignore", UserWarning)
            r = busy[on_busy] = checkpoint_pairs(b, trainer, cfg, a.busy_steps, BUSY_STEPS,
                                                 a.busy_pairs)  # fmt: skip
        r.update(on_busy=on_busy, interval_s=BUSY_STEPS * step_s)
        b.log(f"busy, on_busy={on_busy}: lost {r['loss']:.2%}, {r['saves_made']} of "
              f"{r['saves_asked']} saves made")  # fmt: skip
    m = {"mode": "paired",
         "model": {"tables": a.tables, "rows": a.rows, "dim": a.dim, "batch": a.batch},
         "world_size": b.world, "step_s": step_s, "intervals": intervals, "cost": pooled,
         "busy": busy}  # fmt: skip
    return Outcome(m, _paired_tables(m), _paired_targets(m))


def _paired_tables(m: dict[str, Any]) -> list[Table]:
    rows = [r for iv in m["intervals"].values() for r in iv.values()]
    lost = Table.of(
        f"Throughput lost at each interval ({m['world_size']} training rank(s), lazy staging, "
        "intermittent)", rows, {
        "interval s": "interval_s", "K steps": "interval_steps", "checkpoint": "quant",
        "lost: pooled cost / interval": lambda r: pct(r["pooled_loss"]),
        "± (95%)": lambda r: pct(r["pooled_resolution"]),
        "lost, from step times": lambda r: pct(r["step_loss"]),
        "± (95%), step times": lambda r: pct(r["step_resolution"]),
        "lost, pair times": lambda r: pct(r["loss"]),
        "± (95%), pair times": lambda r: pct(r["resolution"]), "pairs": "pairs",
        "each pair (pair times)": lambda r: ", ".join(pct(x) for x in r["loss_each"]),
        "stall ms (median)": lambda r: r["stall_s"] * 1e3,
        "full, delta": lambda r: f"{r['kinds'].count('full')}, {r['kinds'].count('delta')}",
        "MB per checkpoint": lambda r: statistics.median(r["mb_each"]),
    }, "Each pair: two adjacent stretches of K steps, one with a checkpoint in its middle "
        "(its commit waited for at the end), one without, in alternating order. A checkpoint's "
        "cost: its stall plus what the steps from its save to its commit took beyond the mean of "
        "the stretch's other steps. Pooled: the median cost of every checkpoint of every interval "
        "(of one format) over the interval. From step times: this interval's costs, each over its "
        "stretch's time, median over pairs. Pair times: 1 - (time without) / (time with), median "
        "over pairs. ±: the 95% interval of the median, 1.58 IQR / sqrt(pairs). A stretch without "
        "a checkpoint puts its changed rows into the next delta: deltas hold two intervals' rows, "
        "more than a job checkpointing every interval writes.",
    )  # fmt: skip
    busy = Table.of(
        "A save asked for while the previous one still commits (fp32, a save every "
        f"{BUSY_STEPS} steps)", list(m["busy"].values()), {
        "on_busy": "on_busy", "interval s": "interval_s",
        "saves made / asked": lambda r: f"{r['saves_made']} / {r['saves_asked']}",
        "lost": lambda r: pct(r["loss"]), "± (95%)": lambda r: pct(r["resolution"]),
        "stall ms (median)": lambda r: r["stall_s"] * 1e3,
        "stall ms (worst)": lambda r: r["stall_max_s"] * 1e3,
    }, "wait: save() waits for the previous commit (the default); skip: the save is "
        "skipped with a warning, its rows go into the next one. Neither queues nor merges "
        "two saves in flight. Stall: training blocked inside save(), its wait included.",
    )  # fmt: skip
    return [lost, busy]


def _paired_targets(m: dict[str, Any]) -> list[Goal]:
    """fp32 at the interval nearest 10 s: lost <= 1% (from the pooled cost, step times and
    pair times, where known), each estimate resolved to ± 0.5%."""
    ivs = m["intervals"]
    ten = min(ivs, key=lambda k: abs(ivs[k]["fp32"]["target_s"] - 10))
    at = f"intervals.{ten}.fp32"
    s = f"{ivs[ten]['fp32']['interval_s']:.1f} s"
    estimates = (("pooled_loss", "pooled_resolution", "from the pooled cost"),
                 ("step_loss", "step_resolution", "from step times"),
                 ("loss", "resolution", "from pair times"))  # fmt: skip
    out = []
    for field, spread, what in estimates:
        if ivs[ten]["fp32"][field] is None:
            continue  # every commit overlapped nearly every step: no reference pace
        out += [
            Goal(f"fp32: throughput lost <= 1% at {s}, {what}", f"{at}.{field}", "<=", LOSS_BOUND),
            Goal(f"fp32: the estimate {what} at {s} resolves ± 0.5%", f"{at}.{spread}", "<=",
                 0.005),
        ]  # fmt: skip
    return out
