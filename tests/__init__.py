"""The test suite: unit/ (one process), contract/ (every policy, layout, optimizer and
format), distributed/ (gloo ranks), e2e/ (torchrun, the app, the benchmarks), docs/ (the
documented code as written). Jobs are built by :mod:`tests.jobs` only."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
"""The repository's root: where the commands the tests run start."""
BIN = Path(sys.executable).parent
"""The virtual environment's scripts: ``torchrun``, ``cnr``, ``cnr-train``."""
TORCHRUN = BIN / "torchrun"


@contextlib.contextmanager
def logged(name: str = "torchrec_cnr", level: int = logging.INFO) -> Iterator[list[str]]:
    """The messages logger ``name`` (and those under it) logs at ``level`` or above inside
    the block, as they are logged."""
    messages: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = _Keep(level)
    logging.getLogger(name).addHandler(handler)
    try:
        yield messages
    finally:
        logging.getLogger(name).removeHandler(handler)


def vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
