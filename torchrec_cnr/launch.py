"""Process-group set-up that survives ``torchrun --max-restarts``.

torchrun keeps one key-value store for every attempt of a job. Process groups publish
their ranks' addresses in it under names that repeat from attempt to attempt, so the
gloo groups of a restarted attempt can read a dead attempt's addresses and fail to
connect ("Gloo connectFullMesh failed ... Connection refused"), in
``init_process_group`` itself or in a later ``new_group``, or hang: an open PyTorch bug
(https://github.com/pytorch/pytorch/issues/167288), with or without torchrec_cnr.
:func:`init_distributed` gives every attempt keys of its own by prefixing the store with
the attempt number (``TORCHELASTIC_RESTART_COUNT``). A launcher of your own must do the
same: build the default group on ``PrefixStore(f"attempt-{attempt}", store)``, never on
torchrun's store as it is.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["init_distributed", "warn_if_restarts_unsafe"]

_made_here = False
"""Whether this process's default group came from :func:`init_distributed`."""


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """``init_process_group`` from torchrun's environment, on a store prefixed per attempt.

    Under torchrun (``MASTER_ADDR`` set) every rank joins the job's group; elsewhere it
    makes a group of one process, so the same script runs as ``python train.py`` too.
    With ``nccl`` (alone or beside gloo), each rank also takes its ``LOCAL_RANK``'s GPU.

    Args:
        backend: ``nccl`` where CUDA is available, ``gloo`` otherwise, if ``None``; a
            backend per device, such as ``cpu:gloo,cuda:nccl`` (which DCP's ``async_save``
            needs on GPUs), is passed on as given.
        timeout_s: the collectives' timeout, in seconds.

    Raises:
        ValueError: ``timeout_s`` is not positive.
        RuntimeError: a default process group exists already.

    Example::

        from torchrec_cnr.launch import init_distributed

        init_distributed()  # torchrun --max-restarts=3 ... train.py
        try:
            train()
        finally:
            torch.distributed.destroy_process_group()
    """
    global _made_here
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if dist.is_initialized():
        raise RuntimeError("init_distributed: a default process group exists already")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timedelta(seconds=timeout_s)
    if "MASTER_ADDR" not in os.environ:  # not under torchrun: a single process
        dist.init_process_group(
            backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1, timeout=timeout
        )
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        # torchrun's agent serves the store; without it (an older launcher) rank 0 does.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=not agent and rank == 0,
            timeout=timeout,
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"attempt-{attempt}", store),
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
    _made_here = True
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def warn_if_restarts_unsafe() -> None:
    """Warns, under ``torchrun --max-restarts`` > 0, when the default group was not made
    by :func:`init_distributed`: a restarted attempt's gloo groups may then fail to
    connect (see the module docstring). A launcher that prefixes the store itself can
    silence it with ``warnings.filterwarnings``."""
    if _made_here or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) <= 0:
        return
    warnings.warn(
        "torchrun restarts this job, but its process group was not made by "
        "torchrec_cnr.launch.init_distributed(): a restarted attempt's gloo groups can read "
        "a dead attempt's addresses from torchrun's store and fail to connect (PyTorch "
        "issue 167288). Call init_distributed() instead of init_process_group(), or build "
        "the group on a store prefixed per attempt (docs/launching.md).",
        stacklevel=3,
    )
