"""Another job on a root, in a process of its own, for the fencing tests.

    python -m tests.distributed.other_job ROOT CONTROL_DIR

One rank, with ``keep_last=1``. It claims the root, commits step 1, writes ``CONTROL_DIR/ready``, then keeps
saving, one checkpoint per step, as a job that does not know it was taken over (an
orphan whose torchrun agent died) would, until ``CONTROL_DIR/stop`` appears. It writes
what happened to each save, one line per step, into ``CONTROL_DIR/saves``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from cnr_train.workload import TableSpec
from tests.jobs import make_job
from torchrec_cnr import CheckpointError

TABLES = [TableSpec("a", 400, 16, "table_wise"), TableSpec("b", 300, 16, "column_wise")]


def main(root: str, control: Path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{control / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        job = make_job(TABLES, root, seed=1, data_seed=3, keep_last=1)
        job.train(1)
        job.ckpt.save(1)
        job.ckpt.wait()
        (control / "ready").write_text(str(os.getpid()))
        step = 1
        with open(control / "saves", "w") as log:
            while not (control / "stop").exists() and step < 500:
                step += 1
                job.train(1)
                try:
                    job.ckpt.save(step)
                    job.ckpt.wait()
                    log.write(f"{step} committed\n")
                except CheckpointError as e:
                    log.write(f"{step} refused: {e}\n")
                log.flush()
                time.sleep(0.25)  # a restore beside it reads before keep_last=1 retires
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
