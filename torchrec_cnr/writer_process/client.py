"""The training process's side of the writer process (``background="process"``).

:class:`WriterProcess` starts the writer (``python -m torchrec_cnr.writer_process.server``) with
the manager and runs each background job from the background writer's thread: it sends
the job (each shard staged at ``save()`` as views into shared buffers), copies the rows
staged lazily, sending each shard on as soon as it is copied, then relays the writer's
collectives over the ranks' group until the writer reports the job's result. What stays
on this process's GIL per checkpoint: a few small messages and the relayed collectives.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit import CommitTarget, Pending
from torchrec_cnr.commit.background import JobResult
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.encoding import FormatResolver
from torchrec_cnr.errors import CheckpointError
from torchrec_cnr.selection import ChainState
from torchrec_cnr.staging import RecordingSink, Sink, StagedShard
from torchrec_cnr.staging.shared import SharedBuffers
from torchrec_cnr.storage import Storage
from torchrec_cnr.writer_process.wire import (
    Closed,
    SentShard,
    Wire,
    pack_error,
    sent_tensors,
    unpack_error,
)

__all__ = ["WriterProcess"]

FORWARD_S = 0.01
"""A shard copied this long after the last message goes to the writer process at once,
to be encoded while the next is copied; one copied sooner waits for the next message.
Every message costs the training process's GIL a few turns, each long on a machine whose
cores training and the writer keep busy (``benchmarks.overhead --gil`` measures the
share); a shard held back is encoded later."""

START_TIMEOUT_S = 300.0
"""How long the first job waits for the writer process to start (import torch, open the root)."""


def _run_on(group: Collective, op: str, *args: Any) -> Any:
    """``group.<op>(*args)``: a collective the writer process asked for."""
    return getattr(group, op)(*args)


class _Forward:
    """The sink lazy staging copies into: shards go on to the writer process as they are
    copied, together where they come faster than :data:`FORWARD_S` apart."""

    def __init__(self, process: WriterProcess) -> None:
        self._process = process
        self._held: list[tuple[SentShard, int, int | None]] = []
        self._sent_at = time.perf_counter()

    def add(self, shard: StagedShard, row0: int = 0, total: int | None = None) -> None:
        p = self._process
        self._held.append((SentShard.of(shard, p.shared, p.known), row0, total))
        if time.perf_counter() - self._sent_at >= FORWARD_S:
            self.flush()

    def flush(self) -> None:
        """Sends the shards held (the writer starts encoding them)."""
        if self._held:
            self._process.send_buffers()
            self._process.wire.send("shards", self._held)
            self._held = []
        self._sent_at = time.perf_counter()

    def start(self) -> None:
        pass

    def wait(self) -> None:  # only chunked staging waits, which it refuses
        raise RuntimeError("the writer process takes no chunked staging")

    def abandon(self) -> None:
        pass


class WriterProcess:
    """A writer process for one rank.

    Args:
        config: the manager's configuration (sent to the writer, which opens ``path``).
        rank: this rank in the manager's group.
        world_size: its size.
        storage: a storage to use instead of opening ``config.path``; it must pickle.

    Raises:
        ValueError: the configuration or ``storage`` does not pickle.
    """

    def __init__(self, config: CheckpointConfig, rank: int, world_size: int,
                 storage: Storage | None = None) -> None:  # fmt: skip
        try:
            init = pickle.dumps(("init", config, rank, world_size, storage))
        except Exception as e:
            what = "storage" if storage is not None else "CheckpointConfig"
            raise ValueError(f"background='process' sends its {what} to the writer process, "
                             f"and it does not pickle: {e}") from e  # fmt: skip
        self.rank = rank
        self.shared = SharedBuffers()
        self.known: set[str] = set()
        """The shard keys whose source the writer process has been sent."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "torchrec_cnr.writer_process.server", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        self.wire = Wire(Connection(ours.detach()))
        self.wire.conn.send_bytes(init)
        self._ready = False
        self._broken: str | None = None
        self._checks_over = False
        """Whether the running job's checks that every writer process is alive are over."""

    thread_nice = 0
    """The training process's writer thread only relays (short holds of the GIL): lowered,
    the OS would preempt it while it holds it, and training would wait."""

    @property
    def pid(self) -> int:
        return self._proc.pid

    def sink(self, ckpt_id: str, resolver: FormatResolver) -> RecordingSink:
        """The writer process writes the shards: ``save()`` records them."""
        return RecordingSink(ckpt_id)

    def _gone(self, e: BaseException) -> CheckpointError:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self._broken = (
            f"the writer process of rank {self.rank} (pid {self._proc.pid}) is gone "
            f"(exit code {code}): {e or 'its socket closed'}; no checkpoint can be written "
            "until the manager is built again"
        )
        return CheckpointError(self._broken)

    def _await_ready(self) -> None:
        """Waits for the writer process to have started; raises ``Closed`` (killing it) if it
        failed to or took longer than :data:`START_TIMEOUT_S`."""
        if self._ready:
            return
        if not self.wire.conn.poll(START_TIMEOUT_S):
            self._proc.kill()
            raise Closed(f"it did not start in {START_TIMEOUT_S:.0f} s")
        kind, value = self.wire.recv()
        if kind != "ready":
            raise Closed(f"it failed to start: {value}")
        self._ready = True

    def send_buffers(self) -> None:
        """Sends the shared buffers allocated, and the ones freed, since the last call."""
        freed = self.shared.freed()
        if freed:
            self.wire.send("forget", freed)
        for ident, fd, nbytes in self.shared.unsent():
            try:
                self.wire.send("buffer", ident, nbytes)
                send_handle(self.wire.conn, fd, self._proc.pid)
            finally:
                os.close(fd)

    def commit(self, pending: Pending, target: CommitTarget, every: int | None, what: str,
               group: Collective) -> JobResult:  # fmt: skip
        """The background job of a checkpoint staged into a :class:`RecordingSink`."""
        sink = pending.writer
        assert isinstance(sink, RecordingSink)
        staged, rest = pending.staged, None
        dense: dict[str, Any] = {}
        if staged is not None:
            rest, dense = staged.rest, sent_tensors(staged.dense, self.shared)
            staged = replace(staged, dense={}, rest=None)
        failure = None if pending.failure is None else pack_error(pending.failure)
        sent = replace(pending, staged=staged, writer=RecordingSink(sink.ckpt_id), failure=failure)
        job = {"pending": sent, "ckpt_id": sink.ckpt_id, "dense": dense, "rest": rest is not None,
               "every": every, "what": what, **self._target(target)}  # fmt: skip
        return self._run(group, "commit", job, sink.added, rest)

    def compact(self, target: CommitTarget, chain: ChainState, what: str,
                group: Collective) -> JobResult:  # fmt: skip
        """The background job of a compaction."""
        return self._run(group, "compact", {"chain": chain, "what": what, **self._target(target)})

    def finish(self, target: CommitTarget, chain: ChainState, what: str,
               group: Collective) -> JobResult:  # fmt: skip
        """The background job at ``close()``: the compaction in flight finished."""
        return self._run(group, "finish", {"chain": chain, "what": what, **self._target(target)})

    @staticmethod
    def _target(target: CommitTarget) -> dict[str, Any]:
        return {"policy": target.policy, "generation": target.generation,
                "keep_last": target.keep_last}  # fmt: skip

    def _run(self, group: Collective, kind: str, job: dict[str, Any],
             shards: list[tuple[StagedShard, int, int | None]] | None = None,
             rest: Callable[[Sink], None] | None = None) -> JobResult:  # fmt: skip
        self._checks_over = False
        if self._broken is not None:  # the others learn of it at this job's first check
            self._check_alive(group, CheckpointError(self._broken))
        try:
            self._await_ready()
            self.send_buffers()
            job["shards"] = [
                (SentShard.of(s, self.shared, self.known), row0, total)
                for s, row0, total in shards or []
            ]
            self.wire.send(kind, job)
            if rest is not None:
                try:
                    forward = _Forward(self)
                    rest(forward)
                    forward.flush()
                except Closed:
                    raise
                except Exception as e:  # the writer raises it, after every rank agrees
                    self.wire.send("staging failed", pack_error(e))
                else:
                    self.wire.send("staged")
            return self._relay(group)
        except Closed as e:
            error = self._gone(e)
            if not self._checks_over:  # the others wait at this job's next check
                try:
                    self._check_alive(group, error)
                except CheckpointError as agreed:
                    error = agreed
            raise error from e

    def _relay(self, group: Collective) -> JobResult:
        """Runs the writer's collectives until it reports the job's end.

        Before each collective, and once at the job's end, every rank checks that every
        writer process is alive (:meth:`_check_alive`). A rank whose writer process died
        mid-job cannot know which collective the others wait in, but it knows they wait
        at a check: it joins it, and every rank raises its error there. From then on, the
        writer's collectives raise that error without running until the writer reports
        the job's end, which raises it too."""
        failed: Exception | None = None
        while True:
            kind, *args = self.wire.recv()
            if kind in ("done", "error"):
                if failed is not None:
                    raise failed
                self._check_alive(group, None)
            if kind == "error":
                raise unpack_error(args[0])
            if kind == "done":
                result: JobResult = args[0]
                if result.followup_error is not None:
                    unpack_error(result.followup_error)
                return result
            if kind != "collective":
                raise CheckpointError(f"unexpected message from the writer process: {kind!r}")
            if failed is None:
                try:
                    self._check_alive(group, None)
                except Exception as e:
                    failed = e
            try:
                if failed is not None:
                    raise failed
                reply: tuple[Any, ...] = ("reply", _run_on(group, *args))
            except Exception as e:
                reply = ("raise", pack_error(e))
            self.wire.send(*reply)

    def _check_alive(self, group: Collective, gone: CheckpointError | None) -> None:
        """Every rank's check that every writer process is alive (``gone``: this rank's is
        not, and why); raises ``gone``'s agreed error on every rank where any is not. The
        job's checks are over once one raises."""
        try:
            if group.any(gone is not None):
                group.agree(gone)
        except BaseException:
            self._checks_over = True
            raise

    def close(self, timeout_s: float = 60.0) -> None:
        """Asks the writer process to exit; kills it if it has not within ``timeout_s``."""
        if self._proc.poll() is None and self._broken is None:
            try:
                self.wire.send("close")
            except Closed:
                pass
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self.wire.close()
        self.shared.close()
