"""Fault injection for tests: a :class:`~torchrec_cnr.storage.Storage` that fails on cue.

Production code has no fault hooks. A test wraps the root's storage in a
:class:`FaultyStorage` on the ranks it wants to fail and passes it to
``CheckpointManager(..., storage=...)``; each :class:`Fault` names the operation, a piece
of the object's name, and what happens: ``oserror`` raises ENOSPC (a full disk),
``sigkill`` kills the process, ``delay`` sleeps 3 s.

The points used most:

- ``Fault("make_durable", "step0000000004")``: after a checkpoint's files are written,
  before they are durable and committed;
- ``Fault("make_durable", "-c")``: the same, for a compaction;
- ``Fault("write_object", ...)``, ``Fault("write", "manifest.json")``,
  ``Fault("write", "lease.json")``: an object, the manifest, the lease.

:class:`SlowReads` slows reads and fails some, for the tests that a read which fails ends
only once every read begun beside it has. :func:`cut_at` cuts the training thread's own
calls short instead, at a chosen line of the library's code, as a signal handler's
exception (``KeyboardInterrupt``) would.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torchrec_cnr
from torchrec_cnr.storage import Storage, StorageWrapper, open_storage

Action = Literal["oserror", "sigkill", "hold"]


@dataclass
class Fault:
    op: str
    """The :class:`Storage` method: ``write_object``, ``write``, ``make_durable``, ..."""
    name: str = ""
    """A piece of the object's (or folder's) name; ``""`` matches every name."""
    action: Action = "oserror"
    times: int | None = None
    """How many times it fires; ``None`` for always."""
    released: threading.Event = field(default_factory=threading.Event)
    """``hold``: the operation waits until the test sets this (two minutes at most)."""

    def hits(self, op: str, name: str) -> bool:
        if op != self.op or self.name not in name or self.times == 0:
            return False
        if self.times is not None:
            self.times -= 1
        return True


class FaultyStorage(StorageWrapper):
    """``inner`` with ``faults`` injected; everything else is passed through.

    Args:
        inner: the real storage, or a root to open.
        faults: what fails, in order; the first that matches an operation fires.
    """

    def __init__(self, inner: Storage | str, *faults: Fault) -> None:
        super().__init__(open_storage(inner) if isinstance(inner, str) else inner)
        self.faults = list(faults)

    def before(self, op: str, name: str) -> None:
        for fault in self.faults:
            if not fault.hits(op, name):
                continue
            if fault.action == "oserror":
                raise OSError(errno.ENOSPC, f"injected: no space left on device ({op} {name})")
            if fault.action == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.action == "hold" and not fault.released.wait(120):
                raise TimeoutError(f"injected hold of {op} {name} was never released")
            return


class SlowReads(StorageWrapper):
    """Reads of ``inner`` that take ``delay`` s each (those ``slow`` picks by the object's
    name), and fail with ``OSError("its object is gone")`` where ``fails(name)``: for the
    tests that a read which fails ends only once every other read begun beside it has.
    Each read's start and end are recorded (``began``, ``ended``: name and time)."""

    def __init__(self, inner: Storage, fails: Callable[[str], bool], delay: float = 0.05,
                 slow: Callable[[str], bool] = lambda name: True) -> None:  # fmt: skip
        super().__init__(inner)
        self.fails, self.delay, self.slow = fails, delay, slow
        self.began: list[tuple[str, float]] = []
        self.ended: list[tuple[str, float]] = []

    def read_into(self, name: str, offset: int, out: memoryview, cached: bool = False) -> None:
        if self.slow(name):
            self.began.append((name, time.monotonic()))
            time.sleep(self.delay)
        if self.fails(name):
            raise OSError("its object is gone")
        super().read_into(name, offset, out, cached)
        self.ended.append((name, time.monotonic()))

    def assert_none_ends_later(self) -> None:
        """Some read ended, and none ends from now on."""
        ended = len(self.ended)
        time.sleep(0.5)
        assert ended > 0 and len(self.ended) == ended, "a read ended after the call failed"


T = TypeVar("T")


def cut_at(at: int | None, call: Callable[[], T]) -> tuple[T | None, int]:
    """``call()`` on this thread with ``KeyboardInterrupt`` raised at its line ``at`` of
    the library's own code (lines elsewhere are not counted), as a signal handler's
    exception lands between any two lines; ``None``: not cut. Returns what it returned,
    ``None`` if it was cut short, and how many of the library's lines it ran."""
    count = 0
    package = str(Path(torchrec_cnr.__file__).parent)

    def line(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
            if count == at:
                raise KeyboardInterrupt
        return line

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return line if frame.f_code.co_filename.startswith(package) else None

    sys.settrace(calls)
    try:
        return call(), count
    except KeyboardInterrupt:
        return None, count
    finally:
        sys.settrace(None)
