"""The suite's GPU tests that need neither TorchRec nor FBGEMM, on a CUDA machine that has
neither (a bare PyTorch image): quantization of CUDA rows, pinned staging buffers, eager
and lazy (copy-on-write) staging of CUDA shards, and restored rows written into them.

    python scripts/gpu_check.py      # from the repository root; needs torchsnapshot

``torchrec_cnr/__init__.py`` and ``torchrec_cnr/tracking/__init__.py`` import TorchRec;
the modules these tests use do not, so both packages are entered without their
``__init__``. With the whole stack installed, ``pytest -m gpu`` runs the same tests.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    sys.path.insert(0, str(REPO))
    for name in ("torchrec_cnr", "torchrec_cnr.tracking"):
        package = types.ModuleType(name)
        package.__path__ = [str(REPO / name.replace(".", "/"))]
        sys.modules[name] = package
    names = ("test_quantization.py", "test_staging.py", "test_geometry.py")
    tests = [str(REPO / "tests/unit" / f) for f in names]
    args = ["-q", "-rs", "--noconftest", "-p", "no:cacheprovider", "-m", "gpu", *tests]
    return pytest.main(args)


if __name__ == "__main__":
    sys.exit(main())
