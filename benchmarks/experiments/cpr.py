"""CPR's comparison on the synthetic Criteo-like DLRM: overhead and quality of full recovery,
partial recovery, and partial recovery with MFU / SSU prioritized saves, under emulated
failures of single embedding shards.

Each rank's tables form ``--shards / world`` emulated shards of about equal bytes. Failures
arrive with exponential gaps of mean ``--mtbf-steps`` (seeded, the same for every arm), each
taking one shard down. Every arm trains the same model on the same batches for ``--steps``
steps, a full checkpoint at step 0 first.

- ``full``: checkpoints every Young's interval ``sqrt(2 * O_save * T_fail)``; at a failure
  every rank restores the latest committed checkpoint (step c) and re-runs c+1..f.
- ``partial``: checkpoints every ``2 * T_fail * N * pls_target``; only the failed shard's
  tables reload (``restore(tables=...)``).
- ``partial+mfu`` / ``partial+ssu``: as ``partial`` with MFU / SSU tracking, the consecutive
  policy, a per-rank priority budget (``--budget-frac`` of a full checkpoint),
  ``--prio-interval-frac`` times the interval and ``compact_every``.

Rescheduling is accounted, not slept: ``--reschedule-frac`` of the MTBF per failure (the
result gives the ratio for other values too). Overheads are percentages of the arm's pure
training time (save, load, lost computation, rescheduling), the slowest rank's; PLS
measured is the steps lost to partial restores over ``N * steps``. Targets: the best partial
arm's overhead <= 1/5 of full recovery's, its AUC within 0.001. Writes ``results.csv`` and
``overhead.png`` beside the JSON result.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from typing import Any

import torch.distributed as dist

from benchmarks.harness import Bench, Case, Outcome, cli, pyplot, save_figure, write_csv
from benchmarks.measure import Policy, from_rank0, gathered, max_over_ranks, rmtree, timed_save
from benchmarks.results import Goal, Table
from cnr_train.config import DataConfig, JobConfig, ModelConfig, OptimizerConfig
from cnr_train.job import Trainer, evaluate
from cnr_train.workload import train_step
from torchrec_cnr import CheckpointConfig
from torchrec_cnr.offline import checkpoint_info, list_checkpoints
from torchrec_cnr.recovery.interval import pls, young_interval
from torchrec_cnr.tracking.model_state import local_shards

LR = 0.05
RESCHEDULE_FRACS = (0.0, 0.001, 0.0025, 0.005, 0.01, 0.02)
"""Rescheduling costs (fractions of the MTBF) the result recomputes the ratio for."""
PARTS = ("save", "load", "lost", "resched")
TARGETS = [
    Goal("partial recovery overhead (best arm) <= 1/5 of full recovery's",
         "verdicts.best_partial_overhead_pct", "<=", "arms.full.overhead_pct", 0.2),
    Goal("AUC of the best partial arm within 0.001 of full recovery's",
         "verdicts.auc_diff_abs", "<=", 0.001),
]  # fmt: skip


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--mtbf-steps", type=float, default=500.0)
    p.add_argument("--shards", type=int, default=16, help="emulated embedding shards in all")
    p.add_argument("--pls-target", type=float, default=0.02)
    p.add_argument("--reschedule-frac", type=float, default=0.005, help="x MTBF per failure")
    p.add_argument("--budget-frac", type=float, default=0.25, help="MFU/SSU budget, x full/rank")
    p.add_argument("--prio-interval-frac", type=float, default=0.5, help="x partial interval")
    p.add_argument("--compact-every", type=int, default=4, help="MFU/SSU chains' compact_every")
    p.add_argument("--max-rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--eval-batches", type=int, default=40)
    p.add_argument("--probe-warmup", type=int, default=5)
    p.add_argument("--probe-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="seed of the failure pattern")
    p.add_argument("--arms", nargs="*", default=["full", "partial", "partial+mfu", "partial+ssu"])


def _trainer(a: argparse.Namespace, cfg: CheckpointConfig, tracking: Any) -> Trainer:
    """The same model, seeds and data for every arm; only checkpointing differs."""
    job = JobConfig(checkpoint=cfg, data=DataConfig(batch_size=a.batch_size),
                    model=ModelConfig(tables="criteo", max_rows=a.max_rows, dim=a.dim),
                    optimizer=OptimizerConfig(sparse_lr=LR, dense_lr=LR))  # fmt: skip
    return Trainer.build(job, seed=0, tracking_mode=tracking)


def _emulated_shards(t: Trainer, num_shards: int) -> list[list[str]]:
    """Each rank's tables in ``num_shards / world`` groups of about equal bytes (largest
    first into the lightest group); every rank's groups, in rank order."""
    world = dist.get_world_size()
    if num_shards % world:
        raise ValueError(f"--shards {num_shards} is not a multiple of {world} ranks")
    per_rank = num_shards // world
    local = sorted(((s.spec.rows * s.spec.cols, s.spec.table) for s in local_shards(t.model)),
                   reverse=True)  # fmt: skip
    if len(local) < per_rank:
        raise ValueError(f"a rank holds {len(local)} tables, fewer than {per_rank} shards")
    groups: list[list[str]] = [[] for _ in range(per_rank)]
    sizes = [0] * per_rank
    for size, table in local:
        i = sizes.index(min(sizes))
        groups[i].append(table)
        sizes[i] += size
    return [group for rank_groups in gathered(groups) for group in rank_groups]


def _probe(b: Bench) -> dict[str, Any]:
    """Step time, the time a save blocks training, one full checkpoint's bytes, the shards."""
    a, root = b.args, b.scratch / "probe"
    t = _trainer(a, CheckpointConfig(path=str(root), policy="intermittent"), "bitmap")
    shards = _emulated_shards(t, a.shards)
    for _ in range(a.probe_warmup):
        train_step(t.model, t.opt, t.data.next(b.rank))
    began = time.perf_counter()
    for _ in range(a.probe_steps):
        train_step(t.model, t.opt, t.data.next(b.rank))
    (step_s,) = max_over_ranks((time.perf_counter() - began) / a.probe_steps)
    stall, commit = timed_save(t.ckpt, t.data.position)
    t.ckpt.close()
    full_bytes = from_rank0(lambda: checkpoint_info(str(root)).bytes)
    rmtree(root)
    return {"step_s": step_s, "save_s": stall, "commit_s": commit, "full_bytes": full_bytes,
            "shards": shards}  # fmt: skip


def _failures(a: argparse.Namespace) -> list[tuple[int, int]]:
    """(step, shard) of every failure: exponential inter-arrival times in steps."""
    rng = random.Random(a.seed)
    out: list[tuple[int, int]] = []
    at = 0.0
    while True:
        at += rng.expovariate(1.0 / a.mtbf_steps)
        step = max(1, math.ceil(at))
        if step > a.steps:
            return out
        victim = rng.randrange(a.shards)
        if not out or step > out[-1][0]:
            out.append((step, victim))


def _arm(b: Bench, name: str, mode: str, cfg: CheckpointConfig, tracking: Any,
         plan: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """One arm over every failure: its overheads by part, checkpoints, PLS and quality."""
    a = b.args
    t = _trainer(a, cfg, tracking)
    fail_at = dict(plan["failures"])
    clock = dict.fromkeys(("train", "save", "load", "lost"), 0.0)
    lost_steps = pls_steps = 0

    def timed_local(part: str, fn: Any) -> Any:
        began = time.perf_counter()
        value = fn()
        clock[part] += time.perf_counter() - began
        return value

    timed_local("save", lambda: t.ckpt.save(0))  # the restore target of an early failure
    for step in range(1, a.steps + 1):
        timed_local("train", lambda: train_step(t.model, t.opt, t.data.next(b.rank)))
        timed_local("save", lambda s=step: t.ckpt.maybe_save(s))
        if step not in fail_at:
            continue
        timed_local("save", t.ckpt.wait)
        if mode == "full":
            restored = timed_local("load", t.ckpt.restore)
        else:
            victims = plan["shards"][fail_at[step]]
            restored = timed_local("load", lambda v=victims: t.ckpt.restore(tables=v))
        assert restored is not None and restored <= step
        if mode == "partial":
            pls_steps += step - restored
            continue
        assert t.data.position == restored, (t.data.position, restored)
        for redo in range(restored + 1, step + 1):
            timed_local("lost", lambda: train_step(t.model, t.opt, t.data.next(b.rank)))
            # No checkpoint falls in c+1..f (c is the latest committed); keep the loop honest.
            timed_local("lost", lambda r=redo: t.ckpt.maybe_save(r))
        lost_steps += step - restored
    t.ckpt.wait()
    metrics = evaluate(t.model, t.data, a.eval_batches)
    t.ckpt.close()
    infos = from_rank0(lambda: list_checkpoints(cfg.path))
    train_s, save_s, load_s, lost_s = max_over_ranks(*clock.values())
    interval = cfg.interval_steps
    assert isinstance(interval, int)
    failures, partial = len(plan["failures"]), mode == "partial"
    row: dict[str, Any] = {
        "arm": name, "mode": mode, "tracking": tracking, "policy": cfg.policy,
        "budget_mb": cfg.priority_budget_mb or 0.0, "compact_every": cfg.compact_every or 0,
        "interval_steps": interval, "checkpoints": sum(1 for i in infos if not i.compacted_from),
        "compactions": sum(1 for i in infos if i.compacted_from),
        "final_chain": len(infos[-1].chain), "written_mb": sum(i.bytes for i in infos) / 1e6,
        "failures": failures, "lost_steps": lost_steps, "train_s": train_s, "save_s": save_s,
        "load_s": load_s, "lost_s": lost_s, "resched_s": plan["resched_s"] * failures,
        "pls_measured": pls_steps / (a.shards * a.steps) if partial else 0.0,
        "pls_formula": pls(interval, a.mtbf_steps, a.shards) if partial else 0.0, **metrics,
    }  # fmt: skip
    for part in PARTS:
        row[f"{part}_pct"] = 100 * row[f"{part}_s"] / train_s
    row["overhead_pct"] = sum(row[f"{p}_pct"] for p in PARTS)
    b.log(f"{name}: every {interval} steps, {row['checkpoints']} ckpts: overhead "
          f"{row['overhead_pct']:.2f}%, AUC {row['auc']:.4f}, PLS {row['pls_measured']:.4f}")  # fmt: skip
    rmtree(b.scratch / name.replace("+", "_"))
    return row


def _verdicts(arms: dict[str, dict[str, Any]], mtbf_s: float) -> dict[str, Any]:
    """What the targets compare: full recovery against the best partial arm, and the
    ratio for other rescheduling costs (it is accounted, not slept: same run)."""
    full = arms.get("full")
    partial = [r for r in arms.values() if r["mode"] == "partial"]
    if full is None or not partial:
        return {}
    best = min(partial, key=lambda r: r["overhead_pct"])

    def total(r: dict[str, Any], frac: float) -> float:
        resched = 100 * frac * mtbf_s * r["failures"] / r["train_s"]
        return r["overhead_pct"] - r["resched_pct"] + resched

    return {
        "best_partial": best["arm"], "best_partial_overhead_pct": best["overhead_pct"],
        "full_over_best_partial": full["overhead_pct"] / max(best["overhead_pct"], 1e-12),
        "auc_diff_abs": abs(full["auc"] - best["auc"]),
        "by_reschedule_frac": {
            f"{frac:.2%}": {
                "full": total(full, frac), **{r["arm"]: total(r, frac) for r in partial},
                "ratio": total(full, frac) / max(min(total(r, frac) for r in partial), 1e-12),
            } for frac in RESCHEDULE_FRACS
        },
    }  # fmt: skip


def tables(m: dict[str, Any]) -> list[Table]:
    out = [Table.of("Arms", m["arms"].values(), {
        "arm": "arm", "interval (steps)": "interval_steps",
        "checkpoints (+ compactions)": lambda r: f"{r['checkpoints']} (+{r['compactions']})",
        "final chain": "final_chain", **{f"{p} %": f"{p}_pct" for p in ("overhead", *PARTS)},
        "PLS measured / formula": lambda r: f"{r['pls_measured']:.4f} / {r['pls_formula']:.4f}",
        "AUC": lambda r: f"{r['auc']:.4f}", "log loss": lambda r: f"{r['logloss']:.4f}",
    }, note=m["setting"])]  # fmt: skip
    by = m["verdicts"].get("by_reschedule_frac")
    if by:
        cols = [k for k in next(iter(by.values())) if k != "ratio"]
        out.append(Table("Full / best partial overhead % for other rescheduling costs (same run)",
                         ["rescheduling, % of MTBF", *cols, "ratio"],
                         [[frac, *(v[c] for c in cols), f"{v['ratio']:.2f}x"]
                          for frac, v in by.items()]))  # fmt: skip
    return out


def _plot(b: Bench, rows: list[dict[str, Any]], title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for part, label in zip(PARTS, ("save", "load", "lost computation", "rescheduling")):
        vals = [r[f"{part}_pct"] for r in rows]
        ax.bar(xs, vals, 0.6, bottom=bottom, label=label)
        bottom = [x + v for x, v in zip(bottom, vals)]
    for x, r, top in zip(xs, rows, bottom):
        ax.annotate(f"AUC {r['auc']:.4f}", (x, top), xytext=(0, 3), textcoords="offset points",
                    ha="center")  # fmt: skip
    ax.set_xticks(xs, [r["arm"] for r in rows])
    ax.set_ylabel("overhead, % of training time")
    ax.set_ylim(0, max(bottom) * 1.2 + 1e-9)
    ax.set_title(title)
    ax.legend()
    save_figure(fig, b.artifacts / "overhead.png")


def run(b: Bench) -> Outcome:
    a = b.args
    probe = _probe(b)
    mtbf_s = a.mtbf_steps * probe["step_s"]
    young_s = young_interval(max(probe["save_s"], 1e-6), mtbf_s)
    full_interval = max(1, round(young_s / probe["step_s"]))
    partial_interval = max(1, round(2 * a.mtbf_steps * a.shards * a.pls_target))
    prio_interval = max(1, round(partial_interval * a.prio_interval_frac))
    budget = a.budget_frac * probe["full_bytes"] / b.world / (1 << 20)
    plan = {"failures": _failures(a), "shards": probe["shards"],
            "resched_s": a.reschedule_frac * mtbf_s}  # fmt: skip
    setting = (
        f"{a.steps} steps, 26 Criteo tables x <= {a.max_rows} rows x dim {a.dim}, batch "
        f"{a.batch_size}/rank, {b.world} ranks, {a.shards} emulated shards. Probe: step "
        f"{probe['step_s'] * 1e3:.1f} ms, save blocks {probe['save_s'] * 1e3:.1f} ms, full "
        f"checkpoint {probe['full_bytes'] / 1e6:.1f} MB. MTBF {a.mtbf_steps:g} steps "
        f"({mtbf_s:.2f} s); Young's interval {young_s:.3f} s. PLS target {a.pls_target}; "
        f"rescheduling {a.reschedule_frac:.2%} of the MTBF per failure. "
        f"Failures (step, shard): {plan['failures']}."
    )
    b.log(setting)
    prio = {"policy": "consecutive", "priority_budget_mb": budget, "compact_every": a.compact_every}
    arms_spec: dict[str, tuple[str, int, dict[str, Any], str]] = {
        "full": ("full", full_interval, {"policy": "intermittent"}, "bitmap"),
        "partial": ("partial", partial_interval, {"policy": "intermittent"}, "bitmap"),
        "partial+mfu": ("partial", prio_interval, prio, "mfu"),
        "partial+ssu": ("partial", prio_interval, prio, "ssu"),
    }
    arms = {}
    for name in a.arms:
        mode, interval, extra, tracking = arms_spec[name]
        policy: Policy = extra["policy"]
        cfg = CheckpointConfig(path=str(b.scratch / name.replace("+", "_")), policy=policy,
                               interval_steps=interval,
                               priority_budget_mb=extra.get("priority_budget_mb"),
                               compact_every=extra.get("compact_every"))  # fmt: skip
        arms[name] = _arm(b, name, mode, cfg, tracking, plan)
    m = {"probe": probe, "mtbf_s": mtbf_s, "young_s": young_s, "resched_s": plan["resched_s"],
         "failures": plan["failures"], "setting": setting, "arms": arms,
         "verdicts": _verdicts(arms, mtbf_s)}  # fmt: skip
    if b.rank == 0:
        write_csv(b.artifacts / "results.csv", list(arms.values()))
        _plot(b, list(arms.values()), f"CPR: {len(plan['failures'])} failures of 1 in "
              f"{a.shards} shards in {a.steps} steps (MTBF {a.mtbf_steps:g} steps)")  # fmt: skip
    return Outcome(m, tables(m), TARGETS)


CASE = Case("experiments.cpr", "CPR recovery experiment", _arguments,
            "--steps 12 --mtbf-steps 5 --shards 4 --pls-target 0.1 --arms full partial+mfu "
            "--max-rows 500 --dim 8 --batch-size 32 --eval-batches 2 --probe-warmup 1 "
            "--probe-steps 2", run, kind="experiment")  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
