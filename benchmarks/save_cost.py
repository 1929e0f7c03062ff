"""Training time one checkpoint costs, from its save to its commit: eager staging, lazy
staging with the compiled copier, and lazy staging with torch's locked copy; fp32 and
4-bit.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=1 \\
        -m benchmarks.save_cost --out out/bench/save_cost.json

:mod:`benchmarks.overhead` measures whole intervals, one checkpoint each at the long ones,
on a machine whose other tenants move the pace of training by more than a checkpoint
costs. This case measures the checkpoints alone, many times: the model and training of
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
- lazy with ``TORCHREC_CNR_COMPILED_STAGING=0``: torch copies the rows under each
  kernel's lock, in chunks, the path CUDA takes (fp32).

Targets: the median cost of a lazy checkpoint <= an eager one's (fp32 and 4-bit), and a
lazy fp32 one's <= one copied by torch under the lock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch.distributed as dist

from benchmarks.harness import Bench, Case, Outcome, main
from benchmarks.measure import from_rank0, model_arguments, rmtree, uniform_model
from benchmarks.overhead import QUANTS, Trainer
from benchmarks.results import Goal, Table
from cnr_train.workload import ZipfBatches
from torchrec_cnr import CheckpointConfig, CheckpointManager, list_checkpoints

ARMS: dict[str, tuple[str, str, str]] = {
    "eager_fp32": ("eager", "1", "fp32"),
    "lazy_fp32": ("lazy", "1", "fp32"),
    "lazy_torch_fp32": ("lazy", "0", "fp32"),
    "eager_4bit": ("eager", "1", "4-bit"),
    "lazy_4bit": ("lazy", "1", "4-bit"),
}
"""Arm -> (staging, TORCHREC_CNR_COMPILED_STAGING, checkpoint format)."""
STAGING_NAMES = {
    ("eager", "1"): "eager",
    ("lazy", "1"): "lazy (compiled copier)",
    ("lazy", "0"): "lazy, torch copy under the lock",
}
SWITCH = "TORCHREC_CNR_COMPILED_STAGING"


def _arguments(p: argparse.ArgumentParser) -> None:
    model_arguments(p, rows=200_000)
    p.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    p.add_argument("--saves", type=int, default=8, help="checkpoints per arm")
    p.add_argument("--before", type=int, default=100, help="steps before each save")
    p.add_argument("--after", type=int, default=200, help="steps after it (past its commit)")
    p.add_argument("--warmup-steps", type=int, default=50, help="untimed training steps first")


def _one(
    b: Bench, trainer: Trainer, staging: str, switch: str, quant: str, n: int
) -> dict[str, float]:
    """One checkpoint of one arm: its stall, commit and the training time it cost."""
    root = b.scratch / f"{staging}_{switch}_{quant}_{n}"
    rmtree(root)
    os.environ[SWITCH] = switch  # read at each save
    cfg = CheckpointConfig(
        path=str(root),
        policy="full",
        staging=staging,  # type: ignore[arg-type]
        quantize=QUANTS[quant],
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


def run(b: Bench) -> Outcome:
    a = b.args
    work = uniform_model(a)
    trainer = Trainer(work, ZipfBatches(work.tables, a.batch, seed=0), b.rank)
    trainer.train(a.warmup_steps)
    each: dict[str, list[dict[str, float]]] = {name: [] for name in ARMS}
    names = list(ARMS)
    before = os.environ.get(SWITCH)
    try:
        for n in range(a.saves):
            for name in names[n % len(names) :] + names[: n % len(names)]:
                b.settle()
                each[name].append(_one(b, trainer, *ARMS[name], n))
            b.log(
                f"save {n + 1}/{a.saves}: "
                + ", ".join(f"{k} {v[-1]['cost_s'] * 1e3:.0f} ms" for k, v in each.items())
            )
    finally:
        if before is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = before
    arms = {
        name: {
            "staging": STAGING_NAMES[ARMS[name][:2]],
            "checkpoint": ARMS[name][2],
            "cost_s": statistics.median(r["cost_s"] for r in rs),
            "costs_s": [r["cost_s"] for r in rs],
            "stall_s": statistics.median(r["stall_s"] for r in rs),
            "commit_s": statistics.median(r["commit_s"] for r in rs),
            "steps_overlapped": statistics.median(r["steps"] for r in rs),
        }
        for name, rs in each.items()
    }
    m = {
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


CASE = Case(
    name="save_cost",
    title="Training time one checkpoint costs: eager, lazy, lazy with torch's locked copy",
    arguments=_arguments,
    smoke="--tables 2 --rows 4000 --dim 16 --batch 64 --saves 1 --before 5 --after 40 "
    "--warmup-steps 3",
    run=run,
)

if __name__ == "__main__":
    sys.exit(main(CASE, __doc__))
