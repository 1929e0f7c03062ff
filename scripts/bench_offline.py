"""Export and compaction of a ~1 GB chain, against a full save and the disk.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_offline.py

The model is ``--tables`` table-wise tables of ``--rows`` x ``--dim`` fp32 (8 x 500k x 64,
1.02 GB) on 2 gloo ranks with fused row-wise Adagrad. A consecutive chain is built: a full
baseline, then ``--deltas`` deltas that each modify ``--fraction`` of the rows. In one run:

- compaction inside the job (``CheckpointManager.compact()`` until ``wait()`` returns),
  against a full save of the same model (the peer: what a new baseline costs), and the
  restore of that step before and after compaction (cold page cache);
- after the job, in one process without a model: ``export_state_dict`` and writing it
  with ``torch.save`` (``cnr export``), ``read_table`` of one table, and an offline
  ``cnr compact`` of a second, identical chain; against reading as many bytes from disk.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cnr_train.bench.common import (
    GB,
    bcast,
    disk_bandwidth,
    drop_cache,
    evict,
    log,
    modify,
    rmtree,
    scratch_dir,
    timed,
)
from cnr_train.workload import TableSpec, build_model, dense_optimizer
from torchrec_cnr import CheckpointConfig, CheckpointManager, export_state_dict, read_table
from torchrec_cnr.cli import main as cnr
from torchrec_cnr.commit import Manifest
from torchrec_cnr.offline import save_export
from torchrec_cnr.tracking import model_state

COMMAND = "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_offline.py"


def _commit(ckpt: CheckpointManager, step: int) -> None:
    ckpt.save(step)
    ckpt.wait()


def _settled(ckpt: CheckpointManager) -> bool:
    ckpt.wait()
    return True


def _chain(root: str, model: torch.nn.Module, deltas: int, fraction: float) -> CheckpointManager:
    """A consecutive chain of a baseline and ``deltas`` deltas; the manager stays open."""
    shards = model_state.local_shards(model)
    g = torch.Generator().manual_seed(dist.get_rank())
    ckpt = CheckpointManager(model, CheckpointConfig(path=root, policy="consecutive"))
    _commit(ckpt, 1)
    for step in range(2, deltas + 2):
        rows = [
            torch.randperm(s.spec.rows, generator=g)[: int(fraction * s.spec.rows)] for s in shards
        ]
        modify(shards, [r.sort().values for r in rows])
        _commit(ckpt, step)
    return ckpt


def _in_job(scratch: Path, model: torch.nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    root = scratch / "in_job"
    ckpt = _chain(str(root), model, args.deltas, args.fraction)
    step = args.deltas + 1
    drop_cache(root)
    restore_chain, _ = timed(lambda: ckpt.restore(step))
    compact_s, _ = timed(lambda: ckpt.compact() and _settled(ckpt))
    drop_cache(root)
    restore_one, _ = timed(lambda: ckpt.restore(step))
    ckpt.close()
    # The peer: a full save of the same state, committed (what a fresh baseline costs).
    with CheckpointManager(
        model, CheckpointConfig(path=str(scratch / "full"), policy="full")
    ) as full:
        full_s, _ = timed(lambda: _commit(full, step))
    manifest = Manifest.load(str(root))
    latest = manifest.latest()
    assert latest is not None and latest.compacted_from and len(latest.chain) == 1
    chain_bytes = sum(manifest.by_id(i).bytes for i in manifest.by_id(latest.compacted_from).chain)
    return {
        "compact_s": compact_s,
        "full_save_s": full_s,
        "restore_chain_s": restore_chain,
        "restore_compacted_s": restore_one,
        "chain_bytes": chain_bytes,
        "compacted_bytes": latest.bytes,
    }


def _offline(root: Path, out: Path) -> dict[str, Any]:
    """In this process alone, without a model or a process group."""
    manifest = Manifest.load(str(root))
    latest = manifest.latest()
    assert latest is not None
    read_bytes = sum(manifest.by_id(i).bytes for i in latest.chain)
    times: dict[str, list[float]] = {"export": [], "save": [], "table": []}
    for _ in range(3):
        evict(root)
        t0 = time.perf_counter()
        state_dict = export_state_dict(str(root))
        times["export"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        save_export(state_dict, out, "torch")
        times["save"].append(time.perf_counter() - t0)
        out.unlink()
        del state_dict
        evict(root)
        t0 = time.perf_counter()
        read_table(str(root), "t0")
        times["table"].append(time.perf_counter() - t0)
    evict(root)
    t0 = time.perf_counter()
    assert cnr(["compact", str(root)]) == 0
    compact_s = time.perf_counter() - t0
    return {
        "read_bytes": read_bytes,
        "export_s": statistics.median(times["export"]),
        "save_s": statistics.median(times["save"]),
        "table_s": statistics.median(times["table"]),
        "offline_compact_s": compact_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--deltas", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=0.05)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        tables = [TableSpec(f"t{i}", args.rows, args.dim, "table_wise") for i in range(args.tables)]
        model = build_model(tables, seed=0)
        dense_optimizer(model)
        scratch = scratch_dir("bench_offline_")
        disk = disk_bandwidth(scratch, 1 << 30, 8 << 20, passes=2)
        log("chain in a job, compacted by the job")
        job = _in_job(scratch, model, args)
        log("second chain, then export and offline compaction in one process")
        _chain(str(scratch / "offline"), model, args.deltas, args.fraction).close()
        dist.barrier()
        off = bcast(
            _offline(scratch / "offline", scratch / "export.pt") if dist.get_rank() == 0 else None
        )
        if dist.get_rank() == 0:
            _report(args, disk, job, off)
        rmtree(scratch)
    finally:
        dist.destroy_process_group()
    return 0


def _report(args: argparse.Namespace, disk: dict, job: dict, off: dict) -> None:
    model_gb = args.tables * args.rows * args.dim * 4 / GB
    read_disk_s = off["read_bytes"] / GB / disk["read_gb_s"]
    print(
        f"\n{args.tables} tables x {args.rows} rows x dim {args.dim} fp32 ({model_gb:.2f} GB) on "
        f"{dist.get_world_size()} ranks; consecutive chain of a baseline and {args.deltas} deltas "
        f"of {args.fraction:.0%} ({job['chain_bytes'] / GB:.2f} GB stored); disk: write "
        f"{disk['write_gb_s']:.2f} GB/s, read {disk['read_gb_s']:.2f} GB/s\n\n{COMMAND}\n"
    )
    print("| figure | time | peer, same run |")
    print("|---|---:|---|")
    ratio = job["compact_s"] / job["full_save_s"]
    print(
        f"| compaction in the job (`compact()` to `wait()`) | {job['compact_s']:.2f} s | full save "
        f"of the same model {job['full_save_s']:.2f} s ({ratio:.2f}x) |"
    )
    print(f"| compaction offline (`cnr compact`, 1 process) | {off['offline_compact_s']:.2f} s | |")
    print(
        f"| restore of that step, chain of {args.deltas + 1} | {job['restore_chain_s']:.2f} s | "
        f"after compaction: {job['restore_compacted_s']:.2f} s |"
    )
    print(
        f"| `export_state_dict` (1 process, cold cache) | {off['export_s']:.2f} s | reading its "
        f"{off['read_bytes'] / GB:.2f} GB from disk: {read_disk_s:.2f} s |"
    )
    print(f"| writing the export with `torch.save` | {off['save_s']:.2f} s | |")
    print(f"| `read_table` of one {args.rows} x {args.dim} table | {off['table_s']:.2f} s | |")


if __name__ == "__main__":
    sys.exit(main())
