"""CPR's comparison on the synthetic Criteo-like DLRM: overhead and quality of full
recovery, partial recovery, and partial recovery with MFU / SSU prioritized saves,
under emulated failures.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 \
        scripts/experiments/cpr.py --out out/experiments/cpr

Failures are emulated in-process. Their steps are drawn from an exponential
distribution with mean ``--mtbf-steps`` and each hits one embedding shard (one
rank, drawn at random); the pattern is seeded and the same for every arm. Every
arm trains the same model on the same batches for ``--steps`` steps; a full
checkpoint is taken at step 0 so that every failure has a restore target.

- ``full``: checkpoints every Young's interval ``sqrt(2 * O_save * T_fail)``
  (converted to steps with the step time of a probe run; ``O_save`` is the time a
  probe save blocks training). At a failure every rank waits for the pending
  checkpoint, restores the latest committed one (step c) and re-runs steps
  c+1..f (lost computation).
- ``partial``: checkpoints every ``2 * T_fail * N * pls_target`` (PLS target);
  at a failure only the failed rank's shards reload (``restore(ranks=[r])``);
  training goes on at f+1.
- ``partial+mfu`` / ``partial+ssu``: as ``partial``, with MFU / SSU tracking,
  the consecutive policy and a per-rank priority budget (a fraction of one full
  checkpoint's per-rank bytes), saving ``--prio-interval-frac`` times as often.

Overheads, as a percentage of the pure training time of the arm's ``--steps``
steps: save (time blocked in ``save`` plus ``wait`` at failures), load (time in
``restore``), lost computation (re-run steps) and rescheduling
(``--reschedule-s`` per failure, accounted, not slept). Times are the max over
ranks. PLS measured: the sum over failures of the steps since the failed rank's
last committed checkpoint, over ``N * steps`` (0 for full recovery).

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
from torchrec_cnr.tracking.tracker import TrackingMode

LR = 0.05


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


def _probe(args: argparse.Namespace, root: Path) -> dict[str, float]:
    """Step time, the time a save blocks training, and the bytes of one full checkpoint."""
    _fresh(root)
    rank = dist.get_rank()
    t = _trainer(args, CheckpointConfig(path=str(root), policy="intermittent"), "bitmap")
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
    return {"step_s": step_s, "save_s": stall, "commit_s": commit, "full_bytes": float(full_bytes)}


def _failures(args: argparse.Namespace, world: int) -> list[tuple[int, int]]:
    """(step, rank) of every failure: exponential inter-arrival times in steps."""
    rng = random.Random(args.seed)
    out: list[tuple[int, int]] = []
    at = 0.0
    while True:
        at += rng.expovariate(1.0 / args.mtbf_steps)
        step = max(1, math.ceil(at))
        if step > args.steps:
            return out
        victim = rng.randrange(world)
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
) -> dict[str, Any]:
    _fresh(root)
    rank, world = dist.get_rank(), dist.get_world_size()
    t = _trainer(args, ckpt_cfg, tracking_mode)
    fail_at = dict(failures)
    train_s = save_s = load_s = lost_s = 0.0
    lost_steps = 0
    pls_steps = 0
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
        victim = fail_at[step]
        began = time.perf_counter()
        t.ckpt.wait()
        save_s += time.perf_counter() - began
        began = time.perf_counter()
        if mode == "full":
            restored = t.ckpt.restore()
        else:
            restored = t.ckpt.restore(ranks=[victim])
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
    box = [Manifest.load(root) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    manifest = box[0]
    assert manifest is not None
    saves = len(manifest.checkpoints)
    written = sum(e.bytes for e in manifest.checkpoints)
    train_s, save_s, load_s, lost_s = _max([train_s, save_s, load_s, lost_s])
    resched_s = args.reschedule_s * len(failures)
    interval = ckpt_cfg.interval_steps
    assert isinstance(interval, int)
    row: dict[str, Any] = {
        "arm": name,
        "mode": mode,
        "tracking": tracking_mode,
        "policy": ckpt_cfg.policy,
        "budget_mb": ckpt_cfg.priority_budget_mb or 0.0,
        "interval_steps": interval,
        "checkpoints": saves,
        "written_mb": written / 1e6,
        "failures": len(failures),
        "lost_steps": lost_steps,
        "train_s": train_s,
        "save_s": save_s,
        "load_s": load_s,
        "lost_s": lost_s,
        "resched_s": resched_s,
        "pls_measured": pls_steps / (world * args.steps) if mode == "partial" else 0.0,
        "pls_formula": pls(interval, args.mtbf_steps, world) if mode == "partial" else 0.0,
        **metrics,
    }
    for part in ("save", "load", "lost", "resched"):
        row[f"{part}_pct"] = 100 * row[f"{part}_s"] / train_s
    row["overhead_pct"] = sum(row[f"{p}_pct"] for p in ("save", "load", "lost", "resched"))
    if rank == 0:
        print(
            f"{name:<13} every {interval:>3} steps, {saves:>3} ckpts: overhead {row['overhead_pct']:6.2f}% "
            f"(save {row['save_pct']:.2f} load {row['load_pct']:.2f} lost {row['lost_pct']:.2f} "
            f"resched {row['resched_pct']:.2f}) AUC {row['auc']:.4f} logloss {row['logloss']:.4f} "
            f"PLS {row['pls_measured']:.4f}",
            flush=True,
        )
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--mtbf-steps", type=float, default=80.0)
    p.add_argument("--pls-target", type=float, default=0.05)
    p.add_argument("--reschedule-s", type=float, default=0.0)
    p.add_argument(
        "--budget-frac",
        type=float,
        default=0.25,
        help="MFU/SSU priority budget as a fraction of one full checkpoint's per-rank bytes",
    )
    p.add_argument("--budget-mb", type=float, default=None, help="overrides --budget-frac")
    p.add_argument(
        "--prio-interval-frac",
        type=float,
        default=0.5,
        help="MFU/SSU interval as a fraction of the partial interval",
    )
    p.add_argument("--max-rows", type=int, default=5_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--probe-warmup", type=int, default=5)
    p.add_argument("--probe-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="seed of the failure pattern")
    p.add_argument(
        "--young-cost",
        choices=["stall", "commit"],
        default="stall",
        help="O_save for Young's interval: time the probe save blocks, or until it commits",
    )
    p.add_argument("--arms", nargs="*", default=["full", "partial", "partial+mfu", "partial+ssu"])
    p.add_argument("--out", type=Path, default=Path("out/experiments/cpr"))
    args = p.parse_args()
    init_distributed()
    t0 = time.perf_counter()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        scratch = scratch_dir("cnr_cpr_")
        probe = _probe(args, scratch / "probe")
        mtbf_s = args.mtbf_steps * probe["step_s"]
        o_save = probe["save_s"] if args.young_cost == "stall" else probe["commit_s"]
        young_s = young_interval(max(o_save, 1e-6), mtbf_s)
        full_interval = max(1, round(young_s / probe["step_s"]))
        partial_interval = max(1, round(2 * args.mtbf_steps * world * args.pls_target))
        prio_interval = max(1, round(partial_interval * args.prio_interval_frac))
        budget = args.budget_mb or args.budget_frac * probe["full_bytes"] / world / (1 << 20)
        failures = _failures(args, world)
        if rank == 0:
            print(
                f"probe: step {probe['step_s'] * 1e3:.1f} ms, save blocks {probe['save_s'] * 1e3:.1f} ms "
                f"(commit {probe['commit_s'] * 1e3:.1f} ms), full checkpoint {probe['full_bytes'] / 1e6:.2f} MB; "
                f"MTBF {args.mtbf_steps:g} steps = {mtbf_s:.2f} s; Young {young_s:.3f} s = {full_interval} steps; "
                f"partial {partial_interval} steps; MFU/SSU {prio_interval} steps, budget {budget:.3f} MB/rank",
                flush=True,
            )
            print(f"failures (step, rank): {failures}", flush=True)
        intermittent: dict[str, Any] = {"policy": "intermittent"}
        prio: dict[str, Any] = {"policy": "consecutive", "priority_budget_mb": budget}
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
            rows.append(_run_arm(args, root, name, mode, cfg, tracking, failures))
        if rank == 0:
            info = {
                **probe,
                "mtbf_s": mtbf_s,
                "young_s": young_s,
                "failures": failures,
                "elapsed_s": time.perf_counter() - t0,
            }
            _write(args, rows, info)
            shutil.rmtree(scratch, ignore_errors=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], info: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    keys = list(rows[0].keys())
    with open(args.out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)

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
        f"CPR: {len(info['failures'])} failures in {args.steps} steps (MTBF {args.mtbf_steps:g} steps)"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "overhead.png", dpi=110)

    lines = [
        f"# CPR: full vs partial recovery ({args.steps} steps, 26 Criteo tables x <= {args.max_rows} rows "
        f"x dim {args.dim}, batch {args.batch_size}/rank, 2 ranks)",
        "",
        f"Probe: step {info['step_s'] * 1e3:.1f} ms, save blocks {info['save_s'] * 1e3:.1f} ms, "
        f"full checkpoint {info['full_bytes'] / 1e6:.2f} MB. MTBF {args.mtbf_steps:g} steps "
        f"({info['mtbf_s']:.2f} s); Young's interval {info['young_s']:.3f} s (O_save = probe {args.young_cost}). PLS target {args.pls_target}, "
        f"rescheduling {args.reschedule_s:g} s per failure.",
        f"Failures (step, rank): {info['failures']}.",
        "",
        "| arm | interval (steps) | ckpts | overhead % | save % | load % | lost comp. % | resched. % "
        "| PLS measured | PLS formula | AUC | log loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['interval_steps']} | {r['checkpoints']} | {r['overhead_pct']:.2f} | "
            f"{r['save_pct']:.2f} | {r['load_pct']:.2f} | {r['lost_pct']:.2f} | {r['resched_pct']:.2f} | "
            f"{r['pls_measured']:.4f} | {r['pls_formula']:.4f} | {r['auc']:.4f} | {r['logloss']:.4f} |"
        )
    full = next((r for r in rows if r["mode"] == "full"), None)
    partial = [r for r in rows if r["mode"] == "partial"]
    if full and partial:
        best = min(partial, key=lambda r: r["overhead_pct"])
        ratio = full["overhead_pct"] / max(best["overhead_pct"], 1e-12)
        ok = best["overhead_pct"] <= full["overhead_pct"] / 5
        lines += [
            "",
            f"{'PASS' if ok else 'MISS'}: partial recovery overhead (best: {best['arm']}, "
            f"{best['overhead_pct']:.2f}%) <= 1/5 of full recovery's ({full['overhead_pct']:.2f}%): "
            f"{ratio:.2f}x lower",
        ]
        drop = full["auc"] - best["auc"]
        ok = abs(drop) <= 0.001
        lines.append(
            f"{'PASS' if ok else 'MISS'}: AUC of {best['arm']} ({best['auc']:.4f}) within 0.001 of full "
            f"recovery's ({full['auc']:.4f}): difference {-drop:+.4f}"
        )
    lines += ["", f"Run time: {info['elapsed_s']:.0f} s."]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
