"""The default question of :mod:`benchmarks.overhead`: the throughput lost to a checkpoint
every K steps (the interval at the warm-up's step time), at each of ``--intervals`` seconds.

In ``--rounds`` interleaved rounds every arm trains the same n x K steps: ``none``, and
{eager, lazy} x {fp32, 4-bit} (intermittent, the manager built before the timer, the last
``wait()`` timed). Lost: against ``none`` in the same round, and from the arm's steps that
overlap no checkpoint. ``--merge`` carries a result of another world size into this one's.
"""

from __future__ import annotations

import datetime
import math
import os
import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from benchmarks import results
from benchmarks.harness import Bench, Outcome
from benchmarks.measure import GB, QUANTS, StepLoop, from_rank0, gathered, rmtree, timed
from benchmarks.overhead import LOSS_BOUND, interval_key, pct, split_steps, warm_trainer
from benchmarks.results import Goal, Table
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.config import Staging
from torchrec_cnr.offline import list_checkpoints

STAGINGS: tuple[Staging, ...] = ("eager", "lazy")
"""eager: save() copies the selected rows before it returns; lazy (copy-on-write): after."""
NONE = "none"
STALL_BOUND = 0.004  # Check-N-Run's stall: under 0.4% of the (30-minute) interval
LOSS_ESTIMATES = {"throughput_lost": "", "lost_from_step_times": " from step times"}
"""The estimates of throughput lost: against the arm without checkpoints, from step times."""
ANCHORS: dict[str, Any] = {"check_n_run_stall_of_interval": STALL_BOUND,
                           "cpr_total_overhead": [0.0053, 0.0068]}  # fmt: skip


def _clean_step_s(took: list[float], ends: list[float],
                  windows: list[tuple[float, float]]) -> float | None:  # fmt: skip
    """The mean seconds of the steps that overlap none of ``windows`` (save to commit), the
    slowest rank's, or ``None`` (too few); the mean, in which other tenants' bursts cancel."""
    clean = split_steps(took, ends, windows)[1]
    mean = statistics.fmean(clean) if len(clean) >= max(10, len(took) // 10) else None
    every = [m for m in gathered(mean) if m is not None]
    return max(every) if len(every) == dist.get_world_size() else None


def _arm(b: Bench, trainer: StepLoop, k: int, n: int, staging: Staging | None,
         quant: str | None) -> tuple[float, dict[str, Any]]:  # fmt: skip
    """One arm of ``n * k`` steps, a checkpoint every ``k`` if ``quant``: steps/s, checkpoints."""
    trainer.align(k)
    if staging is None or quant is None:
        seconds, took = timed(lambda: trainer.train(n * k))
        return n * k / seconds, {"median_step_s": statistics.median(took)}
    root = b.scratch / f"{staging}_{quant}_{k}"
    rmtree(root)
    cfg = CheckpointConfig(str(root), policy="intermittent", interval_steps=k, on_busy="wait",
                           quantize=QUANTS[quant], staging=staging)  # fmt: skip
    ends: list[float] = []
    saves: list[float] = []

    def after(step: int) -> None:
        began = time.time()
        if ckpt.maybe_save(step):
            saves.append(began)
        ends.append(time.time())

    # The manager is built (and its staging buffers touched) before the timer starts; the
    # arm's first save is its full baseline, and wait() is timed: a commit that outlasts
    # the arm's steps counts as stall.
    with CheckpointManager(trainer.work.model, cfg) as ckpt:

        def train() -> list[float]:
            took = trainer.train(n * k, after)
            ckpt.wait()
            return took

        seconds, took = timed(train)
    infos = from_rank0(lambda: list_checkpoints(str(root)))
    rmtree(root)
    assert len(infos) == len(saves) == n, (len(infos), len(saves), n)
    clean = _clean_step_s(took, ends, [(s, i.committed_at) for s, i in zip(saves, infos)])
    detail = {
        "kind_each": [i.kind for i in infos], "stall_s_each": [i.stall_s for i in infos],
        "commit_s_each": [i.committed_at - s for s, i in zip(saves, infos)],
        "bytes_each": [i.bytes for i in infos],
        "saved_fraction_each": [i.saved_fraction for i in infos],
        # The arm's time against its steps at the pace of those away from any checkpoint.
        "lost_from_step_times": None if clean is None else 1 - n * k * clean / seconds,
    }  # fmt: skip
    return n * k / seconds, detail


def _interval(b: Bench, trainer: StepLoop, target_s: float, step_s: float) -> dict[str, Any]:
    """Every arm at one target interval, in interleaved rounds."""
    a = b.args
    k = max(2, round(target_s / step_s))
    n = max(1, math.ceil(a.arm_s / target_s))
    arms = {NONE: (None, None), **{f"{s} {q}": (s, q) for s in STAGINGS for q in QUANTS}}
    details: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}

    def run_arm(name: str) -> float:
        rate, detail = _arm(b, trainer, k, n, *arms[name])
        details[name].append(detail)
        return rate

    b.log(f"interval {target_s:g} s: K = {k} steps, {n} interval(s) per arm")
    rates = b.interleaved(a.rounds, arms, run_arm, label=f"{target_s:g} s steps/s")
    base = rates[NONE]
    none_step_s = statistics.median(d["median_step_s"] for d in details[NONE])
    interval_s = k / statistics.median(base)
    out: dict[str, Any] = {
        "target_s": target_s, "interval_steps": k, "interval_s": interval_s,
        "intervals_per_arm": n, "steps_per_arm": n * k,
        NONE: {"steps_per_s": statistics.median(base), "rounds": base, "step_s": none_step_s},
    }  # fmt: skip
    for name, (staging, quant) in arms.items():
        if staging is None or quant is None:
            continue
        lost = [1 - r / r0 for r, r0 in zip(rates[name], base)]
        ds = details[name]
        each = {f: [x for d in ds for x in d[f"{f}_each"]] for f in ("kind", "stall_s")}
        stall = statistics.median(each["stall_s"])
        by_kind = {kind: [t for t, k_ in zip(each["stall_s"], each["kind"]) if k_ == kind]
                   for kind in ("full", "delta")}  # fmt: skip
        out.setdefault(staging, {})[quant] = {
            "staging": staging, "quant": quant,
            "steps_per_s": statistics.median(rates[name]), "rounds": rates[name],
            "throughput_lost": statistics.median(lost), "throughput_lost_rounds": lost,
            "lost_from_step_times": _median_or_none(d["lost_from_step_times"] for d in ds),
            "stall_s": stall, "stall_of_interval": stall / interval_s,
            "stall_full_s": _median_or_none(by_kind["full"]),
            "stall_delta_s": _median_or_none(by_kind["delta"]),
            "commit_s": statistics.median(x for d in ds for x in d["commit_s_each"]),
            "bytes": statistics.median(x for d in ds for x in d["bytes_each"]),
            "full": len(by_kind["full"]), "deltas": len(by_kind["delta"]), "arms": ds,
        }  # fmt: skip
    return out


def _world(b: Bench) -> dict[str, Any]:
    """The measurements at this run's world size."""
    a = b.args
    load_before = os.getloadavg()
    trainer, step_s = warm_trainer(b)
    intervals = {interval_key(t): _interval(b, trainer, t, step_s) for t in a.intervals}
    return {
        "world_size": b.world, "command": b.command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "probe_step_s": step_s,
        # The machine is shared: what else ran shows in the 1-minute load average.
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "intervals": intervals,
    }  # fmt: skip


def _merged(b: Bench, model: dict[str, Any]) -> dict[str, Any]:
    """The other world sizes' measurements from ``--merge``'s result (``ValueError`` unless
    an overhead result of the same model and smoke setting at another world size)."""
    path = b.args.merge
    if path is None:
        return {}
    other = results.load(path)
    m = other["measurements"]
    worlds = {k: v for k, v in m.items() if k.startswith("ranks_")}
    if other["case"] != "overhead" or m.get("model") != model or other["smoke"] != b.args.smoke:
        raise ValueError(f"--merge {path}: not an overhead result of the same model and --smoke")
    if f"ranks_{b.world}" in worlds:
        raise ValueError(f"--merge {path}: it has {b.world} rank(s) too, as this run")
    return worlds


def _worlds(m: dict[str, Any]) -> list[str]:
    return sorted((k for k in m if k.startswith("ranks_")), key=lambda k: int(k[6:]))


def _median_or_none(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def tables(m: dict[str, Any]) -> list[Table]:
    # One row per world size x interval x staging x quantization.
    rows = [{"ranks": m[world]["world_size"], "iv": iv, **r} for world in _worlds(m)
            for iv in m[world]["intervals"].values()
            for staging in STAGINGS for r in iv.get(staging, {}).values()]  # fmt: skip
    lost = Table.of("Throughput lost and stall per checkpoint", rows, {
        "ranks": "ranks", "interval s (measured)": lambda r: r["iv"]["interval_s"],
        "staging": "staging", "checkpoint": "quant",
        "throughput lost": lambda r: pct(r["throughput_lost"]),
        "per round": lambda r: ", ".join(pct(x) for x in r["throughput_lost_rounds"]),
        "from step times": lambda r: pct(r["lost_from_step_times"]), "median stall s": "stall_s",
        "stall / interval": lambda r: pct(r["stall_of_interval"]),
        "stall s full, delta": lambda r: ", ".join(
            "–" if x is None else f"{x:.3f}" for x in (r["stall_full_s"], r["stall_delta_s"])),
        "commit s": "commit_s", "MB per ckpt": lambda r: r["bytes"] / 1e6,
        "full + deltas": lambda r: f"{r['full']} + {r['deltas']}",
    }, "Throughput lost: median over rounds of 1 - (steps/s with) / (steps/s without, same "
        "round). From step times: 1 - (steps x the mean time of the steps that overlap no "
        "checkpoint, from its save to its commit) / the arm's time, median over rounds. "
        "Stall, commit (save to commit) and MB on storage: medians over every checkpoint of "
        "the rounds, whose first in each arm is its full baseline.",
    )  # fmt: skip
    setup = [{"ranks": m[w]["world_size"], "probe": m[w]["probe_step_s"], **iv}
             for w in _worlds(m) for iv in m[w]["intervals"].values()]  # fmt: skip
    arms = Table.of("Arms: the same steps with checkpoints and without", setup, {
        "ranks": "ranks", "target interval s": "target_s", "K steps": "interval_steps",
        "measured interval s": "interval_s",
        "steps per arm": lambda r: f"{r['steps_per_arm']:,} ({r['intervals_per_arm']} x K)",
        "steps/s without": lambda r: r[NONE]["steps_per_s"],
        "rounds": lambda r: ", ".join(f"{x:.2f}" for x in r[NONE]["rounds"]),
        "spread": lambda r: pct(1 - min(r[NONE]["rounds"]) / max(r[NONE]["rounds"])),
        "warm-up ms/step (sets K)": lambda r: r["probe"] * 1e3,
    }, "Measured interval: K x the step time without checkpoints (median over rounds). "
        "Spread: 1 - slowest / fastest round without checkpoints, what the machine's other "
        "tenants alone make of the same steps.",
    )  # fmt: skip
    commands = Table.of("Runs merged into this result", [m[w] for w in _worlds(m)], {
        "ranks": "world_size", "date": "date",
        "load average before, after": lambda r: "{before:.2f}, {after:.2f}".format(
            **r["load_average_1m"]),
        "command": "command",
    })  # fmt: skip
    anchors = Table("Anchors", ["figure", "value", "note"], [
        ["Check-N-Run stall", "< 0.4% of the interval", "about 7 s per 30-minute interval"],
        ["CPR total overhead", "0.53–0.68%", "failure handling, all included (Criteo)"],
    ])  # fmt: skip
    return [lost, arms, commands, anchors]


def targets(m: dict[str, Any], headline_s: float) -> list[Goal]:
    """Per world size and format: lost <= 1% at the interval nearest ``headline_s`` (by both
    estimates); lazy's <= eager's at every interval; stall <= 0.4% of the longest interval."""
    out = []
    for world in _worlds(m):
        ivs = m[world]["intervals"]
        head = min(ivs, key=lambda k: abs(ivs[k]["interval_s"] - headline_s))
        longest = max(ivs, key=lambda k: ivs[k]["interval_s"])
        ranks = m[world]["world_size"]
        who = f"{ranks} training rank{'s' if ranks > 1 else ''}"
        near = f"the interval nearest {headline_s:g} s ({ivs[head]['interval_s']:.1f} s)"
        for staging in STAGINGS:
            for quant in QUANTS:
                at = f"{world}.intervals.{{}}.{staging}.{quant}.{{}}"
                for field, what in LOSS_ESTIMATES.items():
                    name = f"{who}, {staging} {quant}: throughput lost{what} <= 1% at {near}"
                    out.append(Goal(name, at.format(head, field), "<=", LOSS_BOUND))
                for key, iv in ivs.items() if staging == "lazy" else ():
                    for field, what in LOSS_ESTIMATES.items():
                        name = f"{who}, lazy {quant}: throughput lost{what} <= eager's at "
                        eager = f"{world}.intervals.{key}.eager.{quant}.{field}"
                        name += f"{iv['interval_s']:.1f} s"
                        out.append(Goal(name, at.format(key, field), "<=", eager))
                name = f"{who}, {staging} {quant}: stall <= 0.4% of the interval at the longest"
                name += f" ({ivs[longest]['interval_s']:.1f} s)"
                out.append(Goal(name, at.format(longest, "stall_of_interval"), "<=", STALL_BOUND))
    return out


def run(b: Bench) -> Outcome:
    """Every arm at every interval, at this run's world size, and ``--merge``'s."""
    a = b.args
    model = {"tables": a.tables, "rows": a.rows, "dim": a.dim, "batch": a.batch,
             "fp32_weights_gb": a.tables * a.rows * a.dim * 4 / GB}  # fmt: skip
    merged = _merged(b, model)  # before the run: a bad --merge fails at once
    m: dict[str, Any] = {"model": model, "stagings": list(STAGINGS), **merged,
                         f"ranks_{b.world}": _world(b), "anchors": ANCHORS}  # fmt: skip
    return Outcome(m, tables(m), targets(m, a.headline_s))
