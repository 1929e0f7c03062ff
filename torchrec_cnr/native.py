"""The small C libraries that ``pip install`` builds beside the modules using them
(``setup.py``), loaded with ctypes, which releases the GIL for every call."""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
from pathlib import Path

__all__ = ["load_library"]

log = logging.getLogger(__name__)


def load_library(beside: str, stem: str, without: str) -> ctypes.CDLL | None:
    """The library ``stem`` built in the folder of the module file ``beside``; ``None``
    where it was not built (no C compiler at install time), logging ``without`` (what
    runs instead) once per call site."""
    here = Path(beside).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{stem}{suffix}"
        if path.exists():
            return ctypes.CDLL(str(path))
    log.warning(
        "torchrec_cnr: %s/%s*.so is not built (no C compiler at install time?); %s",
        here,
        stem,
        without,
    )
    return None
