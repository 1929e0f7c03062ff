"""End-to-end overhead: the training throughput that checkpointing every K steps costs.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=1 \\
        -m benchmarks.overhead --out out/bench/overhead_1rank.json
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=2 \\
        -m benchmarks.overhead --merge out/bench/overhead_1rank.json --out out/bench/overhead.json
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=1 \\
        -m benchmarks.overhead --save-cost --saves 16 --out out/bench/save_cost.json

The first run trains on 1 rank (the other core free for the background writer, as on a GPU
host), the second on 2 ranks (no core to spare); ``--merge`` carries the first run's
measurements into the second's result, so that one JSON holds both, each with its command.

The model is the DLRM of :mod:`cnr_train.workload`: 8 table-wise tables x 200,000 rows x
dim 64 (410 MB of fp32 weights, row-wise Adagrad), batch 512 per rank, Zipf ids; each
step draws its batch on the training thread (``ZipfBatches.batch``), as an input pipeline
without workers would.

For each target interval (``--intervals``, seconds of training), ``interval_steps`` K is
set so that K steps last about that long at the step time a warm-up measured (the median
of five chunks of ``--probe-steps / 5``); the interval reported is the one measured, K x
the step time without checkpoints. Then, in ``--rounds`` interleaved rounds (the arms take
turns, the order rotating, each from a settled disk), every arm trains the same number of
steps, n x K with n = ``max(1, ceil(--arm-s / interval))``:

- ``none``: no checkpoint manager;
- one arm per staging mode x quantization: {``eager`` (``save()`` copies the selected rows
  before it returns), ``lazy`` (copy-on-write: they are copied after it returns)} x {fp32,
  4-bit adaptive with ``min_rows=0``}, the intermittent policy, ``maybe_save`` every K
  steps.

A checkpointing arm builds a fresh manager on a fresh root before its timer starts (its
staging buffers are touched then). Its timed steps hold n saves, one in the middle of each
interval, so that each save's background commit runs within the arm: the first is the
chain's full baseline, the others what the intermittent rule takes (deltas of every row
changed since the baseline, or a new baseline). The arm ends with ``wait()``, timed: a
commit that outlasts the steps counts as stall. Every arm thus pays one full checkpoint
per n intervals, as a job's first n intervals do; at the long intervals (n = 1), a full
checkpoint per interval: more work than the intermittent policy does in a long run, where
baselines are rarer. The tracker runs in every arm, ``none`` included: what is measured is
checkpointing; tracking's cost is :mod:`benchmarks.tracking`'s.

Throughput lost = 1 - (steps/s with checkpoints) / (steps/s without), per round against
the ``none`` arm of the same round, then the median over rounds. Steps/s are the slowest
rank's.

Also per arm: the median stall per checkpoint (``CheckpointInfo.stall_s``, the slowest
rank's; full and delta apart too) as a fraction of the interval (K x the ``none`` arm's
step time), the median commit latency (save to commit), and a second estimate of the loss,
from per-step times within the arm, which drift between arms cannot reach: 1 - (steps x
the mean time of the steps that overlap no checkpoint, from its save to its commit) / the
arm's time.

Targets (for each measured world size and quantization): throughput lost <= 1% at the
measured interval nearest to ``--headline-s`` (30 s), from the arms and from step times;
median stall <= 0.4% of the interval at the longest measured interval (Check-N-Run's
anchor: about 7 s of a 30-minute interval); lazy staging's throughput lost <= eager's at
every measured interval, by both estimates. CPR's anchor, 0.53-0.68% total overhead of
failure handling, is recorded beside them.

``--save-cost``: the training time one checkpoint costs, from its save to its commit,
measured alone many times (the arms above move with the machine's other tenants by more
than a checkpoint costs). the model and training of
:mod:`benchmarks.overhead` (8 x 200,000 x 64 tables, batch 512, Zipf ids) train
``--before`` steps, then a full fp32 checkpoint is saved, and training goes on for
``--after`` steps (past the commit); 4-bit is adaptive with ``min_rows=0``, as there. The
checkpoint costs training its stall plus what
the steps overlapping it, from the save to the commit, took beyond the mean of the steps
around them that overlap none. The arms take turns, ``--saves`` times each, on a fresh
root each time:

- eager: ``save()`` copies every row before it returns (fp32, 4-bit);
- lazy: copy-on-write, rows claimed with atomic bits by the compiled copier
  (``staging/_cow.c``), the default (fp32, 4-bit);
- lazy with ``IOOptions(compiled_staging=False)``: torch copies the rows under each
  kernel's lock, in chunks, the path CUDA takes (fp32).

Targets: the median cost of a lazy checkpoint <= an eager one's (fp32 and 4-bit), and a
lazy fp32 one's <= one copied by torch under the lock.

``--paired``: the curve of throughput lost over the interval, with an estimate that
resolves 1%, for lazy staging (the default), the intermittent policy, fp32 and 4-bit:

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=1 \
        -m benchmarks.overhead --paired --intervals 5 10 30 --out out/bench/overhead_paired_1rank.json

Arms run minutes apart move with the machine's other tenants by more than 1% (the arms
above: the no-checkpoint arm's rounds spread up to 10%). Here each measurement is a pair
of adjacent stretches of K steps, one with a checkpoint in its middle and its commit
waited for at its end, one without, in alternating order; a pair's loss is 1 - (time
without) / (time with), and the figure is the median over pairs (``--pair-s`` seconds of
pairs per interval and format, at least 3), with its 95% interval (1.58 IQR / sqrt(n)).
The manager saves its baseline before the first pair; skipped stretches put their rows
into the next delta, so deltas are larger than at a checkpoint every interval.

Also: saves asked for faster than they commit (every 2 steps, fp32), with ``on_busy``
"wait" (the default: ``save()`` waits for the previous commit) and "skip" (the save is
skipped, its rows go into the next): saves made, the loss, and the stall.

Targets: fp32 at the interval nearest 10 s loses <= 1%, resolved to ± 0.5%.

``--gil``: which threads hold the GIL while the model trains and commits continuously (a
save every step, skipped while the previous one commits: ``on_busy="skip"``), the
intermittent policy, fp32 and 4-bit: ``py-spy record --gil --threads`` samples each rank's
own process for ``--gil-s`` seconds per format. Per thread (the training thread, the
background writer ``cnr-writer``, the I/O threads ``cnr-io``, the others), its share of
the samples that hold the GIL; also the commits made and the steps trained.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=1 \
        -m benchmarks.overhead --gil --out out/bench/overhead_gil.json

Target (fp32 and 4-bit): the writer's threads (``cnr-writer`` and ``cnr-io``) hold the
GIL in <= 10% of the samples.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import results
from benchmarks.harness import Bench, Case, Outcome, main
from benchmarks.measure import (
    GB,
    QUANTS,
    StepLoop,
    from_rank0,
    max_over_ranks,
    model_arguments,
    rmtree,
    timed,
    uniform_model,
)
from benchmarks.results import Goal, Table
from cnr_train.workload import ZipfBatches
from torchrec_cnr import CheckpointConfig, CheckpointManager, IOOptions, list_checkpoints
from torchrec_cnr.config import OnBusy

STAGINGS: dict[str, dict[str, Any]] = {
    "eager": {"staging": "eager"},  # save() copies the selected rows before it returns
    "lazy": {"staging": "lazy"},  # copy-on-write: the rows are copied after it returns
}
NONE = "none"
LOSS_BOUND = 0.01
"""The throughput target: at most 1% lost at the headline interval."""
STALL_BOUND = 0.004
"""Check-N-Run's stall: under 0.4% of the (30-minute) interval."""
LOSS_ESTIMATES = {"throughput_lost": "", "lost_from_step_times": " from step times"}
"""The two estimates of throughput lost: against the arm without checkpoints, and from
the arm's own step times (which the drift between arms cannot reach)."""
ANCHORS: dict[str, Any] = {
    "check_n_run_stall_of_interval": STALL_BOUND,
    "cpr_total_overhead": [0.0053, 0.0068],
}


def _arguments(p: argparse.ArgumentParser) -> None:
    model_arguments(p, rows=200_000)
    p.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    p.add_argument(
        "--intervals",
        type=float,
        nargs="+",
        default=[2.0, 5.0, 15.0, 30.0, 60.0],
        help="target checkpoint intervals, seconds of training",
    )
    p.add_argument("--arm-s", type=float, default=10.0, help="least training time of an arm")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per interval")
    p.add_argument("--warmup-steps", type=int, default=30, help="untimed training steps first")
    p.add_argument("--probe-steps", type=int, default=100, help="timed steps that set K")
    p.add_argument(
        "--headline-s",
        type=float,
        default=30.0,
        help="the throughput target's interval (the nearest measured one)",
    )
    p.add_argument(
        "--save-cost",
        action="store_true",
        help="measure instead the training time one full checkpoint costs, --saves times "
        "per arm: eager, lazy, lazy with torch's locked copy; fp32 and 4-bit",
    )
    p.add_argument("--saves", type=int, default=8, help="--save-cost: checkpoints per arm")
    p.add_argument("--before", type=int, default=100, help="--save-cost: steps before a save")
    p.add_argument("--after", type=int, default=200, help="--save-cost: steps after it")
    p.add_argument(
        "--paired",
        action="store_true",
        help="measure instead the loss at each --intervals from adjacent stretches with "
        "and without a checkpoint (lazy staging, fp32 and 4-bit), and saves asked for "
        "faster than they commit",
    )
    p.add_argument(
        "--pair-s",
        type=float,
        default=90.0,
        help="--paired: seconds of pairs per interval and format (at least 3)",
    )
    p.add_argument("--busy-steps", type=int, default=60, help="--paired: steps per busy stretch")
    p.add_argument("--busy-pairs", type=int, default=5, help="--paired: pairs per busy arm")
    p.add_argument(
        "--gil",
        action="store_true",
        help="measure instead which threads hold the GIL while the job trains and commits "
        "continuously (py-spy record --gil --threads), fp32 and 4-bit",
    )
    p.add_argument("--gil-s", type=float, default=20.0, help="--gil: seconds sampled per format")
    p.add_argument(
        "--merge",
        type=Path,
        help="a result of this case at another world size, carried into this one's",
    )


def _key(interval_s: float) -> str:
    """An interval's key in ``measurements``: no dot, which a target's key would split."""
    return f"{interval_s:g}s".replace(".", "_")


def _clean_step_s(
    took: list[float], ends: list[float], windows: list[tuple[float, float]]
) -> float | None:
    """The mean seconds of the steps that overlap none of ``windows`` (wall-clock spans from
    a save to its commit), the slowest rank's; ``None`` where too few steps are left.

    The mean, not the median: other tenants' bursts lengthen the steps inside the windows
    as often as those outside, and only the mean lets them cancel.
    """
    clean = [
        t for t, e in zip(took, ends) if not any(e >= lo and e - t <= hi for lo, hi in windows)
    ]
    mean = statistics.fmean(clean) if len(clean) >= max(10, len(took) // 10) else None
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mean)
    return None if None in every else max(every)


def _arm(
    b: Bench, trainer: StepLoop, k: int, n: int, staging: str | None, quant: str | None
) -> tuple[float, dict[str, Any]]:
    """One arm: ``n * k`` timed steps, with a checkpoint every ``k`` if ``quant`` is set.
    Its steps/s and what its checkpoints were."""
    trainer.align(k)
    if staging is None or quant is None:
        seconds, took = timed(lambda: trainer.train(n * k))
        return n * k / seconds, {"median_step_s": statistics.median(took)}
    root = b.scratch / f"{staging}_{quant}_{k}"
    rmtree(root)
    cfg = CheckpointConfig(
        path=str(root),
        policy="intermittent",
        interval_steps=k,
        on_busy="wait",
        quantize=QUANTS[quant],
        **STAGINGS[staging],
    )
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
        "kind_each": [i.kind for i in infos],
        "stall_s_each": [i.stall_s for i in infos],
        "commit_s_each": [i.committed_at - s for s, i in zip(saves, infos)],
        "bytes_each": [i.bytes for i in infos],
        "saved_fraction_each": [i.saved_fraction for i in infos],
        # The arm's time against its steps at the pace of those away from any checkpoint.
        "lost_from_step_times": None if clean is None else 1 - n * k * clean / seconds,
    }
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
    rates = b.interleaved(
        a.rounds,
        {name: functools.partial(run_arm, name) for name in arms},
        label=f"{target_s:g} s steps/s",
    )
    base = rates[NONE]
    none_step_s = statistics.median(d["median_step_s"] for d in details[NONE])
    interval_s = k / statistics.median(base)
    out: dict[str, Any] = {
        "target_s": target_s,
        "interval_steps": k,
        "interval_s": interval_s,
        "intervals_per_arm": n,
        "steps_per_arm": n * k,
        NONE: {"steps_per_s": statistics.median(base), "rounds": base, "step_s": none_step_s},
    }
    for name, (staging, quant) in arms.items():
        if staging is None or quant is None:
            continue
        lost = [1 - r / r0 for r, r0 in zip(rates[name], base)]
        ds = details[name]
        each = {f: [x for d in ds for x in d[f"{f}_each"]] for f in ("kind", "stall_s")}
        stall = statistics.median(each["stall_s"])
        by_kind = {
            kind: [t for t, k_ in zip(each["stall_s"], each["kind"]) if k_ == kind]
            for kind in ("full", "delta")
        }
        out.setdefault(staging, {})[quant] = {
            "staging": staging,
            "quant": quant,
            "steps_per_s": statistics.median(rates[name]),
            "rounds": rates[name],
            "throughput_lost": statistics.median(lost),
            "throughput_lost_rounds": lost,
            "lost_from_step_times": _median_or_none(d["lost_from_step_times"] for d in ds),
            "stall_s": stall,
            "stall_of_interval": stall / interval_s,
            "stall_full_s": _median_or_none(by_kind["full"]),
            "stall_delta_s": _median_or_none(by_kind["delta"]),
            "commit_s": statistics.median(x for d in ds for x in d["commit_s_each"]),
            "bytes": statistics.median(x for d in ds for x in d["bytes_each"]),
            "full": len(by_kind["full"]),
            "deltas": len(by_kind["delta"]),
            "arms": ds,
        }
    return out


def _warm_trainer(b: Bench) -> tuple[StepLoop, float]:
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


def _world(b: Bench) -> dict[str, Any]:
    """The measurements at this run's world size."""
    a = b.args
    load_before = os.getloadavg()
    trainer, step_s = _warm_trainer(b)
    intervals = {_key(t): _interval(b, trainer, t, step_s) for t in a.intervals}
    return {
        "world_size": b.world,
        "command": b.command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "probe_step_s": step_s,
        # The machine is shared: what else ran shows in the 1-minute load average.
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "intervals": intervals,
    }


def _merged(b: Bench, model: dict[str, Any]) -> dict[str, Any]:
    """The other world sizes' measurements from ``--merge``'s result.

    Raises:
        ValueError: it is not this case's result, or has another model, smoke setting or
            this run's world size.
    """
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


def _arms(m: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per world size x interval x staging x quantization."""
    rows = []
    for world in _worlds(m):
        for iv in m[world]["intervals"].values():
            for staging in STAGINGS:
                for r in iv.get(staging, {}).values():
                    rows.append({"ranks": m[world]["world_size"], "iv": iv, **r})
    return rows


def _worlds(m: dict[str, Any]) -> list[str]:
    return sorted((k for k in m if k.startswith("ranks_")), key=lambda k: int(k[6:]))


def _median_or_none(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.2%}"


def tables(m: dict[str, Any]) -> list[Table]:
    rows = _arms(m)
    lost = Table.of(
        "Throughput lost and stall per checkpoint",
        rows,
        {
            "ranks": "ranks",
            "interval s (measured)": lambda r: r["iv"]["interval_s"],
            "staging": "staging",
            "checkpoint": "quant",
            "throughput lost": lambda r: _pct(r["throughput_lost"]),
            "per round": lambda r: ", ".join(_pct(x) for x in r["throughput_lost_rounds"]),
            "from step times": lambda r: _pct(r["lost_from_step_times"]),
            "median stall s": "stall_s",
            "stall / interval": lambda r: _pct(r["stall_of_interval"]),
            "stall s full, delta": lambda r: ", ".join(
                "–" if x is None else f"{x:.3f}" for x in (r["stall_full_s"], r["stall_delta_s"])
            ),
            "commit s": "commit_s",
            "MB per ckpt": lambda r: r["bytes"] / 1e6,
            "full + deltas": lambda r: f"{r['full']} + {r['deltas']}",
        },
        "Throughput lost: median over rounds of 1 - (steps/s with) / (steps/s without, same "
        "round). From step times: 1 - (steps x the mean time of the steps that overlap no "
        "checkpoint, from its save to its commit) / the arm's time, median over rounds. Stall, commit (save to commit) and MB on storage: "
        "medians over every checkpoint of the rounds, whose first in each arm is its full "
        "baseline.",
    )
    setup = [
        {"ranks": m[w]["world_size"], "probe": m[w]["probe_step_s"], **iv}
        for w in _worlds(m)
        for iv in m[w]["intervals"].values()
    ]
    arms = Table.of(
        "Arms: the same steps with checkpoints and without",
        setup,
        {
            "ranks": "ranks",
            "target interval s": "target_s",
            "K steps": "interval_steps",
            "measured interval s": "interval_s",
            "steps per arm": lambda r: f"{r['steps_per_arm']:,} ({r['intervals_per_arm']} x K)",
            "steps/s without": lambda r: r[NONE]["steps_per_s"],
            "rounds": lambda r: ", ".join(f"{x:.2f}" for x in r[NONE]["rounds"]),
            "spread": lambda r: _pct(1 - min(r[NONE]["rounds"]) / max(r[NONE]["rounds"])),
            "warm-up ms/step (sets K)": lambda r: r["probe"] * 1e3,
        },
        "Measured interval: K x the step time without checkpoints (median over rounds). "
        "Spread: 1 - slowest / fastest round without checkpoints, what the machine's other "
        "tenants alone make of the same steps.",
    )
    commands = Table.of(
        "Runs merged into this result",
        [m[w] for w in _worlds(m)],
        {
            "ranks": "world_size",
            "date": "date",
            "load average before, after": lambda r: "{before:.2f}, {after:.2f}".format(
                **r["load_average_1m"]
            ),
            "command": "command",
        },
    )
    anchors = Table(
        "Anchors",
        ["figure", "value", "note"],
        [
            ["Check-N-Run stall", "< 0.4% of the interval", "about 7 s per 30-minute interval"],
            ["CPR total overhead", "0.53–0.68%", "failure handling, all included (Criteo)"],
        ],
    )
    return [lost, arms, commands, anchors]


def targets(m: dict[str, Any], headline_s: float) -> list[Goal]:
    """Per measured world size and quantization: throughput lost <= 1% at the measured
    interval nearest ``headline_s`` (from the arms, and from step times); stall <= 0.4% of
    the interval at the longest measured interval."""
    out = []
    for world in _worlds(m):
        ivs = m[world]["intervals"]
        head = min(ivs, key=lambda k: abs(ivs[k]["interval_s"] - headline_s))
        longest = max(ivs, key=lambda k: ivs[k]["interval_s"])
        ranks = m[world]["world_size"]
        who = f"{ranks} training rank{'s' if ranks > 1 else ''}"
        for staging in STAGINGS:
            for quant in QUANTS:
                at = f"{world}.intervals.{head}.{staging}.{quant}"
                out.append(
                    Goal(
                        f"{who}, {staging} {quant}: throughput lost <= 1% at the interval "
                        f"nearest {headline_s:g} s ({ivs[head]['interval_s']:.1f} s)",
                        f"{at}.throughput_lost",
                        "<=",
                        LOSS_BOUND,
                    )
                )
                out.append(
                    Goal(
                        f"{who}, {staging} {quant}: throughput lost from step times <= 1% at "
                        f"the interval nearest {headline_s:g} s ({ivs[head]['interval_s']:.1f} s)",
                        f"{at}.lost_from_step_times",
                        "<=",
                        LOSS_BOUND,
                    )
                )
                for key, iv in ivs.items() if staging == "lazy" else ():
                    for field, what in LOSS_ESTIMATES.items():
                        out.append(
                            Goal(
                                f"{who}, lazy {quant}: throughput lost{what} <= eager's at "
                                f"{iv['interval_s']:.1f} s",
                                f"{world}.intervals.{key}.lazy.{quant}.{field}",
                                "<=",
                                f"{world}.intervals.{key}.eager.{quant}.{field}",
                            )
                        )
                at = f"{world}.intervals.{longest}.{staging}.{quant}"
                out.append(
                    Goal(
                        f"{who}, {staging} {quant}: stall <= 0.4% of the interval at the "
                        f"longest ({ivs[longest]['interval_s']:.1f} s)",
                        f"{at}.stall_of_interval",
                        "<=",
                        STALL_BOUND,
                    )
                )
    return out


# -- --save-cost: the training time of one checkpoint, many times -----------------------

COST_ARMS: dict[str, tuple[str, bool, str]] = {
    "eager_fp32": ("eager", True, "fp32"),
    "lazy_fp32": ("lazy", True, "fp32"),
    "lazy_torch_fp32": ("lazy", False, "fp32"),
    "eager_4bit": ("eager", True, "4-bit"),
    "lazy_4bit": ("lazy", True, "4-bit"),
}
"""``--save-cost`` arm -> (staging, ``IOOptions.compiled_staging``, checkpoint format)."""
STAGING_NAMES = {
    ("eager", True): "eager",
    ("lazy", True): "lazy (compiled copier)",
    ("lazy", False): "lazy, torch copy under the lock",
}


def _save_cost_once(
    b: Bench, trainer: StepLoop, staging: str, compiled: bool, quant: str, n: int
) -> dict[str, float]:
    """One checkpoint of one arm: its stall, commit and the training time it cost."""
    root = b.scratch / f"{staging}_{compiled}_{quant}_{n}"
    rmtree(root)
    cfg = CheckpointConfig(
        path=str(root),
        policy="full",
        staging=staging,  # type: ignore[arg-type]
        quantize=QUANTS[quant],
        io=IOOptions(compiled_staging=compiled),
    )
    ends: list[float] = []
    with CheckpointManager(trainer.work.model, cfg) as ckpt:
        took = trainer.train(b.args.before, lambda _: ends.append(_now()))
        dist.barrier()
        saved_at = _now()
        ckpt.save(trainer.step)
        stall = _now() - saved_at
        took += trainer.train(b.args.after, lambda _: ends.append(_now()))
        ckpt.wait()
    info = from_rank0(lambda: list_checkpoints(str(root))[-1])
    rmtree(root)
    overlaps = [e >= saved_at and e - t <= info.committed_at for t, e in zip(took, ends)]
    inside = [t for t, o in zip(took, overlaps) if o]
    clean = statistics.fmean(t for t, o in zip(took, overlaps) if not o)
    if len(inside) >= b.args.after:
        raise RuntimeError(f"the commit outlasted --after {b.args.after} steps: raise it")
    cost = stall + sum(inside) - clean * len(inside)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (cost, stall, info.committed_at - saved_at, clean))
    worst = max(every)  # the slowest rank's
    return {
        "cost_s": worst[0],
        "stall_s": worst[1],
        "commit_s": worst[2],
        "step_s": worst[3],
        "steps": len(inside),
    }


def _now() -> float:
    return time.time()  # the clock of CheckpointInfo.committed_at


def _save_costs(b: Bench) -> Outcome:
    """``--save-cost``: the training time one full checkpoint costs, per arm."""
    a = b.args
    work = uniform_model(a)
    trainer = StepLoop(work, ZipfBatches(work.tables, a.batch, seed=0), b.rank)
    trainer.train(a.warmup_steps)
    each: dict[str, list[dict[str, float]]] = {name: [] for name in COST_ARMS}
    names = list(COST_ARMS)
    for n in range(a.saves):
        for name in names[n % len(names) :] + names[: n % len(names)]:
            b.settle()
            each[name].append(_save_cost_once(b, trainer, *COST_ARMS[name], n))
        b.log(
            f"save {n + 1}/{a.saves}: "
            + ", ".join(f"{k} {v[-1]['cost_s'] * 1e3:.0f} ms" for k, v in each.items())
        )
    arms = {
        name: {
            "staging": STAGING_NAMES[COST_ARMS[name][:2]],
            "checkpoint": COST_ARMS[name][2],
            "cost_s": statistics.median(r["cost_s"] for r in rs),
            "costs_s": [r["cost_s"] for r in rs],
            "stall_s": statistics.median(r["stall_s"] for r in rs),
            "commit_s": statistics.median(r["commit_s"] for r in rs),
            "steps_overlapped": statistics.median(r["steps"] for r in rs),
        }
        for name, rs in each.items()
    }
    m = {
        "mode": "save_cost",
        "model": {"tables": a.tables, "rows": a.rows, "dim": a.dim, "batch": a.batch},
        "world_size": b.world,
        "step_s": statistics.median(r["step_s"] for rs in each.values() for r in rs),
        "arms": arms,
    }
    table = Table.of(
        f"Training time one full checkpoint costs (median of {a.saves}, {b.world} rank(s))",
        list(arms.values()),
        {
            "staging": "staging",
            "checkpoint": "checkpoint",
            "cost ms": lambda r: r["cost_s"] * 1e3,
            "each ms": lambda r: ", ".join(f"{x * 1e3:.0f}" for x in r["costs_s"]),
            "stall ms": lambda r: r["stall_s"] * 1e3,
            "commit s": "commit_s",
            "steps overlapped": "steps_overlapped",
        },
        "Cost: the stall plus what the steps from the save to the commit took beyond the "
        "mean step outside that window, the slowest rank's.",
    )
    targets = [
        Goal(f"lazy {q} checkpoint costs <= eager's", f"arms.lazy_{k}.cost_s", "<=",
               f"arms.eager_{k}.cost_s")
        for q, k in (("fp32", "fp32"), ("4-bit", "4bit"))
    ] + [
        Goal("lazy fp32 checkpoint costs <= lazy with torch's locked copy",
               "arms.lazy_fp32.cost_s", "<=", "arms.lazy_torch_fp32.cost_s"),
    ]  # fmt: skip
    return Outcome(m, [table], targets)


# -- --paired: the loss at each interval from adjacent intervals with and without -------

NOTCH = 1.58
"""A median's 95% interval is about ± 1.58 IQR / sqrt(n) (McGill's notches)."""
BUSY_STEPS = 2
"""``--paired``'s busy arms save every 2 steps: each save is asked for while the previous
one still commits."""


def _segment(b: Bench, trainer: StepLoop, ckpt: CheckpointManager | None, steps: int,
             k: int) -> dict[str, Any]:  # fmt: skip
    """``steps`` steps from a multiple of ``k`` on, ``ckpt.maybe_save`` after each if given,
    then its ``wait()``: the slowest rank's seconds; the saves asked for and made; the
    training thread's time in each save asked for (made or skipped); what the last
    checkpoint was; and, for one save, the training time it cost from the step times
    (:func:`_step_cost`)."""
    trainer.align(k)
    stalls: list[float] = []
    ends: list[float] = []
    saved_at: list[float] = []
    made = 0

    def after(step: int) -> None:
        nonlocal made
        if ckpt is not None and step % k == 0:
            saved_at.append(_now())
            began = time.perf_counter()
            made += ckpt.maybe_save(step)
            stalls.append(time.perf_counter() - began)
        ends.append(_now())

    def train() -> list[float]:
        took = trainer.train(steps, after)
        if ckpt is not None:
            ckpt.wait()
        return took

    seconds, took = timed(train)
    out: dict[str, Any] = {"seconds": seconds, "asked": len(stalls), "made": made, "stalls": stalls}
    if ckpt is not None and made:
        last = from_rank0(lambda: list_checkpoints(str(ckpt.config.path))[-1])
        out.update(kind=last.kind, mb=last.bytes / 1e6)
        if made == 1:
            cost = _step_cost(took, ends, saved_at[0], last.committed_at, stalls[0])
            out["cost_s"] = max_over_ranks(cost)[0]
            out["step_loss"] = out["cost_s"] / seconds
    return out


def _step_cost(took: list[float], ends: list[float], saved_at: float, committed_at: float,
               stall: float) -> float:  # fmt: skip
    """One checkpoint's cost to training, from the step times of its stretch: its stall
    plus what the steps from its save to its commit took beyond the mean of the stretch's
    other steps (seconds apart on the same machine, so its other tenants weigh alike)."""
    inside = [e >= saved_at and e - t <= committed_at for t, e in zip(took, ends)]
    clean = [t for t, i in zip(took, inside) if not i]
    if len(clean) < 10:
        return math.nan  # the commit overlapped nearly every step: no reference pace
    over = sum(t for t, i in zip(took, inside) if i) - statistics.fmean(clean) * sum(inside)
    return stall + over


def _spread(values: list[float]) -> float:
    """The 95% interval of the median of ``values``: ± 1.58 IQR / sqrt(n)."""
    if len(values) < 2:
        return math.nan
    q1, _, q3 = statistics.quantiles(values, n=4)
    return NOTCH * (q3 - q1) / math.sqrt(len(values))


def _pairs(b: Bench, trainer: StepLoop, cfg: CheckpointConfig, steps: int, k: int,
           pairs: int) -> dict[str, Any]:  # fmt: skip
    """``pairs`` pairs of adjacent stretches of ``steps`` steps, one with checkpoints every
    ``k`` steps and one without, their order alternating. Two estimates of the loss per
    pair: 1 - (time without) / (time with), and from the step times of the stretch with
    the checkpoint (:func:`_step_cost` over its time). The manager saves its baseline
    before the first pair."""
    rmtree(Path(cfg.path))
    losses, saving = [], []
    with CheckpointManager(trainer.work.model, cfg) as ckpt:
        ckpt.save(trainer.step)
        ckpt.wait()
        for i in range(pairs):
            b.settle()
            got = {}
            for with_ckpt in (True, False) if i % 2 == 0 else (False, True):
                got[with_ckpt] = _segment(b, trainer, ckpt if with_ckpt else None, steps, k)
            losses.append(1 - got[False]["seconds"] / got[True]["seconds"])
            saving.append(got[True])
    rmtree(Path(cfg.path))
    stalls = [t for s in saving for t in s["stalls"]]
    stall, worst = max_over_ranks(statistics.median(stalls), max(stalls))
    known = [s for s in saving if not math.isnan(s.get("cost_s", math.nan))]
    step_losses = [s["step_loss"] for s in known]
    return {
        "loss": statistics.median(losses),
        "loss_each": losses,
        "resolution": _spread(losses),
        "step_loss": statistics.median(step_losses) if step_losses else None,
        "step_loss_each": step_losses,
        "step_resolution": _spread(step_losses) if step_losses else None,
        "cost_each_s": [s["cost_s"] for s in known],
        "saves_asked": sum(s["asked"] for s in saving),
        "saves_made": sum(s["made"] for s in saving),
        "stall_s": stall,
        "stall_max_s": worst,
        "kinds": [s.get("kind") for s in saving],
        "mb_each": [s["mb"] for s in saving if "mb" in s],
    }


def _paired(b: Bench) -> Outcome:
    """``--paired``: throughput lost at each interval, lazy staging (the default), fp32 and
    4-bit, and with saves asked for faster than they commit (``on_busy`` wait, skip)."""
    a = b.args
    trainer, step_s = _warm_trainer(b)

    def config(name: str, k: int, quant: str, on_busy: OnBusy = "wait") -> CheckpointConfig:
        return CheckpointConfig(path=str(b.scratch / name), policy="intermittent",
                                interval_steps=k, on_busy=on_busy, quantize=QUANTS[quant],
                                staging="lazy", keep_last=2)  # fmt: skip

    intervals: dict[str, dict[str, dict[str, Any]]] = {}
    for target in a.intervals:
        k = max(2, round(target / step_s))
        pairs = max(3, round(a.pair_s / (2 * target)))
        for quant in QUANTS:
            r = _pairs(b, trainer, config(f"{_key(target)}_{quant}", k, quant), k, k, pairs)
            r.update(target_s=target, interval_s=k * step_s, interval_steps=k, quant=quant,
                     pairs=pairs)  # fmt: skip
            intervals.setdefault(_key(target), {})[quant] = r
            b.log(f"{target:g} s {quant}: lost {r['loss']:.2%} ± {r['resolution']:.2%} over "
                  f"{pairs} pairs, from step times {_pct(r['step_loss'])} ± "
                  f"{_pct(r['step_resolution'])}, stall {r['stall_s'] * 1e3:.1f} ms")  # fmt: skip
    pooled = {}  # one checkpoint's cost, every interval's pairs together
    for quant in QUANTS:
        costs = [c for iv in intervals.values() for c in iv[quant]["cost_each_s"]]
        pooled[quant] = {"cost_s": statistics.median(costs), "spread_s": _spread(costs),
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
            r = _pairs(b, trainer, cfg, a.busy_steps, BUSY_STEPS, a.busy_pairs)
        r.update(on_busy=on_busy, interval_s=BUSY_STEPS * step_s)
        busy[on_busy] = r
        b.log(f"busy, on_busy={on_busy}: lost {r['loss']:.2%}, {r['saves_made']} of "
              f"{r['saves_asked']} saves made")  # fmt: skip
    m = {
        "mode": "paired",
        "model": {"tables": a.tables, "rows": a.rows, "dim": a.dim, "batch": a.batch},
        "world_size": b.world,
        "step_s": step_s,
        "intervals": intervals,
        "cost": pooled,
        "busy": busy,
    }
    return Outcome(m, _paired_tables(m), _paired_targets(m))


def _paired_tables(m: dict[str, Any]) -> list[Table]:
    rows = [r for iv in m["intervals"].values() for r in iv.values()]
    lost = Table.of(
        f"Throughput lost at each interval ({m['world_size']} training rank(s), lazy staging, "
        "intermittent)",
        rows,
        {
            "interval s": "interval_s",
            "K steps": "interval_steps",
            "checkpoint": "quant",
            "lost: pooled cost / interval": lambda r: _pct(r["pooled_loss"]),
            "± (95%)": lambda r: _pct(r["pooled_resolution"]),
            "lost, from step times": lambda r: _pct(r["step_loss"]),
            "± (95%), step times": lambda r: _pct(r["step_resolution"]),
            "lost, pair times": lambda r: _pct(r["loss"]),
            "± (95%), pair times": lambda r: _pct(r["resolution"]),
            "pairs": "pairs",
            "each pair (pair times)": lambda r: ", ".join(_pct(x) for x in r["loss_each"]),
            "stall ms (median)": lambda r: r["stall_s"] * 1e3,
            "full, delta": lambda r: f"{r['kinds'].count('full')}, {r['kinds'].count('delta')}",
            "MB per checkpoint": lambda r: statistics.median(r["mb_each"]),
        },
        "Each pair: two adjacent stretches of K steps, one with a checkpoint in its middle "
        "(its commit waited for at the end), one without, in alternating order. A "
        "checkpoint's cost: its stall plus what the steps from its save to its commit took "
        "beyond the mean of the stretch's other steps. Pooled: the median cost of every "
        "checkpoint of every interval (of one format) over the interval. From step times: "
        "this interval's costs, each over its stretch's time, median over pairs. Pair times: 1 - (time without) / (time with), median over pairs. ±: "
        "the 95% interval of the median, 1.58 IQR / sqrt(pairs). A stretch "
        "without a checkpoint puts its changed rows into the next delta: deltas hold two "
        "intervals' rows, more than a job checkpointing every interval writes.",
    )
    busy = Table.of(
        "A save asked for while the previous one still commits (fp32, a save every "
        f"{BUSY_STEPS} steps)",
        list(m["busy"].values()),
        {
            "on_busy": "on_busy",
            "interval s": "interval_s",
            "saves made / asked": lambda r: f"{r['saves_made']} / {r['saves_asked']}",
            "lost": lambda r: _pct(r["loss"]),
            "± (95%)": lambda r: _pct(r["resolution"]),
            "stall ms (median)": lambda r: r["stall_s"] * 1e3,
            "stall ms (worst)": lambda r: r["stall_max_s"] * 1e3,
        },
        "wait: save() waits for the previous commit (the default); skip: the save is "
        "skipped with a warning, its rows go into the next one. Neither queues nor merges "
        "two saves in flight. Stall: training blocked inside save(), its wait included.",
    )
    return [lost, busy]


def _paired_targets(m: dict[str, Any]) -> list[Goal]:
    """fp32 at the interval nearest 10 s: lost <= 1% (from step times), resolved to
    ± 0.5%; the same from pair times."""
    ivs = m["intervals"]
    ten = min(ivs, key=lambda k: abs(ivs[k]["fp32"]["target_s"] - 10))
    at = f"intervals.{ten}.fp32"
    s = f"{ivs[ten]['fp32']['interval_s']:.1f} s"
    out = []
    spreads = {"pooled_loss": "pooled_resolution", "step_loss": "step_resolution",
               "loss": "resolution"}  # fmt: skip
    whats = (("pooled_loss", "from the pooled cost"), ("step_loss", "from step times"),
             ("loss", "from pair times"))  # fmt: skip
    for field, what in whats:
        spread = spreads[field]
        if ivs[ten]["fp32"][field] is None:
            continue  # every commit overlapped nearly every step: no reference pace
        out += [
            Goal(f"fp32: throughput lost <= 1% at {s}, {what}", f"{at}.{field}", "<=",
                 LOSS_BOUND),
            Goal(f"fp32: the estimate {what} at {s} resolves ± 0.5%", f"{at}.{spread}",
                 "<=", 0.005),
        ]  # fmt: skip
    return out


# -- --gil: which threads hold the GIL while commits run back to back --------------------

GIL_GROUPS = ("training", "cnr-writer", "cnr-io", "other")


def _thread_group(name: str) -> str:
    if name == "MainThread":
        return "training"
    return next((g for g in GIL_GROUPS[1:3] if name.startswith(g)), "other")


def _gil_shares(raw: str) -> dict[str, float]:
    """Each thread group's share of the samples of ``py-spy record --format raw --threads``
    (a line per stack: ``thread (<tid>): <name>;frame;... <count>``)."""
    counts = dict.fromkeys(GIL_GROUPS, 0)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        head = stack.split(";", 1)[0]
        if count.isdigit() and head.startswith("thread ("):
            counts[_thread_group(head.partition("): ")[2])] += int(count)
    total = sum(counts.values())
    if not total:
        raise RuntimeError(f"py-spy recorded no sample holding the GIL: {raw[:200]!r}")
    return {g: c / total for g, c in counts.items()} | {"samples": total}


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _gil_run(b: Bench, trainer: StepLoop, quant: str) -> dict[str, Any]:
    """One format: train and save every step for ``--gil-s`` seconds under py-spy."""
    root = b.scratch / f"gil_{quant}"
    rmtree(root)
    cfg = CheckpointConfig(path=str(root), policy="intermittent", quantize=QUANTS[quant],
                           on_busy="skip")  # fmt: skip
    out = b.artifacts / f"gil_{quant}_rank{b.rank}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    with CheckpointManager(trainer.work.model, cfg) as ckpt:
        ckpt.save(trainer.step)
        ckpt.wait()  # the baseline: what follows is the steady state
        dist.barrier()
        spy = subprocess.Popen(
            [str(Path(sys.executable).parent / "py-spy"), "record", "--gil", "--threads",
             "--nonblocking", "--format", "raw", "--rate", "100", "--duration",
             str(max(1, round(b.args.gil_s))), "--pid", str(os.getpid()), "--output", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        saves = steps = 0
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*skipped: the checkpoint of step")
            while not _any_rank(spy.poll() is not None):  # the ranks step together
                trainer.train(1)
                steps += 1
                saves += bool(ckpt.save(trainer.step))
        ckpt.wait()
    if spy.wait() != 0:
        raise RuntimeError(
            f"py-spy failed ({spy.returncode}): {spy.stdout.read() if spy.stdout else ''}"
        )
    shares = _gil_shares(out.read_text())
    rmtree(root)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, shares | {"saves": saves, "steps": steps})
    return {"format": quant, **every[0], "writer": every[0]["cnr-writer"] + every[0]["cnr-io"]}


def _gil(b: Bench) -> Outcome:
    """``--gil``: the GIL's holders during continuous commits, per format."""
    trainer, _ = _warm_trainer(b)
    rows = [_gil_run(b, trainer, quant) for quant in QUANTS]
    for r in rows:
        b.log(", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in r.items()))  # fmt: skip
    m = {"mode": "gil", "world_size": b.world, "seconds": b.args.gil_s,
         "formats": {r["format"].replace("-", ""): r for r in rows}}  # fmt: skip
    table = Table.of(
        f"Share of the samples holding the GIL, by thread, during continuous commits "
        f"(rank 0 of {b.world}, {b.args.gil_s:.0f} s per format)",
        rows,
        {
            "format": "format",
            "training": "training",
            "writer (cnr-writer)": "cnr-writer",
            "I/O (cnr-io)": "cnr-io",
            "other": "other",
            "samples": "samples",
            "commits": "saves",
            "steps": "steps",
        },  # fmt: skip
        "py-spy record --gil --threads --nonblocking at 100 Hz on rank 0's process.",
    )
    targets = [
        Goal(f"{r['format']}: the writer's threads hold the GIL in <= 10% of the samples",
             f"formats.{r['format'].replace('-', '')}.writer", "<=", 0.10)
        for r in rows
    ]  # fmt: skip
    return Outcome(m, [table], targets)


def run(b: Bench) -> Outcome:
    a = b.args
    if a.gil:
        return _gil(b)
    if a.save_cost:
        return _save_costs(b)
    if a.paired:
        return _paired(b)
    model = {
        "tables": a.tables,
        "rows": a.rows,
        "dim": a.dim,
        "batch": a.batch,
        "fp32_weights_gb": a.tables * a.rows * a.dim * 4 / GB,
    }
    merged = _merged(b, model)  # before the run: a bad --merge fails at once
    m: dict[str, Any] = {
        "model": model,
        "stagings": list(STAGINGS),
        **merged,
        f"ranks_{b.world}": _world(b),
        "anchors": ANCHORS,
    }
    return Outcome(m, tables(m), targets(m, a.headline_s))


CASE = Case(
    name="overhead",
    title="End-to-end overhead: throughput lost to checkpoints every K steps",
    arguments=_arguments,
    smoke="--tables 2 --rows 4000 --dim 16 --batch 64 --intervals 0.3 0.6 --arm-s 0.6 "
    "--rounds 1 --warmup-steps 3 --probe-steps 20 --saves 1 --before 5 --after 40 "
    "--pair-s 1.2 --busy-steps 6 --busy-pairs 2 --gil-s 2",
    run=run,
)

if __name__ == "__main__":
    sys.exit(main(CASE, __doc__))
