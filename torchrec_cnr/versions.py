"""The stack torchrec_cnr supports, and the one installed.

TorchRec and FBGEMM change their kernels' state and sharding types between releases; the
library reads both, so it states the releases it is tested on. The suite runs on CPU
against the newest (torch 2.13, TorchRec 1.8, fbgemm-gpu-cpu 1.8); ``scripts/gpu_check.py``
runs on CUDA against the oldest (torch 2.11, TorchRec 1.6.1, FBGEMM-GPU 1.6.0) and records
what it ran. A release outside the range warns once at import (it may work; it is not
tested).
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import warnings

__all__ = ["SUPPORTED", "installed", "unsupported"]

SUPPORTED: dict[str, tuple[str, str]] = {
    "torch": ("2.11", "2.13"),
    "torchrec": ("1.6", "1.8"),
    "fbgemm_gpu": ("1.6", "1.8"),
    "torchsnapshot": ("0.1", "0.1"),
}
"""Package -> the oldest and newest ``major.minor`` release supported, both included."""

_DISTRIBUTIONS = {
    "torch": ("torch",),
    "torchrec": ("torchrec", "torchrec-nightly"),
    "fbgemm_gpu": ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly"),
    "torchsnapshot": ("torchsnapshot",),
}


def installed() -> dict[str, str]:
    """Package -> the installed release, for those installed: its distribution's version,
    else the ``__version__`` of the module if imported (a bundle unpacked without its
    metadata, as ``scripts/gpu_check.py`` runs FBGEMM)."""
    found = {}
    for package, names in _DISTRIBUTIONS.items():
        for name in names:
            try:
                found[package] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        module = sys.modules.get(package)
        if package not in found and isinstance(getattr(module, "__version__", None), str):
            found[package] = module.__version__  # type: ignore[union-attr]
    return found


def _minor(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a release: {version!r}")
    return int(match[1]), int(match[2])


def unsupported(versions: dict[str, str] | None = None) -> list[str]:
    """A line for each package of ``versions`` (the installed ones if ``None``) outside
    :data:`SUPPORTED`; empty if every one is inside."""
    versions = installed() if versions is None else versions
    lines = []
    for package, version in versions.items():
        low, high = SUPPORTED[package]
        if not _minor(low) <= _minor(version) <= _minor(high):
            lines.append(f"{package} {version} (supported: {low} to {high})")
    return lines


def warn_unsupported() -> None:
    """Warns once if an installed package is outside :data:`SUPPORTED`."""
    lines = unsupported()
    if lines:
        warnings.warn(
            f"torchrec_cnr is tested on other releases than {', '.join(lines)}",
            stacklevel=3,
        )
