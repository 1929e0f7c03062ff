"""The thread pools a checkpoint's work runs on, owned by whoever creates them.

A :class:`~torchrec_cnr.CheckpointManager` creates one :class:`Executors` from its
``IOOptions`` and shuts it down in ``close()``; a model-free read creates its own for
the read's duration. Nothing in the library keeps a pool of its own beyond that.

I/O and encoding are apart: I/O threads mostly wait (in ``pwrite``, in a socket), so
there are many; quantization is CPU-bound, so there are as many threads as cores. Each
encoding thread keeps its quantizer scratch buffers (thread-local) for reuse, and they
go with the thread when the pool shuts down.

The threads of a checkpoint run in the background of training and should yield to it:
with ``nice``, each lowers its own scheduling priority (Linux: ``setpriority`` of the
thread) when it starts. Measured with 1 training rank on 2 cores: a full 4-bit checkpoint's
encoding, two CPU-bound threads, cost training 130-160 ms at the same priority and 70-110
ms at nice 10; fp32 commits, bound by memory rather than CPU, cost the same either way.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["Executors", "lowered_priority"]

log = logging.getLogger(__name__)
_said: list[str] = []


def lowered_priority(nice: int) -> Callable[[], None] | None:
    """A thread initializer that raises the calling thread's nice value by ``nice`` (at most
    to 19); ``None`` for 0, or where threads have no priority of their own (not Linux)."""
    if nice == 0 or not sys.platform.startswith("linux"):
        return None

    def lower() -> None:
        tid = threading.get_native_id()
        try:
            own = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, own + nice))
        except OSError as e:  # a sandbox may refuse it: the thread runs as it is
            if not _said:
                _said.append(str(e))
                log.warning("torchrec_cnr: cannot lower the background threads' priority: %s", e)

    return lower


class Executors:
    """An I/O pool and an encoding pool.

    Args:
        io_threads: threads that read and write objects.
        encode_threads: threads that quantize rows.
        object_bytes: the largest data object written, and the most one read request reads.
        nice: how much lower than their creator's the threads' priority is (0 to 19).
    """

    def __init__(
        self, io_threads: int, encode_threads: int, object_bytes: int, nice: int = 0
    ) -> None:
        lower = lowered_priority(nice)
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix="cnr-io", initializer=lower)
        self.encode = ThreadPoolExecutor(
            encode_threads, thread_name_prefix="cnr-encode", initializer=lower
        )
        self.object_bytes = object_bytes

    def close(self) -> None:
        """Waits for the work in flight and stops every thread."""
        self.encode.shutdown(wait=True)
        self.io.shutdown(wait=True)

    def __enter__(self) -> Executors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
