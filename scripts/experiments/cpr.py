"""CPR's comparison on the synthetic Criteo-like DLRM, in the paper's setting: overhead
and quality of full recovery, partial recovery, and partial recovery with MFU / SSU
prioritized saves, under emulated failures of single embedding shards.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 \
        scripts/experiments/cpr.py --out out/experiments/cpr

**Emulated shards.** CPR's embedding tables live on N parameter-server shards and a failure
takes one of them down. Here each rank's tables are split into ``--shards / world`` groups
of about equal bytes (``--shards 16``: 8 per rank on 2 ranks), and each group is one
emulated shard. Failure steps are drawn from an exponential distribution with mean
``--mtbf-steps``; each hits one shard, drawn at random; the pattern is seeded and the same
for every arm. Every arm trains the same model on the same batches for ``--steps`` steps;
a full checkpoint is taken at step 0 so that every failure has a restore target.

- ``full``: checkpoints every Young's interval ``sqrt(2 * O_save * T_fail)`` (``O_save``:
  the time a probe save blocks training). At a failure every rank waits for the pending
  checkpoint, restores the latest committed one (step c) and re-runs steps c+1..f.
- ``partial``: checkpoints every ``2 * T_fail * N * pls_target`` (PLS target); at a
  failure only the failed shard's tables reload (``restore(tables=...)``); training goes
  on at f+1.
- ``partial+mfu`` / ``partial+ssu``: as ``partial``, with MFU / SSU tracking, the
  consecutive policy, a per-rank priority budget (a fraction of one full checkpoint's
  per-rank bytes), saving ``--prio-interval-frac`` times as often, and
  ``compact_every`` so that a restore reads a bounded chain.

**Rescheduling** (replacing the failed node) is accounted, not slept, for every failure of
every arm: ``--reschedule-frac`` of the MTBF. Its default, 0.5%, is the upper bound the
CPR paper's own figures put on it: its abstract reports a total overhead of 0.53-0.68% for
CPR-MFU/SSU in a setup emulating a production cluster's failure pattern and overheads,
rescheduling included. Because it is not slept, the summary also gives the full/partial
ratio for other values from the same measured run.

Overheads, as a percentage of the pure training time of the arm's ``--steps`` steps:
save (time blocked in ``save`` plus ``wait`` at failures), load (time in ``restore``),
lost computation (re-run steps) and rescheduling. Times are the max over ranks. PLS
measured: the sum over failures of the steps since the failed shard's last committed
checkpoint, over ``N * steps`` (0 for full recovery).

Writes results.csv, overhead.png and summary.md.
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cnr_train.bench.common import bcast, scratch_dir
from cnr_train.config import DataConfig, JobConfig, ModelConfig, OptimizerConfig
from cnr_train.job import Trainer, evaluate
from cnr_train.launch import init_distributed
from cnr_train.workload import train_step
from torchrec_cnr import CheckpointConfig
from torchrec_cnr.commit import Manifest
from torchrec_cnr.recovery.interval import pls, young_interval
from torchrec_cnr.tracking import model_state
from torchrec_cnr.tracking.tracker import TrackingMode

LR = 0.05
RESCHEDULE_FRACS = (0.0, 0.001, 0.0025, 0.005, 0.01, 0.02)
"""Rescheduling costs (fractions of the MTBF) the summary recomputes the ratio for."""


def _max(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _trainer(
    args: argparse.Namespace, ckpt_cfg: CheckpointConfig, tracking_mode: TrackingMode
) -> Trainer:
    """The same model, seeds and data for every arm; only checkpointing differs."""
    job = JobConfig(
        checkpoint=ckpt_cfg,
        model=ModelConfig(tables="criteo", max_rows=args.max_rows, dim=args.dim),
        data=DataConfig(batch_size=args.batch_size),
        optimizer=OptimizerConfig(sparse_lr=LR, dense_lr=LR),
    )
    return Trainer.build(job, seed=0, tracking_mode=tracking_mode)


def _fresh(root: Path) -> None:
    if dist.get_rank() == 0 and root.exists():
        shutil.rmtree(root)
    dist.barrier()


def _emulated_shards(t: Trainer, num_shards: int) -> list[list[str]]:
    """Each rank's tables in ``num_shards / world`` groups of about equal bytes, for every rank.

    Largest table first into the lightest group of its rank; the groups of every rank, in
    rank order, are the emulated shards.
    """
    world = dist.get_world_size()
    if num_shards % world:
        raise ValueError(f"--shards {num_shards} is not a multiple of {world} ranks")
    per_rank = num_shards // world
    local = sorted(
        ((s.spec.rows * s.spec.cols, s.spec.table) for s in model_state.local_shards(t.model)),
        reverse=True,
    )
    if len(local) < per_rank:
        raise ValueError(f"a rank holds {len(local)} tables, fewer than {per_rank} shards")
    groups: list[list[str]] = [[] for _ in range(per_rank)]
    sizes = [0] * per_rank
    for size, table in local:
        i = sizes.index(min(sizes))
        groups[i].append(table)
        sizes[i] += size
    every: list[list[list[str]]] = [[] for _ in range(world)]
    dist.all_gather_object(every, groups)
    return [group for rank_groups in every for group in rank_groups]


def _probe(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Step time, the time a save blocks training, one full checkpoint's bytes, the shards."""
    _fresh(root)
    rank = dist.get_rank()
    t = _trainer(args, CheckpointConfig(path=str(root), policy="intermittent"), "bitmap")
    shards = _emulated_shards(t, args.shards)
    for _ in range(args.probe_warmup):
        train_step(t.model, t.opt, t.data.next(rank))
    began = time.perf_counter()
    for _ in range(args.probe_steps):
        train_step(t.model, t.opt, t.data.next(rank))
    step_s = (time.perf_counter() - began) / args.probe_steps
    began = time.perf_counter()
    t.ckpt.save(t.data.position)
    stall = time.perf_counter() - began
    t.ckpt.wait()
    commit = time.perf_counter() - began
    step_s, stall, commit = _max([step_s, stall, commit])
    t.ckpt.close()
    full_bytes = bcast(Manifest.load(root).checkpoints[-1].bytes if rank == 0 else None)
    return {
        "step_s": step_s,
        "save_s": stall,
        "commit_s": commit,
        "full_bytes": float(full_bytes),
        "shards": shards,
    }


def _failures(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(step, shard) of every failure: exponential inter-arrival times in steps."""
    rng = random.Random(args.seed)
    out: list[tuple[int, int]] = []
    at = 0.0
    while True:
        at += rng.expovariate(1.0 / args.mtbf_steps)
        step = max(1, math.ceil(at))
        if step > args.steps:
            return out
        victim = rng.randrange(args.shards)
        if not out or step > out[-1][0]:
            out.append((step, victim))


def _run_arm(
    args: argparse.Namespace,
    root: Path,
    name: str,
    mode: str,
    ckpt_cfg: CheckpointConfig,
    tracking_mode: TrackingMode,
    failures: list[tuple[int, int]],
    shards: list[list[str]],
    resched_s: float,
) -> dict[str, Any]:
    _fresh(root)
    rank = dist.get_rank()
    t = _trainer(args, ckpt_cfg, tracking_mode)
    fail_at = dict(failures)
    train_s = save_s = load_s = lost_s = 0.0
    lost_steps = pls_steps = 0
    began = time.perf_counter()
    t.ckpt.save(0)  # the restore target of a failure before the first interval
    save_s += time.perf_counter() - began
    for step in range(1, args.steps + 1):
        began = time.perf_counter()
        train_step(t.model, t.opt, t.data.next(rank))
        train_s += time.perf_counter() - began
        began = time.perf_counter()
        t.ckpt.maybe_save(step)
        save_s += time.perf_counter() - began
        if step not in fail_at:
            continue
        began = time.perf_counter()
        t.ckpt.wait()
        save_s += time.perf_counter() - began
        began = time.perf_counter()
        if mode == "full":
            restored = t.ckpt.restore()
        else:
            restored = t.ckpt.restore(tables=shards[fail_at[step]])
        load_s += time.perf_counter() - began
        assert restored is not None and restored <= step
        if mode == "full":
            assert t.data.position == restored, (t.data.position, restored)
            began = time.perf_counter()
            for redo in range(restored + 1, step + 1):
                train_step(t.model, t.opt, t.data.next(rank))
                # A checkpoint cannot fall in c+1..f (c is the latest committed);
                # maybe_save keeps the loop honest anyway.
                t.ckpt.maybe_save(redo)
            lost_s += time.perf_counter() - began
            lost_steps += step - restored
        else:
            pls_steps += step - restored
    t.ckpt.wait()
    metrics = evaluate(t.model, t.data, args.eval_batches)
    t.ckpt.close()
    manifest = bcast(Manifest.load(root) if rank == 0 else None)
    latest = manifest.latest()
    train_s, save_s, load_s, lost_s = _max([train_s, save_s, load_s, lost_s])
    interval = ckpt_cfg.interval_steps
    assert isinstance(interval, int) and latest is not None
    row: dict[str, Any] = {
        "arm": name,
        "mode": mode,
        "tracking": tracking_mode,
        "policy": ckpt_cfg.policy,
        "budget_mb": ckpt_cfg.priority_budget_mb or 0.0,
        "compact_every": ckpt_cfg.compact_every or 0,
        "interval_steps": interval,
        "checkpoints": sum(1 for e in manifest.checkpoints if not e.compacted_from),
        "compactions": sum(1 for e in manifest.checkpoints if e.compacted_from),
        "final_chain": len(latest.chain),
        "written_mb": sum(e.bytes for e in manifest.checkpoints) / 1e6,
        "failures": len(failures),
        "lost_steps": lost_steps,
        "train_s": train_s,
        "save_s": save_s,
        "load_s": load_s,
        "lost_s": lost_s,
        "resched_s": resched_s * len(failures),
        "pls_measured": pls_steps / (args.shards * args.steps) if mode == "partial" else 0.0,
        "pls_formula": pls(interval, args.mtbf_steps, args.shards) if mode == "partial" else 0.0,
        **metrics,
    }
    for part in ("save", "load", "lost", "resched"):
        row[f"{part}_pct"] = 100 * row[f"{part}_s"] / train_s
    row["overhead_pct"] = sum(row[f"{p}_pct"] for p in ("save", "load", "lost", "resched"))
    if rank == 0:
        print(
            f"{name:<13} every {interval:>4} steps, {row['checkpoints']:>3} ckpts: overhead "
            f"{row['overhead_pct']:6.2f}% (save {row['save_pct']:.2f} load {row['load_pct']:.2f} "
            f"lost {row['lost_pct']:.2f} resched {row['resched_pct']:.2f}) AUC {row['auc']:.4f} "
            f"logloss {row['logloss']:.4f} PLS {row['pls_measured']:.4f}",
            flush=True,
        )
    return row


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--mtbf-steps", type=float, default=500.0)
    p.add_argument("--shards", type=int, default=16, help="emulated embedding shards in all")
    p.add_argument("--pls-target", type=float, default=0.02)
    p.add_argument(
        "--reschedule-frac",
        type=float,
        default=0.005,
        help="rescheduling cost per failure, as a fraction of the MTBF",
    )
    p.add_argument(
        "--budget-frac",
        type=float,
        default=0.25,
        help="MFU/SSU priority budget as a fraction of one full checkpoint's per-rank bytes",
    )
    p.add_argument(
        "--prio-interval-frac",
        type=float,
        default=0.5,
        help="MFU/SSU interval as a fraction of the partial interval",
    )
    p.add_argument("--compact-every", type=int, default=4, help="MFU/SSU chains' compact_every")
    p.add_argument("--max-rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--eval-batches", type=int, default=40)
    p.add_argument("--probe-warmup", type=int, default=5)
    p.add_argument("--probe-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="seed of the failure pattern")
    p.add_argument("--arms", nargs="*", default=["full", "partial", "partial+mfu", "partial+ssu"])
    p.add_argument("--out", type=Path, default=Path("out/experiments/cpr"))
    args = p.parse_args()
    init_distributed()
    t0 = time.perf_counter()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        scratch = scratch_dir("cnr_cpr_")
        probe = _probe(args, scratch / "probe")
        shards = probe["shards"]
        mtbf_s = args.mtbf_steps * probe["step_s"]
        young_s = young_interval(max(probe["save_s"], 1e-6), mtbf_s)
        full_interval = max(1, round(young_s / probe["step_s"]))
        partial_interval = max(1, round(2 * args.mtbf_steps * args.shards * args.pls_target))
        prio_interval = max(1, round(partial_interval * args.prio_interval_frac))
        budget = args.budget_frac * probe["full_bytes"] / world / (1 << 20)
        resched_s = args.reschedule_frac * mtbf_s
        failures = _failures(args)
        if rank == 0:
            print(
                f"probe: step {probe['step_s'] * 1e3:.1f} ms, save blocks {probe['save_s'] * 1e3:.1f} ms "
                f"(commit {probe['commit_s'] * 1e3:.1f} ms), full checkpoint {probe['full_bytes'] / 1e6:.1f} MB; "
                f"{len(shards)} emulated shards of {[len(g) for g in shards]} tables; MTBF "
                f"{args.mtbf_steps:g} steps = {mtbf_s:.2f} s; Young {young_s:.3f} s = {full_interval} steps; "
                f"partial {partial_interval} steps; MFU/SSU {prio_interval} steps, budget "
                f"{budget:.2f} MB/rank; rescheduling {resched_s * 1e3:.0f} ms per failure",
                flush=True,
            )
            print(f"failures (step, shard): {failures}", flush=True)
        intermittent: dict[str, Any] = {"policy": "intermittent"}
        prio: dict[str, Any] = {
            "policy": "consecutive",
            "priority_budget_mb": budget,
            "compact_every": args.compact_every,
        }
        specs: dict[str, tuple[str, int, dict[str, Any], TrackingMode]] = {
            "full": ("full", full_interval, intermittent, "bitmap"),
            "partial": ("partial", partial_interval, intermittent, "bitmap"),
            "partial+mfu": ("partial", prio_interval, prio, "mfu"),
            "partial+ssu": ("partial", prio_interval, prio, "ssu"),
        }
        rows = []
        for name in args.arms:
            mode, interval, extra, tracking = specs[name]
            root = scratch / name.replace("+", "_")
            cfg = CheckpointConfig(path=str(root), interval_steps=interval, **extra)
            rows.append(
                _run_arm(args, root, name, mode, cfg, tracking, failures, shards, resched_s)
            )
        if rank == 0:
            info = {
                **probe,
                "mtbf_s": mtbf_s,
                "young_s": young_s,
                "resched_s": resched_s,
                "failures": failures,
                "elapsed_s": time.perf_counter() - t0,
            }
            _write(args, rows, info)
            shutil.rmtree(scratch, ignore_errors=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _plot(args: argparse.Namespace, rows: list[dict[str, Any]], info: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [
        ("save", "save"),
        ("load", "load"),
        ("lost", "lost computation"),
        ("resched", "rescheduling"),
    ]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for key, label in parts:
        vals = [r[f"{key}_pct"] for r in rows]
        ax.bar(xs, vals, 0.6, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, r, top in zip(xs, rows, bottom):
        ax.annotate(
            f"AUC {r['auc']:.4f}",
            (x, top),
            ha="center",
            va="bottom",
            xytext=(0, 3),
            textcoords="offset points",
            fontsize=8,
        )
    ax.set_xticks(xs, [r["arm"] for r in rows])
    ax.set_ylabel("overhead, % of training time")
    ax.set_ylim(0, max(bottom) * 1.2 + 1e-9)
    ax.set_title(
        f"CPR: {len(info['failures'])} failures of 1 in {args.shards} shards in {args.steps} "
        f"steps (MTBF {args.mtbf_steps:g} steps)"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "overhead.png", dpi=110)


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], info: dict[str, Any]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    _plot(args, rows, info)
    lines = [
        f"# CPR: full vs partial recovery ({args.steps} steps, 26 Criteo tables x <= "
        f"{args.max_rows} rows x dim {args.dim}, batch {args.batch_size}/rank, "
        f"{dist.get_world_size()} ranks, {args.shards} emulated shards)",
        "",
        f"Probe: step {info['step_s'] * 1e3:.1f} ms, save blocks {info['save_s'] * 1e3:.1f} ms, "
        f"full checkpoint {info['full_bytes'] / 1e6:.1f} MB. MTBF {args.mtbf_steps:g} steps "
        f"({info['mtbf_s']:.2f} s); Young's interval {info['young_s']:.3f} s. PLS target "
        f"{args.pls_target}; rescheduling {args.reschedule_frac:.2%} of the MTBF "
        f"({info['resched_s'] * 1e3:.0f} ms) per failure.",
        f"Failures (step, shard): {info['failures']}.",
        "",
        "| arm | interval (steps) | ckpts (+ compactions) | final chain | overhead % | save % "
        "| load % | lost comp. % | resched. % | PLS measured | PLS formula | AUC | log loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['interval_steps']} | {r['checkpoints']} (+{r['compactions']}) | "
            f"{r['final_chain']} | {r['overhead_pct']:.2f} | {r['save_pct']:.2f} | "
            f"{r['load_pct']:.2f} | {r['lost_pct']:.2f} | {r['resched_pct']:.2f} | "
            f"{r['pls_measured']:.4f} | {r['pls_formula']:.4f} | {r['auc']:.4f} | {r['logloss']:.4f} |"
        )
    full = next((r for r in rows if r["mode"] == "full"), None)
    partial = [r for r in rows if r["mode"] == "partial"]
    if full and partial:
        lines += _verdict(full, partial, info["mtbf_s"])
    lines += ["", f"Run time: {info['elapsed_s']:.0f} s."]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _verdict(full: dict[str, Any], partial: list[dict[str, Any]], mtbf_s: float) -> list[str]:
    best = min(partial, key=lambda r: r["overhead_pct"])
    ratio = full["overhead_pct"] / max(best["overhead_pct"], 1e-12)
    ok = best["overhead_pct"] <= full["overhead_pct"] / 5
    lines = [
        "",
        f"{'PASS' if ok else 'MISS'}: partial recovery overhead (best: {best['arm']}, "
        f"{best['overhead_pct']:.2f}%) <= 1/5 of full recovery's ({full['overhead_pct']:.2f}%): "
        f"{ratio:.2f}x lower",
    ]
    drop = full["auc"] - best["auc"]
    lines.append(
        f"{'PASS' if abs(drop) <= 0.001 else 'MISS'}: AUC of {best['arm']} ({best['auc']:.4f}) "
        f"within 0.001 of full recovery's ({full['auc']:.4f}): difference {-drop:+.4f}"
    )
    # Rescheduling is accounted, not slept: the same run gives the ratio for other costs.
    lines += [
        "",
        "Full / best partial overhead for other rescheduling costs (same measured run):",
        "",
        "| rescheduling, % of MTBF | full % | "
        + " | ".join(r["arm"] for r in partial)
        + " | ratio |",
        "|---:|---:|" + "---:|" * (len(partial) + 1),
    ]
    for frac in RESCHEDULE_FRACS:

        def total(r: dict[str, Any], frac: float = frac) -> float:
            resched = 100 * frac * mtbf_s * r["failures"] / r["train_s"]
            return r["overhead_pct"] - r["resched_pct"] + resched

        best_total = min(total(r) for r in partial)
        lines.append(
            f"| {frac:.2%} | {total(full):.2f} | "
            + " | ".join(f"{total(r):.2f}" for r in partial)
            + f" | {total(full) / max(best_total, 1e-12):.2f}x |"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
