"""Runs a module-level function on N CPU ranks with gloo.

Each rank joins its group as a user's job does under torchrun: torchrun's variables
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) and the library's public
:func:`torchrec_cnr.launch.init_distributed`. The ranks are worker processes that live
for the whole test session, one pool per world size: a call pays for its own work, not for starting Python and importing
torchrec on every rank (about 4 s on two cores). Each call runs with the caller's
environment variables and ends with a barrier. A call that fails, hangs or loses a rank
replaces the pool, so the next call starts from fresh processes.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing as mp

CALL_TIMEOUT_S = 280.0
"""A call still running after this long fails and its pool is replaced (pytest's own
timeout, 300 s, would leave the pool in an unknown state)."""
GRACE_S = 10.0
"""After one rank fails, how long the others get to report before the pool is killed:
they may be waiting in a collective the failed rank will never join."""


def _worker(rank: int, world_size: int, port: int, backend: str, conn: Connection) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )  # fmt: skip
    import torch
    import torch.distributed as dist

    from torchrec_cnr import shutdown
    from torchrec_cnr.launch import init_distributed

    torch.set_num_threads(1)
    init_distributed(backend, timeout_s=CALL_TIMEOUT_S)
    gc.freeze()  # the imports
    while True:
        try:
            call = conn.recv()
        except EOFError:
            return
        fn, args, kwargs, env = call
        os.environ.clear()
        os.environ.update(env)
        try:
            fn(*args, **kwargs)
            # What the call left running (a manager it did not close: a lease's heartbeat,
            # a tracker) stops, as the job's exit would stop it: a heartbeat of an
            # earlier test's root must not warn into a later test's logs.
            shutdown.stop_all()
            # Leave together: the next call's collectives must not meet this one's.
            dist.barrier()
            # What the call left collected once, the rest frozen: no later collection
            # walks the ranks' modules and models again (see tests/conftest.py).
            gc.collect()
            gc.freeze()
        except BaseException:
            conn.send(traceback.format_exc())
            return  # the pool is replaced; the others may be stuck in a collective
        conn.send(None)


class _Pool:
    def __init__(self, world_size: int, backend: str) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, world_size, port, backend, child),
                daemon=True,
                name=f"rank{rank}",
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        env = dict(os.environ)
        for conn in self.conns:
            conn.send((fn, args, kwargs, env))
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + CALL_TIMEOUT_S
        errors: dict[int, str] = {}  # in the order they arrived: the first is the likely cause
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for ready in wait(list(pending.values()), timeout=left):
                rank = next(r for r, c in pending.items() if c is ready)
                conn = pending[rank]
                del pending[rank]
                try:
                    report = conn.recv()
                except EOFError:
                    report = self._death(rank)
                if report is not None:
                    errors[rank] = report
                    deadline = min(deadline, time.monotonic() + GRACE_S)
        if errors:
            # A rank's death is the cause of its peers' errors, whichever was read first.
            deaths = [(r, e) for r, e in errors.items() if e.startswith("exited:")]
            rank, report = (deaths or list(errors.items()))[0]
            if report.startswith("exited:"):
                _, code, name = report.split(":")
                raise mp.ProcessExitedException(
                    f"process {rank} terminated with signal {name}",
                    rank,
                    self.procs[rank].pid or -1,
                    int(code),
                    name,
                )
            raise mp.ProcessRaisedException(
                "".join(f"\n\n-- Process {r} failed:\n{text}" for r, text in errors.items()),
                rank,
                self.procs[rank].pid or -1,
            )
        if pending:
            raise TimeoutError(
                f"ranks {sorted(pending)} did not finish {fn.__name__} within {CALL_TIMEOUT_S} s"
            )

    def _death(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(5)
        code = proc.exitcode if proc.exitcode is not None else 0
        name = signal.Signals(-code).name if code < 0 else "none"
        return f"exited:{code}:{name}"

    def close(self, wait_s: float = 5.0) -> None:
        """Stops the workers: idle ones leave on their own, stuck ones are killed."""
        for conn in self.conns:
            conn.close()
        deadline = time.monotonic() + wait_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_pools: dict[tuple[int, str], _Pool] = {}


@atexit.register
def _close_all() -> None:
    while _pools:
        _pools.popitem()[1].close()


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, backend: str = "gloo", **kwargs: Any
) -> None:
    """Calls ``fn(*args, **kwargs)`` on ``world_size`` ranks; raises if any rank fails.

    ``fn`` must be importable (module level); it finds its rank with
    ``torch.distributed.get_rank()``. Every rank sees the caller's environment.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback).
        torch.multiprocessing.ProcessExitedException: a rank died (e.g. SIGKILL).
        TimeoutError: a rank did not finish within ``CALL_TIMEOUT_S``.
    """
    key = (world_size, backend)
    pool = _pools.pop(key, None) or _Pool(world_size, backend)
    try:
        pool.run(fn, args, kwargs)
    except BaseException:
        pool.close(wait_s=0.0)  # never reuse ranks whose call did not end cleanly
        raise
    _pools[key] = pool
