"""How a follower reads, checks and applies its updates: one frozen dataclass.

``cnr-train serve`` builds it from the ``serve.follower`` section of its YAML, one key a
field; :class:`FollowerOptions` validates itself, there and in the library alike.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from torchrec_cnr.iocontext import IOOptions
from torchrec_cnr.serving.gate import AcceptGate, finite_rows

__all__ = ["SWAP_SHARE", "FollowerOptions", "available_memory", "swap_mode"]

SWAP_SHARE = 0.5
"""The most of the host's available memory (``MemAvailable``) that swap mode's second copy
of the tables may take for ``FollowerOptions(swap=None)`` to choose it: the other half is
left for the update's rows, the page cache and whatever else the host runs."""


@dataclass(frozen=True)
class FollowerOptions:
    """Options of a :class:`~torchrec_cnr.serving.Follower`.

    Example::

        FollowerOptions(io=IOOptions(threads=4), memory_budget_mb=64, spill_dir="/data/spill")
    """

    io: IOOptions | None = None
    """The I/O options its reads run with (threads, request size, direct reads); the
    environment's :class:`~torchrec_cnr.IOOptions` if ``None``."""
    accept: AcceptGate | None = finite_rows
    """The accept gate, which sees each update before it is served (see
    :data:`~torchrec_cnr.serving.gate.AcceptGate`); ``None`` accepts every update."""
    swap: bool | None = None
    """Swap mode: the target keeps a second copy of its tables, each update is written
    into it while the served copy serves, and lookups wait only while the two are swapped
    (pointer assignments, plus the dense tensors' copies). Costs the tables' size in
    memory. Copy mode copies an update's rows into the served tables with lookups held
    off: no second copy, and lookups wait about a memcpy of the changed rows. ``None``
    (the default) chooses when the follower is made: swap mode where the second copy
    takes at most :data:`SWAP_SHARE` of the memory available then and no memory budget is
    set (here or as ``io.read_memory_mb``), copy mode otherwise (:func:`swap_mode`)."""
    memory_budget_mb: float | None = None
    """Copy mode: the most memory an update's rows take, in MB; a larger update is read in
    pieces, each shown to the gate, prepared and moved into a mapped, unlinked file
    (:mod:`torchrec_cnr.serving.spill`). ``None``: ``io.read_memory_mb`` (the bound of
    every read), and if that is ``None`` too, an update's rows are held whole."""
    spill_dir: str | None = None
    """Where those files go (a folder on a disk, which must exist when the follower is
    made); the system's temporary folder if ``None``."""
    storage_options: dict[str, Any] | None = None
    """The fsspec file system's options where the root is a URL
    (:attr:`~torchrec_cnr.CheckpointConfig.storage_options`)."""

    def __post_init__(self) -> None:
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ValueError(
                f"storage_options must be a dict or None, got {self.storage_options!r}"
            )
        if self.io is not None and not isinstance(self.io, IOOptions):
            raise ValueError(f"io must be an IOOptions or None, got {self.io!r}")
        if self.accept is not None and not callable(self.accept):
            raise ValueError(
                f"accept must be a function of the update or None, got {self.accept!r}"
            )
        if self.swap is not None and not isinstance(self.swap, bool):
            raise ValueError(f"swap must be a bool or None (chosen by memory), got {self.swap!r}")
        mb = self.memory_budget_mb
        if mb is not None and (
            not isinstance(mb, int | float) or isinstance(mb, bool)
            or not math.isfinite(mb) or mb <= 0
        ):  # fmt: skip
            raise ValueError(f"memory_budget_mb must be > 0 (MB, finite) or None, got {mb!r}")
        if mb is not None and self.swap is True:
            raise ValueError("memory_budget_mb bounds copy mode; swap mode holds a second copy")
        if self.spill_dir is not None and not isinstance(self.spill_dir, str):
            raise ValueError(f"spill_dir must be a folder's path or None, got {self.spill_dir!r}")

    @property
    def memory_budget_bytes(self) -> int | None:
        """:attr:`memory_budget_mb` in bytes (at least one), else ``io.read_memory_mb``'s
        (:meth:`~torchrec_cnr.IOOptions.read_budget`); ``None``: no bound."""
        io = self.io if self.io is not None else IOOptions()
        budget = io.read_budget(self.memory_budget_mb, None)
        return None if budget is None else max(1, budget)


def available_memory() -> int:
    """Bytes of memory the kernel says are available now without swapping
    (``MemAvailable`` of ``/proc/meminfo``; free pages where that is not there)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def swap_mode(options: FollowerOptions, spare_bytes: int) -> bool:
    """Whether a follower with ``options`` serves in swap mode, its tables taking
    ``spare_bytes``: as set, or, for ``swap=None``, where no memory budget is set and the
    second copy fits in :data:`SWAP_SHARE` of :func:`available_memory`."""
    if options.swap is not None:
        return options.swap
    if options.memory_budget_bytes is not None:
        return False
    return spare_bytes <= SWAP_SHARE * available_memory()
