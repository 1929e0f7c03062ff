"""A one-rank job that reports how much host memory checkpointing held, for
``test_memory.py``: ``python -m tests.contract.memory_job ROOT BUDGET_MB|none``.

It builds the model, resets the process's peak resident set size (``/proc/self/clear_refs``),
then builds a manager and takes one full checkpoint. It prints, in MB, the resident set size
at the reset and the peak since.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile

import torch.distributed as dist

from benchmarks.measure import proc_status_mb
from cnr_train.workload import TableSpec, build_model, dense_optimizer
from torchrec_cnr import CheckpointConfig, CheckpointManager

TABLES = [TableSpec("big", 250_000, 64, "table_wise"), TableSpec("small", 1000, 64, "table_wise")]


def main(root: str, budget: str) -> None:
    rendezvous = tempfile.mktemp(prefix="cnr_rdv_")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    try:
        model = build_model(TABLES, seed=0)
        dense_optimizer(model)
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set size
        before = proc_status_mb("VmRSS")
        config = CheckpointConfig(
            path=root, policy="full", staging_memory_mb=None if budget == "none" else float(budget)
        )
        with CheckpointManager(model, config) as ckpt:
            ckpt.save(1)
            ckpt.wait()
        print(json.dumps({"before_mb": before, "peak_mb": proc_status_mb("VmHWM")}))
    finally:
        dist.destroy_process_group()
        os.unlink(rendezvous)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
