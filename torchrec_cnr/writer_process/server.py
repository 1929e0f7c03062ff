"""The writer process: encodes, writes and commits the checkpoints of one rank.

It runs the same jobs as the background thread does with ``background="thread"``
(:func:`~torchrec_cnr.commit.job.commit_job` with a
:class:`~torchrec_cnr.compaction.CompactionHook`, :func:`~torchrec_cnr.compaction.compaction_job`),
with its own storage and I/O threads. Its collectives are run by the training process,
which holds the ranks' process group, their payloads pickled here
(:class:`~torchrec_cnr.writer_process.wire.PickledCollective`). It exits when told to, or when the training process is gone.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

if __name__ == "__main__":
    # Started as the writer process: the imports below make some 350k objects that live as
    # long as it does; collections while they are made would find almost nothing to free
    # (a fifth of its start). ``serve`` freezes them, then turns collections back on.
    gc.disable()

from torchrec_cnr.collectives import Collective  # noqa: E402
from torchrec_cnr.commit import CommitTarget, Pending  # noqa: E402
from torchrec_cnr.commit.background import JobResult  # noqa: E402
from torchrec_cnr.commit.job import commit_job  # noqa: E402
from torchrec_cnr.compaction import (  # noqa: E402
    BackgroundCompaction,
    CompactionHook,
    compaction_job,
    finishing_job,
)
from torchrec_cnr.config import CheckpointConfig  # noqa: E402
from torchrec_cnr.encoding import ShardWriter  # noqa: E402
from torchrec_cnr.iocontext import IOContext, lowered_priority  # noqa: E402
from torchrec_cnr.staging import Sink, SourceInfo  # noqa: E402
from torchrec_cnr.staging.shared import MappedBuffers  # noqa: E402
from torchrec_cnr.storage import Storage  # noqa: E402
from torchrec_cnr.writer_process.wire import (  # noqa: E402
    Closed,
    PickledCollective,
    Wire,
    pack_error,
    received_tensors,
)

__all__ = ["serve"]


class _Server:
    def __init__(self, wire: Wire, config: CheckpointConfig, rank: int, world_size: int,
                 storage: Storage | None) -> None:  # fmt: skip
        self.wire, self.config, self.rank = wire, config, rank
        self.storage = storage if storage is not None else config.open_root()
        self.io = IOContext(config.io)
        self.compaction = BackgroundCompaction()
        self.mapped = MappedBuffers()
        self.sources: dict[str, SourceInfo] = {}
        # Alone, there is nothing to agree with: no collective goes through the trainer.
        self.group: Collective = Collective.alone()
        if world_size > 1:
            self.group = PickledCollective(self._relay, rank, world_size)

    def _relay(self, op: str, *args: Any) -> Any:
        """One collective, run by the training process over the ranks' group."""
        self.wire.send("collective", op, *args)
        kind, value = self.receive()
        if kind == "raise":
            raise value
        return value

    def receive(self) -> tuple[Any, ...]:
        """The next message that is not about buffers (those are handled here)."""
        while True:
            message = self.wire.recv()
            if message[0] == "buffer":
                _, ident, nbytes = message
                self.mapped.attach(ident, recv_handle(self.wire.conn), nbytes)
            elif message[0] == "forget":
                self.mapped.forget(message[1])
            else:
                return message

    def _rest(self, sink: Sink) -> None:
        """Staging's lazy copies, shard by shard as the training process finishes each.
        Every message up to the end of staging is read, even after a failure: the next
        ones are the job's collectives."""
        error: BaseException | None = None
        while True:
            message = self.receive()
            if message[0] == "staged":
                break
            if message[0] == "staging failed":
                error = error or message[1]
                break
            if error is not None:
                continue
            try:
                if message[0] != "shards":
                    raise RuntimeError(f"unexpected message while staging: {message[0]!r}")
                for sent, row0, total in message[1]:
                    sink.add(sent.staged(self.mapped, self.sources), row0, total)
                sink.start()
            except Exception as e:
                error = e
        if error is not None:
            raise error

    def _target(self, job: dict[str, Any]) -> CommitTarget:
        return CommitTarget(self.storage, job["policy"], job["generation"], job["keep_last"])

    def commit(self, job: dict[str, Any]) -> JobResult:
        pending: Pending = job["pending"]
        writer = ShardWriter(self.storage, job["ckpt_id"], self.rank, pending.resolver, self.io)
        for sent, row0, total in job["shards"]:
            writer.add(sent.staged(self.mapped, self.sources), row0, total)
        staged = pending.staged
        if staged is not None:
            dense = received_tensors(job["dense"], self.mapped)
            staged = replace(staged, dense=dense, rest=self._rest if job["rest"] else None)
        pending = replace(pending, writer=writer, staged=staged)
        hook = CompactionHook(self.compaction, self.io, job["every"])
        return commit_job(pending, self._target(job), job["what"], self.group, hook)

    def compact(self, job: dict[str, Any]) -> JobResult:
        return compaction_job(self._target(job), self.io, job["chain"], job["what"], self.group,
                              self.compaction)  # fmt: skip

    def finish(self, job: dict[str, Any]) -> JobResult:
        return finishing_job(self._target(job), job["chain"], job["what"], self.group,
                             self.compaction)  # fmt: skip

    def run(self) -> None:
        while True:
            kind, *args = self.receive()
            if kind == "close":
                return
            try:
                jobs = {"commit": self.commit, "compact": self.compact, "finish": self.finish}
                if kind not in jobs:
                    raise RuntimeError(f"unexpected message: {kind!r}")
                result = jobs[kind](args[0])
                if result.followup_error is not None:
                    result = replace(result, followup_error=pack_error(result.followup_error))
                reply: tuple[Any, ...] = ("done", result)
            except Closed:
                raise
            except BaseException as e:
                reply = ("error", pack_error(e))
            self.wire.send(*reply)

    def close(self) -> None:
        self.compaction.stop()
        self.io.close()


def serve(fd: int) -> None:
    """The writer process's main: serves the training process on socket ``fd``."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s (writer process): %(message)s")
    wire = Wire(Connection(fd))
    _, config, rank, world_size, storage = wire.recv()
    lower = lowered_priority(config.io.nice)
    if lower is not None:
        lower()
    try:
        server = _Server(wire, config, rank, world_size, storage)
    except BaseException as e:
        wire.send("failed", pack_error(e))
        raise
    # What the imports and the set-up made lives as long as the process: frozen, no
    # collection walks it again (each full one would walk torch's modules; the one at exit
    # too).
    gc.freeze()
    gc.enable()
    wire.send("ready", os.getpid())
    try:
        server.run()
    except Closed:  # the training process is gone: nothing left to write for
        pass
    finally:
        server.close()
        wire.close()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
