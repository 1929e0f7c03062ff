"""The scaling curve: stall, commit, restore and peak host memory per rank against the
embedding bytes each rank holds, for full saves and 5%/25% deltas, fp32 and 4-bit.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_scaling.py \\
        --out out/bench_scaling

For each size in ``--gb-per-rank`` (default 0.25 0.5 1 2 4, what 24 GiB of host memory
allows: the model, a staging pool as large as a full checkpoint, and a restore's reads)
the model is 2 x ``--gb-per-rank`` GB of table-wise tables of ``--rows`` x 64 fp32 with
fused row-wise Adagrad on 2 gloo ranks. For fp32 and for 4-bit adaptive, one manager
with the ``intermittent`` policy takes a full baseline, then a delta with 5% and then
with 25% of each shard's rows modified (the 5% inside the 25%); each checkpoint is
restored cold (page cache dropped) right after its commit, through the same manager.

Per rank (the maximum over ranks): stall (inside ``save``), commit (until ``wait``
returns), restore, and the peak resident memory above what the process held before the
manager was built (the staging pool counts; ``/proc/self/clear_refs`` resets the peak).
The disk's write and read bandwidth and a memory copy of one rank's embeddings are
measured in the same run, and each figure is extrapolated linearly to ``--extrapolate``
GB per rank (default 100) from the rate of the largest size, naming the resource that
bounds it. Writes ``scaling.csv``, ``scaling.json`` and ``scaling.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cnr_train.bench.common import (
    GB,
    disk_bandwidth,
    drop_cache,
    log,
    max_over_ranks,
    memcpy_s,
    modify,
    proc_status_mb,
    rmtree,
    scratch_dir,
    timed,
)
from cnr_train.workload import TableSpec, build_model, dense_optimizer
from torchrec_cnr import CheckpointConfig, CheckpointManager, QuantizeConfig
from torchrec_cnr.tracking import model_state

COMMAND = (
    "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_scaling.py "
    "--out out/bench_scaling"
)
QUANTS = {"fp32": QuantizeConfig(), "4-bit": QuantizeConfig(method="adaptive", bits=4)}
FIGURES = ("stall_s", "commit_s", "restore_s", "peak_mb")


def _reset_peak() -> float:
    """Resets the peak resident set size to the current one; returns it in MB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status_mb("VmRSS")


def _checkpoint(ckpt: CheckpointManager, root: Path, step: int, base_mb: float) -> dict[str, float]:
    """One save, timed, then its cold restore through the same manager."""
    stall, _ = timed(lambda: ckpt.save(step))
    commit, _ = timed(ckpt.wait)
    save_peak = max_over_ranks(proc_status_mb("VmHWM") - base_mb)
    drop_cache(root)
    restore, _ = timed(lambda: ckpt.restore(step=step))
    return {
        "stall_s": stall,
        "commit_s": stall + commit,
        "restore_s": restore,
        "peak_mb": max(save_peak, max_over_ranks(proc_status_mb("VmHWM") - base_mb)),
    }


def _size(args: argparse.Namespace, bench: Path, gb: float) -> list[dict[str, Any]]:
    world = dist.get_world_size()
    per_table = args.rows * 64 * 4
    n = max(1, round(gb * GB / per_table)) * world
    tables = [TableSpec(f"t{i}", args.rows, 64, "table_wise") for i in range(n)]
    model = build_model(tables, seed=0)
    dense_optimizer(model)
    shards = model_state.local_shards(model)
    local_gb = max_over_ranks(sum(s.weight.numel() * 4 for s in shards) / GB)
    log(f"{n} tables x {args.rows} rows x 64: {local_gb:.2f} GB per rank")
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    perms = [torch.randperm(s.spec.rows, generator=g) for s in shards]
    rows: list[dict[str, Any]] = []
    for quant, qcfg in QUANTS.items():
        root = bench / f"{gb}_{quant}"
        rmtree(root)
        gc.collect()
        base = _reset_peak()
        cfg = CheckpointConfig(path=str(root), policy="intermittent", quantize=qcfg)
        with CheckpointManager(model, cfg) as ckpt:
            for step, frac in enumerate((1.0, 0.05, 0.25), start=1):
                if frac < 1:
                    modify(shards, [p[: round(frac * p.numel())].sort().values for p in perms])
                got = _checkpoint(ckpt, root, step, base)
                row = {"gb_per_rank": local_gb, "quant": quant, "saved": frac, **got}
                rows.append(row)
                log(
                    f"{local_gb:.2f} GB/rank {quant} {'full' if frac == 1 else f'{frac:.0%}'}: "
                    + ", ".join(f"{k} {got[k]:.3f}" for k in FIGURES)
                )
        del ckpt  # its staging buffers go before the next manager takes its own
        rmtree(root)
    del model, shards, perms
    gc.collect()
    return rows


def _extrapolate(rows: list[dict[str, Any]], limits: dict[str, float], target: float) -> list[str]:
    """Each figure at ``target`` GB per rank, scaled from the largest size's rate."""
    top = max(r["gb_per_rank"] for r in rows)
    bound = {
        "stall_s": f"memory copy, {limits['memcpy_gb_s']:.1f} GB/s per rank",
        "commit_s": f"disk write, {limits['write_gb_s']:.2f} GB/s for the whole machine",
        "restore_s": f"disk read, {limits['read_gb_s']:.2f} GB/s for the whole machine",
        "peak_mb": "the staging pool (a full checkpoint; staging_memory_mb caps it)",
    }
    lines = [
        f"\nExtrapolated to {target:g} GB per rank from the {top:.2f} GB/rank rates (linear):",
        "",
        f"| checkpoint | {' | '.join(FIGURES)} |",
        f"|---|{'---:|' * len(FIGURES)}",
    ]
    for r in rows:
        if r["gb_per_rank"] != top:
            continue
        scale = target / top
        what = f"{r['quant']} {'full' if r['saved'] == 1 else format(r['saved'], '.0%')}"
        lines.append(f"| {what} | " + " | ".join(f"{r[k] * scale:,.1f}" for k in FIGURES) + " |")
    lines += ["", "Bounded by: " + "; ".join(f"{k}: {v}" for k, v in bound.items())]
    return lines


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    titles = {
        "stall_s": "stall (s)",
        "commit_s": "commit (s)",
        "restore_s": "restore, cold (s)",
        "peak_mb": "peak host memory above the model (MB)",
    }
    for ax, key in zip(axes, FIGURES):
        for quant, style in (("fp32", "-"), ("4-bit", "--")):
            for saved, color in ((1.0, "C0"), (0.25, "C1"), (0.05, "C2")):
                pts = [r for r in rows if r["quant"] == quant and r["saved"] == saved]
                label = f"{quant} {'full' if saved == 1 else f'{saved:.0%} delta'}"
                ax.plot(
                    [r["gb_per_rank"] for r in pts],
                    [r[key] for r in pts],
                    style,
                    color=color,
                    marker="o",
                    label=label,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("embedding GB per rank")
        ax.set_title(titles[key])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("torchrec_cnr scaling, 2 ranks on 2 CPU cores (intermittent policy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gb-per-rank", type=float, nargs="+", default=[0.25, 0.5, 1, 2, 4])
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table (dim 64)")
    p.add_argument("--extrapolate", type=float, default=100.0, help="GB per rank")
    p.add_argument("--out", type=Path, default=Path("out/bench_scaling"))
    args = p.parse_args()
    dist.init_process_group("gloo")
    scratch = None
    try:
        scratch = scratch_dir("bench_scaling_")
        disk = disk_bandwidth(scratch, 2 << 30, 64 << 20, 2)
        limits = {
            "write_gb_s": disk["write_gb_s"],
            "read_gb_s": disk["read_gb_s"],
            "memcpy_gb_s": 1.0 / memcpy_s(int(GB)),
        }
        log(", ".join(f"{k} {v:.2f}" for k, v in limits.items()))
        rows = [r for gb in args.gb_per_rank for r in _size(args, scratch, gb)]
        if dist.get_rank() == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            with open(args.out / "scaling.csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
            (args.out / "scaling.json").write_text(
                json.dumps({"command": COMMAND, "limits": limits, "rows": rows}, indent=1)
            )
            _plot(rows, args.out / "scaling.png")
            print(f"command: {COMMAND}\n{', '.join(f'{k} {v:.2f}' for k, v in limits.items())}\n")
            print(f"| GB/rank | checkpoint | {' | '.join(FIGURES)} |")
            print(f"|---:|---|{'---:|' * len(FIGURES)}")
            for r in rows:
                what = f"{r['quant']} {'full' if r['saved'] == 1 else format(r['saved'], '.0%')}"
                print(
                    f"| {r['gb_per_rank']:.2f} | {what} | "
                    + " | ".join(f"{r[k]:.3f}" for k in FIGURES)
                    + " |"
                )
            print("\n".join(_extrapolate(rows, limits, args.extrapolate)))
            print(f"\nwrote {args.out}/scaling.csv, scaling.json, scaling.png")
        dist.barrier()
    finally:
        if scratch is not None and dist.get_rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
