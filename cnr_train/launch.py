"""Process-group set-up that survives ``torchrun --max-restarts``.

torchrun keeps one key-value store for all attempts of a job. Process groups
publish their ranks' addresses in it under names that repeat from attempt to
attempt, so a restarted gloo group can read a dead attempt's address and fail
to connect ("Connection refused"). Prefixing the store with the attempt number
gives every attempt keys of its own.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(backend: str | None = None, timeout_s: int = 600) -> None:
    """``init_process_group`` from torchrun's environment, with a store prefixed per attempt.

    Args:
        backend: ``nccl`` where CUDA is available, ``gloo`` otherwise, if ``None``.
        timeout_s: collective timeout.

    Example::

        init_distributed()
        try:
            train()
        finally:
            dist.destroy_process_group()
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timedelta(seconds=timeout_s)
    if "MASTER_ADDR" not in os.environ:  # not under torchrun: a single process
        dist.init_process_group(
            backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1, timeout=timeout
        )
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else rank == 0,
        timeout=timeout,
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"attempt-{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
