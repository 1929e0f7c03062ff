"""Bytes written and bytes stored at each interval, per policy (Check-N-Run Figs. 15 and 16).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_policies.py \
        --json out/bench_policies.json

Each policy trains the same model on the same Zipf batches and checkpoints at
every interval with ``keep_last=1``, so the root holds only what restoring the
latest checkpoint needs: "stored" is measured on disk after each commit.
"Written" is the bytes of the checkpoint just committed. Both are relative to
one full checkpoint of the model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from cnr_train.bench.common import scratch_dir
from cnr_train.workload import TableSpec, ZipfBatches, build_model, dense_optimizer, train_step
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.commit import Manifest, saved_fraction
from torchrec_cnr.selection import POLICIES
from torchrec_cnr.selection.policy import PolicyName
from torchrec_cnr.storage.fs import tree_bytes


def _run_policy(policy: PolicyName, root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    rank = dist.get_rank()
    if rank == 0 and root.exists():
        shutil.rmtree(root)
    dist.barrier()
    tables = [TableSpec(f"t{i}", args.rows, args.dim, "table_wise") for i in range(args.tables)]
    model = build_model(tables, seed=0)
    opt = dense_optimizer(model)
    data = ZipfBatches(tables, args.batch_size, alpha=args.alpha, pooling=args.pooling, seed=0)
    ckpt = CheckpointManager(
        model,
        CheckpointConfig(path=str(root), policy=policy, keep_last=1),
        {"reader": data, "dense_opt": opt},
    )
    rows: list[dict[str, Any]] = []
    for interval in range(1, args.intervals + 1):
        for _ in range(args.steps_per_interval):
            train_step(model, opt, data.next(rank))
        ckpt.save(interval * args.steps_per_interval)
        ckpt.wait()
        if rank == 0:
            entry = Manifest.load(root).latest()
            assert entry is not None
            modified = saved_fraction(entry.shards)
            rows.append(
                {
                    "interval": interval,
                    "kind": entry.kind,
                    "rows_saved_frac": modified,
                    "written_bytes": entry.bytes,
                    "stored_bytes": tree_bytes(root),
                    "chain_len": len(entry.chain),
                }
            )
        dist.barrier()
    return rows


def _write_figures(
    args: argparse.Namespace, results: Mapping[str, list[dict[str, Any]]], full: float
) -> None:
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "policy",
                "interval",
                "kind",
                "rows_saved_frac",
                "written_bytes",
                "stored_bytes",
                "written_rel",
                "stored_rel",
            ]
        )
        for policy, rows in results.items():
            for r in rows:
                w.writerow(
                    [
                        policy,
                        r["interval"],
                        r["kind"],
                        r["rows_saved_frac"],
                        r["written_bytes"],
                        r["stored_bytes"],
                        r["written_bytes"] / full,
                        r["stored_bytes"] / full,
                    ]
                )
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for policy, rows in results.items():
        xs = [r["interval"] for r in rows]
        axes[0].plot(xs, [r["written_bytes"] / full for r in rows], marker="o", label=policy)
        axes[1].plot(xs, [r["stored_bytes"] / full for r in rows], marker="o", label=policy)
    axes[0].set_title("Fig. 15: written per interval")
    axes[1].set_title("Fig. 16: stored after each interval")
    for ax in axes:
        ax.set_xlabel("interval")
        ax.set_ylabel("x one full checkpoint")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "fig15_16.png", dpi=110)
    total_full = sum(r["written_bytes"] for r in results["full"])
    lines = [
        "| policy | written (x less than full) | peak stored (full checkpoints) |",
        "|---|---:|---:|",
    ]
    for policy, rows in results.items():
        written = sum(r["written_bytes"] for r in rows)
        lines.append(
            f"| {policy} | {total_full / written:.2f}x | {max(r['stored_bytes'] for r in rows) / full:.2f} |"
        )
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--pooling", type=int, default=2)
    parser.add_argument("--alpha", type=float, default=1.1)
    parser.add_argument("--intervals", type=int, default=12)
    parser.add_argument("--steps-per-interval", type=int, default=20)
    parser.add_argument(
        "--root", type=Path, default=None, help="scratch directory (default: a temp dir)"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--out", type=Path, help="also write results.csv, fig15_16.png and summary.md here"
    )
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    scratch = None
    try:
        if args.root is None:
            scratch = args.root = scratch_dir("bench_policies_")
        results: dict[str, list[dict[str, Any]]] = {
            policy: _run_policy(policy, args.root / policy, args) for policy in POLICIES
        }
        if dist.get_rank() == 0:
            full = results["full"][0]["written_bytes"]
            print(
                f"\n{args.tables} tables x {args.rows} rows x dim {args.dim} on {dist.get_world_size()} ranks, "
                f"batch {args.batch_size}/rank, pooling {args.pooling}, Zipf {args.alpha}, "
                f"{args.steps_per_interval} steps/interval; one full checkpoint = {full / 1e6:.1f} MB"
            )
            print("\nwritten per interval / full checkpoint (kind: F full, d delta)")
            print("| interval | rows modified | " + " | ".join(f"{p:>12}" for p in POLICIES) + " |")
            print("|---:|---:|" + "---:|" * len(POLICIES))
            for i in range(args.intervals):
                cells = [
                    f"{results[p][i]['written_bytes'] / full:>10.3f} {results[p][i]['kind'][0].upper() if results[p][i]['kind'] == 'full' else 'd'}"
                    for p in POLICIES
                ]
                print(
                    f"| {i + 1:>8} | {results['consecutive'][i]['rows_saved_frac']:>12.1%} | "
                    + " | ".join(cells)
                    + " |"
                )
            print("\nstored after each interval / full checkpoint")
            print("| interval | " + " | ".join(f"{p:>12}" for p in POLICIES) + " |")
            print("|---:|" + "---:|" * len(POLICIES))
            for i in range(args.intervals):
                cells = [f"{results[p][i]['stored_bytes'] / full:>12.3f}" for p in POLICIES]
                print(f"| {i + 1:>8} | " + " | ".join(cells) + " |")
            print("\ntotals over all intervals (x = full policy / this policy)")
            total_full = sum(r["written_bytes"] for r in results["full"])
            for p in POLICIES:
                written = sum(r["written_bytes"] for r in results[p])
                peak = max(r["stored_bytes"] for r in results[p])
                print(
                    f"  {p:<13} written {written / 1e6:8.1f} MB ({total_full / written:5.2f}x less than full), peak stored {peak / full:5.2f} full checkpoints"
                )
            if args.out:
                _write_figures(args, results, full)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(
                    json.dumps(
                        {
                            "args": {k: str(v) for k, v in vars(args).items()},
                            "full_bytes": full,
                            "results": results,
                        },
                        indent=1,
                    )
                )
        dist.barrier()  # leave together: gloo aborts a rank whose peer tears down first
    finally:
        if scratch is not None and dist.get_rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
