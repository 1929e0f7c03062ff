"""Iteration time and memory of row tracking: none, torchrec_cnr's bitmaps, and
TorchRec's ModelDeltaTracker (ID_ONLY), on one model in one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_tracking.py \
        --json out/bench_tracking.json

The three variants are built from the same seed and trained on the same
batches. Timings interleave the variants round by round so that machine noise
hits all three alike; the reported figure is the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

from torchrec_cnr import model_state
from torchrec_cnr.workload import TableSpec, ZipfBatches, build_model, dense_optimizer, train_step


def _mdt_bytes(tracker: object) -> int:
    store = tracker.store  # type: ignore[attr-defined]
    total = 0
    for lookups in store.per_fqn_lookups.values():
        for lookup in lookups:
            for t in (lookup.ids, getattr(lookup, "states", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--pooling", type=int, default=4)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--iters", type=int, default=10, help="iterations per variant per round")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        tables = [TableSpec(f"t{i}", args.rows, args.dim, "table_wise") for i in range(args.tables)]
        data = ZipfBatches(tables, args.batch_size, pooling=args.pooling, seed=0)
        variants = {}
        for name in ("none", "torchrec_cnr", "ModelDeltaTracker"):
            model = build_model(tables, seed=0, tracking=name == "torchrec_cnr")
            if name == "ModelDeltaTracker":
                mdt = model.init_torchrec_delta_tracker(
                    DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, delete_on_read=True)
                )
            variants[name] = (model, dense_optimizer(model))
        batches = [data.batch(rank, s) for s in range(args.iters)]
        for model, opt in variants.values():  # warm-up
            for b in batches[:3]:
                train_step(model, opt, b)
        times: dict[str, list[float]] = {n: [] for n in variants}
        total_iters = 3
        for _ in range(args.rounds):
            for name, (model, opt) in variants.items():
                dist.barrier()
                t0 = time.perf_counter()
                for b in batches:
                    train_step(model, opt, b)
                dist.barrier()
                times[name].append((time.perf_counter() - t0) / len(batches))
            total_iters += len(batches)
        med = {n: statistics.median(v) for n, v in times.items()}
        ours = model_state.trackers(variants["torchrec_cnr"][0])
        mem_ours = sum(t.memory_bytes() for t in ours.values())
        mem_mdt = _mdt_bytes(mdt)
        emb_bytes = sum(
            s.weight.numel() * s.weight.element_size()
            for s in model_state.local_shards(variants["torchrec_cnr"][0])
        )
        rows = [
            {
                "variant": n,
                "iter_ms": 1e3 * med[n],
                "overhead_pct": 100 * (med[n] / med["none"] - 1),
                "memory_bytes": {"none": 0, "torchrec_cnr": mem_ours, "ModelDeltaTracker": mem_mdt}[
                    n
                ],
            }
            for n in med
        ]
        gathered: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            print(
                f"\n{args.tables} tables x {args.rows} rows x dim {args.dim}, batch {args.batch_size}/rank, "
                f"pooling {args.pooling}; {args.rounds} rounds x {args.iters} iters; "
                f"memory after {total_iters} iterations (rank 0; its shards hold {emb_bytes / 1e6:.0f} MB)"
            )
            print(
                f"| {'variant':<18} | {'iter ms':>8} | {'overhead':>8} | {'tracker memory':>16} |"
            )
            print(f"|{'-' * 20}|{'-' * 10}|{'-' * 10}|{'-' * 18}|")
            for r in rows:
                print(
                    f"| {r['variant']:<18} | {r['iter_ms']:>8.2f} | {r['overhead_pct']:>7.2f}% | "
                    f"{r['memory_bytes'] / 1e6:>13.3f} MB |"
                )
            ours_pct = rows[1]["overhead_pct"]
            mdt_pct = rows[2]["overhead_pct"]
            print(
                f"\nours overhead {ours_pct:.2f}% (target <= 1%): {'PASS' if ours_pct <= 1 else 'MISS'}"
            )
            print(
                f"ours vs ModelDeltaTracker {ours_pct:.2f}% vs {mdt_pct:.2f}% (target ours <= theirs): "
                f"{'PASS' if ours_pct <= mdt_pct else 'MISS'}"
            )
            print(
                f"memory: ours {mem_ours / emb_bytes * 100:.4f}% of the shards' bytes, theirs {mem_mdt / emb_bytes * 100:.4f}%"
            )
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(
                    json.dumps(
                        {"args": vars(args) | {"json": str(args.json)}, "per_rank": gathered},
                        indent=1,
                    )
                )
        dist.barrier()  # leave together: gloo aborts a rank whose peer tears down first
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
