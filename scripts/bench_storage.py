"""Commit and restore times of the same checkpoints on a local file system and on S3.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_storage.py

The S3 store is a moto server that the script starts on loopback (an S3-compatible
server in a local process, as the tests use), unless ``AWS_ENDPOINT_URL`` already names
one. The model is ``--tables`` table-wise tables of ``--rows`` x ``--dim`` on 2 gloo
ranks. On each backend, in one run: a full fp32 baseline, then a delta with ``--fraction``
of the rows modified (intermittent policy), each timed from ``save()`` until ``wait()``
returns (the commit); then a restore of that chain into the live model, with every
checksum verified, timed on every rank (the slowest counts). Each figure is the median of
``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from typing import Any

import torch
import torch.distributed as dist

from cnr_train.bench.common import bcast, log, modify, rmtree, scratch_dir, timed
from cnr_train.workload import TableSpec, build_model, dense_optimizer
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.commit import Manifest
from torchrec_cnr.storage import open_storage
from torchrec_cnr.tracking import model_state

COMMAND = "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_storage.py"


def _start_moto() -> tuple[subprocess.Popen[bytes] | None, str]:
    """A moto S3 server on loopback (rank 0), and its URL on every rank."""
    server, url = None, None
    if dist.get_rank() == 0:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
    return server, bcast(url)


def _commit(ckpt: CheckpointManager, step: int) -> None:
    ckpt.save(step)
    ckpt.wait()


def _measure(root: str, model: torch.nn.Module, fraction: float, repeats: int) -> dict[str, Any]:
    shards = model_state.local_shards(model)
    g = torch.Generator().manual_seed(dist.get_rank())
    rows = [
        torch.randperm(s.spec.rows, generator=g)[: int(fraction * s.spec.rows)].sort().values
        for s in shards
    ]
    full, delta, restore = [], [], []
    for _ in range(repeats):
        if dist.get_rank() == 0:
            open_storage(root).clear()
        dist.barrier()
        with CheckpointManager(model, CheckpointConfig(path=root, policy="intermittent")) as ckpt:
            t, _ = timed(lambda: _commit(ckpt, 1))
            full.append(t)
            modify(shards, rows)
            t, _ = timed(lambda: _commit(ckpt, 2))
            delta.append(t)
            t, restored = timed(ckpt.restore)
            assert restored == 2
            restore.append(t)
    manifest = Manifest.load(root)
    return {
        "full_commit_s": statistics.median(full),
        "delta_commit_s": statistics.median(delta),
        "restore_s": statistics.median(restore),
        "full_bytes": manifest.checkpoints[0].bytes,
        "delta_bytes": manifest.checkpoints[-1].bytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--fraction", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    server = None
    try:
        if "AWS_ENDPOINT_URL" not in os.environ:
            server, url = _start_moto()
            os.environ.update(
                AWS_ENDPOINT_URL=url,
                AWS_ACCESS_KEY_ID="bench",
                AWS_SECRET_ACCESS_KEY="bench",
                AWS_DEFAULT_REGION="us-east-1",
            )
        bucket = bcast(f"bench-{uuid.uuid4().hex[:8]}")
        if dist.get_rank() == 0:
            import boto3

            boto3.client("s3").create_bucket(Bucket=bucket)
        tables = [TableSpec(f"t{i}", args.rows, args.dim, "table_wise") for i in range(args.tables)]
        model = build_model(tables, seed=0)
        dense_optimizer(model)
        scratch = scratch_dir("bench_storage_")
        roots = {
            "file system": str(scratch / "ckpt"),
            "S3 (moto, loopback)": f"s3://{bucket}/ckpt",
        }
        results = {}
        for name, root in roots.items():
            log(f"{name}: {root}")
            results[name] = _measure(root, model, args.fraction, args.repeats)
        if dist.get_rank() == 0:
            print(
                f"\n{args.tables} tables x {args.rows} rows x dim {args.dim} on "
                f"{dist.get_world_size()} ranks, delta {args.fraction:.0%} of rows; "
                f"median of {args.repeats}\n\n{COMMAND}\n"
            )
            print("| backend | full commit | delta commit | restore (baseline + delta) | full GB |")
            print("|---|---:|---:|---:|---:|")
            for name, r in results.items():
                print(
                    f"| {name} | {r['full_commit_s']:.2f} s | {r['delta_commit_s']:.2f} s | "
                    f"{r['restore_s']:.2f} s | {r['full_bytes'] / 1e9:.3f} |"
                )
        rmtree(scratch)
    finally:
        if server is not None:
            server.terminate()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
