"""A one-rank job that reports how much host memory checkpointing held, for
``test_memory.py``: ``python -m tests.contract.memory_job ROOT BUDGET_MB|none [restore]``.

It builds the model, resets the process's peak resident set size (``/proc/self/clear_refs``),
then builds a manager and takes one full checkpoint with ``staging_memory_mb`` BUDGET_MB;
with ``restore``, it takes it unbounded first, then resets the peak and restores it with
``staging_memory_mb`` BUDGET_MB (and so ``restore_memory_mb``). It prints, in MB, the resident set size at the reset and
the peak since.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile

import torch.distributed as dist

from cnr_train.workload import TableSpec, build_model, dense_optimizer
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.testing.memory import proc_status_mb

TABLES = [TableSpec("big", 250_000, 64, "table_wise"), TableSpec("small", 1000, 64, "table_wise")]


def _reset_peak() -> float:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set size
    return proc_status_mb("VmRSS")


def main(root: str, budget: str, what: str = "save") -> None:
    rendezvous = tempfile.mktemp(prefix="cnr_rdv_")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    try:
        model = build_model(TABLES, seed=0)
        dense_optimizer(model)
        mb = None if budget == "none" else float(budget)
        if what == "restore":
            with CheckpointManager(model, CheckpointConfig(path=root, policy="full")) as ckpt:
                ckpt.save(1)
            before = _reset_peak()
            # The staging budget (which a restore's defaults to) also keeps the manager
            # from holding a full checkpoint's staging buffers.
            config = CheckpointConfig(path=root, policy="full", staging_memory_mb=mb)
            with CheckpointManager(model, config) as ckpt:
                assert ckpt.restore() == 1
        else:
            before = _reset_peak()
            config = CheckpointConfig(path=root, policy="full", staging_memory_mb=mb)
            with CheckpointManager(model, config) as ckpt:
                ckpt.save(1)
                ckpt.wait()
        print(json.dumps({"before_mb": before, "peak_mb": proc_status_mb("VmHWM")}))
    finally:
        dist.destroy_process_group()
        os.unlink(rendezvous)


if __name__ == "__main__":
    main(*sys.argv[1:])
