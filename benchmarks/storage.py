"""Commit and restore times of the same checkpoints on a local file system and on S3 (a
moto server on loopback, keeping objects in memory, unless ``AWS_ENDPOINT_URL`` names one:
the protocol's cost, not a network's). ``--tables`` table-wise tables of ``--rows`` x
``--dim`` on 2 gloo ranks; on each backend a full fp32 baseline, then a delta of
``--fraction`` of the rows (intermittent), each timed from ``save()`` to ``wait()``, then a
restore of the chain, checksums verified. The slowest rank's, median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

from benchmarks import measure
from benchmarks.harness import Bench, Case, Outcome, main
from benchmarks.results import Table
from torchrec_cnr import CheckpointConfig, CheckpointManager, list_checkpoints
from torchrec_cnr.tracking.model_state import local_shards


def _arguments(p: argparse.ArgumentParser) -> None:
    measure.model_arguments(p, rows=100_000)
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=3)


def _measure(b: Bench, base: str, model: torch.nn.Module) -> dict[str, Any]:
    shards = local_shards(model)
    rows = measure.random_rows(shards, [b.args.fraction])[b.args.fraction]
    full, delta, restore = [], [], []
    for rep in range(b.args.repeats):
        root = f"{base}/{rep}"
        with CheckpointManager(model, CheckpointConfig(path=root, policy="intermittent")) as ckpt:
            full.append(measure.timed_save(ckpt, 1)[1])
            measure.modify(shards, rows)
            delta.append(measure.timed_save(ckpt, 2)[1])
            took, restored = measure.timed(ckpt.restore)
            assert restored == 2, restored
            restore.append(took)
    infos = measure.from_rank0(lambda: list_checkpoints(root))
    return {"full_commit_s": statistics.median(full), "delta_commit_s": statistics.median(delta),
            "restore_s": statistics.median(restore), "full_bytes": infos[0].bytes,
            "delta_bytes": infos[-1].bytes}  # fmt: skip


def run(b: Bench) -> Outcome:
    a = b.args
    model = measure.uniform_model(a).model
    with measure.s3_server():
        roots = {"file system": str(b.scratch / "ckpt"),
                 "S3 (moto, loopback)": f"s3://{measure.s3_bucket()}/ckpt"}  # fmt: skip
        backends = {}
        for name, root in roots.items():
            b.log(f"{name}: {root}")
            backends[name] = _measure(b, root, model)
    title = f"{a.tables} tables x {a.rows} rows x dim {a.dim} on {b.world} ranks, delta "
    title += f"{a.fraction:.0%} of rows; median of {a.repeats}"
    table = Table.of(title, [{"backend": n, **r} for n, r in backends.items()], {
        "backend": "backend", "full commit s": "full_commit_s", "delta commit s": "delta_commit_s",
        "restore (baseline + delta) s": "restore_s", "full GB": lambda r: r["full_bytes"] / 1e9,
    })  # fmt: skip
    return Outcome({"backends": backends}, [table])


CASE = Case(name="storage", title="Commit and restore on a file system and on S3",
            arguments=_arguments, smoke="--tables 2 --rows 2000 --dim 16 --repeats 1",
            run=run)  # fmt: skip

if __name__ == "__main__":
    sys.exit(main(CASE, __doc__))
