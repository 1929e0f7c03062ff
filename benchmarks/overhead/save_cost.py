"""``--save-cost`` of :mod:`benchmarks.overhead`: the training time one full checkpoint costs
(its stall plus what the steps to its commit took beyond the mean of the others), ``--saves``
times per arm in turns: eager and lazy, fp32 and 4-bit, and lazy with torch's locked copy.
Targets: lazy <= eager, and <= torch's copy.
"""

from __future__ import annotations

import statistics

import torch.distributed as dist

from benchmarks.harness import Bench, Outcome
from benchmarks.measure import QUANTS, StepLoop, from_rank0, gathered, rmtree
from benchmarks.overhead import now, split_steps
from benchmarks.results import Goal, Table
from torchrec_cnr import CheckpointConfig, CheckpointManager, IOOptions
from torchrec_cnr.offline import list_checkpoints

COST_ARMS: dict[str, tuple[str, bool, str]] = {
    "eager_fp32": ("eager", True, "fp32"), "lazy_fp32": ("lazy", True, "fp32"),
    "lazy_torch_fp32": ("lazy", False, "fp32"),
    "eager_4bit": ("eager", True, "4-bit"), "lazy_4bit": ("lazy", True, "4-bit"),
}  # fmt: skip
"""``--save-cost`` arm -> (staging, ``IOOptions.compiled_staging``, checkpoint format)."""
MORE_ROUNDS = 10  # rounds of --after steps a slow commit may take beyond the first
STAGING_NAMES = {("eager", True): "eager", ("lazy", True): "lazy (compiled copier)",
                 ("lazy", False): "lazy, torch copy under the lock"}  # fmt: skip


def _save_cost_once(b: Bench, trainer: StepLoop, staging: str, compiled: bool, quant: str,
                    n: int) -> dict[str, float]:  # fmt: skip
    """One checkpoint of one arm: its stall, commit and the training time it cost."""
    root = b.scratch / f"{staging}_{compiled}_{quant}_{n}"
    rmtree(root)
    cfg = CheckpointConfig(str(root), policy="full", staging=staging,  # type: ignore[arg-type]
                           quantize=QUANTS[quant], io=IOOptions(compiled_staging=compiled))  # fmt: skip
    ends: list[float] = []
    with CheckpointManager(trainer.work.model, cfg) as ckpt:
        took = trainer.train(b.args.before, lambda _: ends.append(now()))
        dist.barrier()
        saved_at = now()
        ckpt.save(trainer.step)
        stall = now() - saved_at
        # On until the commit has landed (a busy machine can slow it past --after steps), so
        # that the steps it overlapped are all counted; the ranks agree by rank 0's manifest.
        for _ in range(MORE_ROUNDS + 1):
            took += trainer.train(b.args.after, lambda _: ends.append(now()))
            if from_rank0(lambda: bool(list_checkpoints(str(root)))):
                break
        ckpt.wait()
    info = from_rank0(lambda: list_checkpoints(str(root))[-1])
    rmtree(root)
    if info.committed_at >= ends[-1]:
        raise RuntimeError(f"the commit outlasted {MORE_ROUNDS + 1} x --after "
                           f"{b.args.after} steps: raise it")  # fmt: skip
    inside, others = split_steps(took, ends, [(saved_at, info.committed_at)])
    clean = statistics.fmean(others)
    cost = stall + sum(inside) - clean * len(inside)
    worst = max(gathered((cost, stall, info.committed_at - saved_at, clean)))  # the slowest rank's
    return {"cost_s": worst[0], "stall_s": worst[1], "commit_s": worst[2], "step_s": worst[3],
            "steps": len(inside)}  # fmt: skip


def run(b: Bench) -> Outcome:
    """The training time one full checkpoint costs, per arm."""
    a = b.args
    trainer = StepLoop.warm(a, a.batch, a.warmup_steps)
    each: dict[str, list[dict[str, float]]] = {name: [] for name in COST_ARMS}

    def once(name: str) -> float:
        each[name].append(_save_cost_once(b, trainer, *COST_ARMS[name], len(each[name])))
        return each[name][-1]["cost_s"]

    b.interleaved(a.saves, COST_ARMS, once, label="cost s")
    arms = {
        name: {"staging": STAGING_NAMES[COST_ARMS[name][:2]], "checkpoint": COST_ARMS[name][2],
               "cost_s": statistics.median(r["cost_s"] for r in rs),
               "costs_s": [r["cost_s"] for r in rs],
               "stall_s": statistics.median(r["stall_s"] for r in rs),
               "commit_s": statistics.median(r["commit_s"] for r in rs),
               "steps_overlapped": statistics.median(r["steps"] for r in rs)}
        for name, rs in each.items()
    }  # fmt: skip
    m = {"mode": "save_cost",
         "model": {"tables": a.tables, "rows": a.rows, "dim": a.dim, "batch": a.batch},
         "world_size": b.world,
         "step_s": statistics.median(r["step_s"] for rs in each.values() for r in rs),
         "arms": arms}  # fmt: skip
    table = Table.of(
        f"Training time one full checkpoint costs (median of {a.saves}, {b.world} rank(s))",
        list(arms.values()),
        {"staging": "staging", "checkpoint": "checkpoint", "cost ms": lambda r: r["cost_s"] * 1e3,
         "each ms": lambda r: ", ".join(f"{x * 1e3:.0f}" for x in r["costs_s"]),
         "stall ms": lambda r: r["stall_s"] * 1e3, "commit s": "commit_s",
         "steps overlapped": "steps_overlapped"},
        "Cost: the stall plus what the steps from the save to the commit took beyond the "
        "mean step outside that window, the slowest rank's.",
    )  # fmt: skip
    targets = [
        Goal(f"lazy {q} checkpoint costs <= eager's", f"arms.lazy_{k}.cost_s", "<=",
               f"arms.eager_{k}.cost_s")
        for q, k in (("fp32", "fp32"), ("4-bit", "4bit"))
    ] + [
        Goal("lazy fp32 checkpoint costs <= lazy with torch's locked copy",
               "arms.lazy_fp32.cost_s", "<=", "arms.lazy_torch_fp32.cost_s"),
    ]  # fmt: skip
    return Outcome(m, [table], targets)
