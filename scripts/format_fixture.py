"""Writes the old-format roots of ``tests/contract/test_old_formats.py`` with this version:
run it in a checkout of the last version of a format, then copy the output to
``tests/data/format_v<N>``.

Each root: 2 ranks, the app's DLRM on tables a (600 x 8, table-wise) and c (401 x 8,
row-wise), a checkpoint every second step from 2 to ``2 * --saves``; ``intermittent``
compacts its step 8. Beside each, ``<policy>.pt``: what ``export_state_dict`` gives at
every committed step, read by the version that wrote it.

    python scripts/format_fixture.py OUT [--saves 12]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from cnr_train.workload import TableSpec
from tests.jobs import make_job
from tests.multiprocess import run_ranks
from torchrec_cnr import export_state_dict

TABLES = [TableSpec("a", 600, 8, "table_wise"), TableSpec("c", 401, 8, "row_wise")]
POLICIES = ("intermittent", "consecutive")


def _write(root: str, policy: str, saves: int) -> None:
    job = make_job(TABLES, root, seed=9, data_seed=2, policy=policy)
    for step in range(1, 2 * saves + 1):
        job.step(step)
        if step % 2 == 0:
            job.ckpt.save(step)
            job.ckpt.wait()
            if policy == "intermittent" and step == 8:
                job.ckpt.compact()
                job.ckpt.wait()
    job.ckpt.close()
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--saves", type=int, default=12)
    args = parser.parse_args()
    for policy in POLICIES:
        root = args.out / policy
        run_ranks(2, _write, str(root), policy, args.saves)
        steps = range(2, 2 * args.saves + 1, 2)
        torch.save({s: export_state_dict(str(root), s) for s in steps}, args.out / f"{policy}.pt")
        print(f"{root}: {len(steps)} checkpoints")


if __name__ == "__main__":
    main()
