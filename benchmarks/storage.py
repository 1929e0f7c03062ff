"""Commit and restore times of the same checkpoints on a file system, on S3 through boto3 and
s3fs (moto on loopback unless ``AWS_ENDPOINT_URL``: the protocol's cost, not a network's),
on GCS (gcsfs, emulator) and Azure (adlfs, Azurite), local servers started by rank 0. On
each: a full fp32 baseline, a delta of ``--fraction`` of the rows, each to ``wait()``, and
a restore of the chain; the slowest rank's, median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import uuid
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import measure
from benchmarks.harness import Bench, Case, Outcome, cli
from benchmarks.results import Table
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.offline import list_checkpoints
from torchrec_cnr.testing import stores
from torchrec_cnr.testing.rows import modify
from torchrec_cnr.tracking.model_state import local_shards


def _arguments(p: argparse.ArgumentParser) -> None:
    measure.model_arguments(p, rows=100_000)
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=3)


def _measure(b: Bench, base: str, model: torch.nn.Module,
             options: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    shards = local_shards(model)
    rows = measure.random_rows(shards, [b.args.fraction])[b.args.fraction]
    full, delta, restore = [], [], []
    for rep in range(b.args.repeats):
        root = f"{base}/{rep}"
        config = CheckpointConfig(path=root, policy="intermittent", storage_options=options)
        with CheckpointManager(model, config) as ckpt:
            full.append(measure.timed_save(ckpt, 1)[1])
            modify(shards, rows)
            delta.append(measure.timed_save(ckpt, 2)[1])
            took, restored = measure.timed(ckpt.restore)
            assert restored == 2, restored
            restore.append(took)
    infos = measure.from_rank0(lambda: list_checkpoints(config.open_root()))
    return {"full_commit_s": statistics.median(full), "delta_commit_s": statistics.median(delta),
            "restore_s": statistics.median(restore), "full_bytes": infos[0].bytes,
            "delta_bytes": infos[-1].bytes}  # fmt: skip


@contextlib.contextmanager
def _fsspec_stores() -> Iterator[dict[str, tuple[str, dict[str, Any]]]]:
    """Name -> (root, storage options) of a fresh bucket on each fsspec store, its server
    started by rank 0."""
    with contextlib.ExitStack() as stack:
        roots: dict[str, tuple[str, dict[str, Any]]] = {}
        if dist.get_rank() == 0:
            import fsspec

            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            gcs = {"endpoint_url": stack.enter_context(stores.gcs_server()), "token": "anon",
                   "project": "bench"}  # fmt: skip
            roots["GCS (gcsfs, emulator)"] = (f"gs://{bucket}/ckpt", gcs)
            if stores.azurite_binary() is not None:
                url = stack.enter_context(stores.azurite_server())
                azure = {"connection_string": stores.azurite_connection_string(url)}
                roots["Azure (adlfs, Azurite)"] = (f"az://{bucket}/ckpt", azure)
            for root, options in roots.values():
                fsspec.filesystem(root.partition(":")[0], **options).mkdir(bucket)
        try:
            yield measure.bcast(roots)
        finally:
            dist.barrier()


def run(b: Bench) -> Outcome:
    a = b.args
    model = measure.uniform_model(a).model
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # see stores.gcs_server
    with measure.s3_server() as s3, _fsspec_stores() as fsspec_roots:
        bucket = measure.s3_bucket()
        roots: dict[str, tuple[str, dict[str, Any] | None]] = {
            "file system": (str(b.scratch / "ckpt"), None),
            "S3 (boto3, moto)": (f"s3://{bucket}/ckpt", None),
            "S3 (s3fs, moto)": (f"s3://{bucket}/fsspec", {"endpoint_url": s3}),
            **fsspec_roots,
        }
        backends = {}
        for name, (root, options) in roots.items():
            b.log(f"{name}: {root}")
            backends[name] = _measure(b, root, model, options)
        local = backends["file system"]
        for result in backends.values():
            result["full_vs_fs"] = result["full_commit_s"] / local["full_commit_s"]
            result["delta_vs_fs"] = result["delta_commit_s"] / local["delta_commit_s"]
    title = f"{a.tables} tables x {a.rows} rows x dim {a.dim} on {b.world} ranks, delta "
    title += f"{a.fraction:.0%} of rows; median of {a.repeats}"
    table = Table.of(title, [{"backend": n, **r} for n, r in backends.items()], {
        "backend": "backend", "full commit s": "full_commit_s", "delta commit s": "delta_commit_s",
        "restore (baseline + delta) s": "restore_s", "full GB": lambda r: r["full_bytes"] / 1e9,
        "full commit / fs": "full_vs_fs", "delta commit / fs": "delta_vs_fs",
    })  # fmt: skip
    return Outcome({"backends": backends}, [table])


CASE = Case("storage", "Commit and restore on a file system and on object stores",
            _arguments, "--tables 2 --rows 2000 --dim 16 --repeats 1", run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
