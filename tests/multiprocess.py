"""Runs a module-level function on N CPU ranks with gloo, in fresh processes."""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(
    rank: int, world_size: int, init_file: str, backend: str, fn: Callable[..., Any], args: tuple
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        fn(*args)
        # Leave together: a rank tearing gloo down while a peer still runs can abort it.
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, backend: str = "gloo") -> None:
    """Calls ``fn(*args)`` on ``world_size`` ranks; raises if any rank fails.

    ``fn`` must be importable (module level); it finds its rank with
    ``torch.distributed.get_rank()``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(
            _entry,
            args=(world_size, init_file, backend, fn, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
