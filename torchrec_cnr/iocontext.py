"""How a root's I/O runs, in one place: :class:`IOOptions` and the :class:`IOContext`
that owns the thread pools built from them.

Whoever owns a piece of work on a root (a :class:`~torchrec_cnr.CheckpointManager`, a
:class:`~torchrec_cnr.serving.Follower`, a ``cnr`` command, a model-free read) builds
one ``IOContext`` and passes it to everything that reads or writes for it, and closes it
at the end. Nothing else starts an I/O pool or reads an I/O setting, and every default
is written once, here: an argument wins, then the environment variable named in the
field's docstring (read once, when the options are built), then the default.

I/O and encoding are apart: I/O threads mostly wait (in ``pwrite``, in a socket), so
there are many; quantization is CPU-bound, so there are as many threads as cores. Each
encoding thread keeps its quantizer scratch buffers (thread-local) for reuse, and they
go with the thread when the pool shuts down.

The threads of a checkpoint run in the background of training and should yield to it:
with ``nice``, each lowers its own scheduling priority (Linux: ``setpriority`` of the
thread) when it starts, so that a core the training thread wants goes to it first. This
matters most for a quantized checkpoint, whose encoding threads are CPU-bound; an fp32
commit is bound by memory and the disk rather than by the CPU. Where training takes every
core, a lowered priority makes the commit take longer instead. What a checkpoint costs
training is measured by ``benchmarks.overhead --save-cost`` (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import InitVar, dataclass, field
from typing import Any

from torchrec_cnr.env import env_flag, env_json, env_number
from torchrec_cnr.units import check_size_mb, mb_bytes

__all__ = ["IOContext", "IOOptions", "lowered_priority", "storage_defaults"]

log = logging.getLogger(__name__)
_said: list[str] = []


def _optional_mb(name: str) -> float | None:
    """Environment variable ``name`` as a size in MB; ``None`` where unset."""
    return env_number(name, math.nan) if name in os.environ else None


def _object_mb() -> float:
    """``TORCHREC_CNR_OBJECT_MB``, 64 if unset; the variable in KiB it replaced
    (``TORCHREC_CNR_OBJECT_KB``) still counts where it alone is set, with a warning."""
    if "TORCHREC_CNR_OBJECT_KB" in os.environ and "TORCHREC_CNR_OBJECT_MB" not in os.environ:
        warnings.warn(
            "TORCHREC_CNR_OBJECT_KB is deprecated and will not be read in the next release: "
            "set TORCHREC_CNR_OBJECT_MB, the size in MB (KiB / 1024)",
            DeprecationWarning,
            stacklevel=2,
        )
        return env_number("TORCHREC_CNR_OBJECT_KB", 64 << 10) / 1024
    return env_number("TORCHREC_CNR_OBJECT_MB", 64)


@dataclass(frozen=True)
class IOOptions:
    """How a root's I/O runs: performance knobs, not behaviour (a checkpoint written
    with one value restores with any other).

    Each default comes from an environment variable when it is set, read once, when the
    options are built; an argument always wins.
    """

    threads: int = field(default_factory=lambda: int(env_number("TORCHREC_CNR_IO_THREADS", 8)))
    """Threads per rank that write and read a checkpoint's objects at once
    (``TORCHREC_CNR_IO_THREADS``)."""
    encode_threads: int = field(default_factory=lambda: max(1, os.cpu_count() or 1))
    """Threads per rank that quantize rows (CPU-bound work, apart from the I/O threads)."""
    object_mb: float = field(default_factory=_object_mb)
    """Largest data object a checkpoint writes, in MB (whole rows; at least 1/1024, a KiB): a
    larger tensor is written as several objects, in parallel, and read in pieces of this
    size (``TORCHREC_CNR_OBJECT_MB``)."""
    nice: int = field(default_factory=lambda: int(env_number("TORCHREC_CNR_NICE", 10)))
    """How far below training's the scheduling priority of the background writer, encoding
    and I/O threads is (Linux nice, 0 to 19; 0: the same), so that a CPU the training
    thread wants goes to it first (``TORCHREC_CNR_NICE``)."""
    direct_writes: bool = field(
        default_factory=lambda: env_flag("TORCHREC_CNR_DIRECT_WRITES", True)
    )
    """Write data objects of a MiB or more with ``O_DIRECT`` on file-system roots, where
    the file system allows it (``TORCHREC_CNR_DIRECT_WRITES``)."""
    direct_reads: bool = field(default_factory=lambda: env_flag("TORCHREC_CNR_DIRECT_READS", True))
    """Read them with ``O_DIRECT`` likewise (``TORCHREC_CNR_DIRECT_READS``)."""
    compiled_search: bool = field(
        default_factory=lambda: env_flag("TORCHREC_CNR_COMPILED_SEARCH", True)
    )
    """Run adaptive quantization's range search compiled where the library is built; off,
    as torch code, which is slower (``TORCHREC_CNR_COMPILED_SEARCH``)."""
    compiled_staging: bool = field(
        default_factory=lambda: env_flag("TORCHREC_CNR_COMPILED_STAGING", True)
    )
    """Claim lazy staging's rows with the compiled copier where it is built; off, copy
    under a lock per kernel (``TORCHREC_CNR_COMPILED_STAGING``)."""
    read_memory_mb: float | None = field(
        default_factory=lambda: _optional_mb("TORCHREC_CNR_READ_MEMORY_MB")
    )
    """The host memory one read of a checkpoint may hold, in MB, whichever reads it: a
    restore's held tensors, a follower's update in copy mode, an export's blocks, a
    compaction's window (``TORCHREC_CNR_READ_MEMORY_MB``). A reader's own option wins where
    set (``restore_memory_mb``, ``FollowerOptions.memory_budget_mb``,
    ``ExportOptions.budget_mb``); ``None``: each reader's own default (:meth:`read_budget`).
    Reads at once in one process share it (:class:`~torchrec_cnr.read.MemoryBudget`). At
    least 1/1024 (a KiB)."""
    object_kb: InitVar[float | None] = None
    """Deprecated: :attr:`object_mb` in KiB (it sets ``object_mb = object_kb / 1024``, with
    a ``DeprecationWarning``)."""

    def __post_init__(self, object_kb: float | None) -> None:
        if object_kb is not None:
            warnings.warn(
                "IOOptions(object_kb=...) is deprecated and will be removed in the next "
                "release: pass object_mb, the size in MB (KiB / 1024)",
                DeprecationWarning,
                stacklevel=3,
            )
            if not isinstance(object_kb, int | float) or isinstance(object_kb, bool):
                raise ValueError(f"io.object_kb must be a number (KiB), got {object_kb!r}")
            object.__setattr__(self, "object_mb", object_kb / 1024)
        for name in ("threads", "encode_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"io.{name} must be a positive int, got {value!r}")
        check_size_mb("io.object_mb", self.object_mb)
        if self.read_memory_mb is not None:
            check_size_mb("io.read_memory_mb", self.read_memory_mb)
        if (
            not isinstance(self.nice, int)
            or isinstance(self.nice, bool)
            or not 0 <= self.nice <= 19
        ):
            raise ValueError(f"io.nice must be an int from 0 to 19, got {self.nice!r}")
        for name in ("direct_writes", "direct_reads", "compiled_search", "compiled_staging"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"io.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def object_bytes(self) -> int:
        """:attr:`object_mb` in bytes."""
        return mb_bytes(self.object_mb)

    def read_budget(self, own_mb: float | None, default_mb: float | None) -> int | None:
        """The bytes one read may hold, chosen here for every reader: its own option
        ``own_mb`` where set, else :attr:`read_memory_mb`, else its ``default_mb``;
        ``None``: no bound."""
        for mb in (own_mb, self.read_memory_mb, default_mb):
            if mb is not None:
                return mb_bytes(mb)
        return None


def storage_defaults() -> tuple[dict[str, Any] | None, bool]:
    """What an fsspec root given no options opens with: the options in
    ``TORCHREC_CNR_STORAGE_OPTIONS`` (a JSON object) and whether
    ``TORCHREC_CNR_SINGLE_WRITER=1`` declares one writer. Set for a whole job, every
    process of it (ranks, a writer process, a follower, the ``cnr`` tool) opens the root
    alike."""
    return env_json("TORCHREC_CNR_STORAGE_OPTIONS"), env_flag("TORCHREC_CNR_SINGLE_WRITER", False)


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


class IOContext:
    """The I/O pool and the encoding pool of one owner, and the options they came from.

    Threads start on first use (a reader never starts an encoding thread) and stop in
    :meth:`close`.

    Args:
        options: the options; :class:`IOOptions` ``()`` (the environment's) if ``None``.
    """

    def __init__(self, options: IOOptions | None = None) -> None:
        self.options = options if options is not None else IOOptions()
        lower = lowered_priority(self.options.nice)
        self.io = ThreadPoolExecutor(
            self.options.threads, thread_name_prefix="cnr-io", initializer=lower
        )
        self.encode = ThreadPoolExecutor(
            self.options.encode_threads,
            thread_name_prefix="cnr-encode",
            initializer=lower,
        )

    @property
    def object_bytes(self) -> int:
        """The largest data object written, and the most one read request reads."""
        return self.options.object_bytes

    def close(self) -> None:
        """Waits for the work in flight and stops every thread."""
        self.encode.shutdown(wait=True)
        self.io.shutdown(wait=True)

    def __enter__(self) -> IOContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
