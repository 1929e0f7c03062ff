"""The test suite: unit/ (one process), contract/ (every policy, layout, optimizer and
format), distributed/ (gloo ranks), e2e/ (torchrun, the app, the benchmarks), docs/ (the
documented code as written). Jobs are built by :mod:`tests.jobs` only."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
"""The repository's root: where the commands the tests run start."""
BIN = Path(sys.executable).parent
"""The virtual environment's scripts: ``torchrun``, ``cnr``, ``cnr-train``."""
TORCHRUN = BIN / "torchrun"
