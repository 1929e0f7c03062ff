"""The top-level names: ``__all__`` is what a job imports, and resolves without a warning;
each name that left it still imports from ``torchrec_cnr`` for one release, with a
``DeprecationWarning`` naming its new spelling, and is the same object."""

from __future__ import annotations

import importlib
import re
import warnings

import pytest

import torchrec_cnr

MOVED = {
    "ChecksumError": "torchrec_cnr.errors",
    "UnsafeObjectError": "torchrec_cnr.errors",
    "DcpStager": "torchrec_cnr.interop",
    "ExportOptions": "torchrec_cnr.interop",
    "CheckpointInfo": "torchrec_cnr.offline",
    "RootInfo": "torchrec_cnr.offline",
    "TableInfo": "torchrec_cnr.offline",
    "checkpoint_info": "torchrec_cnr.offline",
    "list_checkpoints": "torchrec_cnr.offline",
    "read_optimizer_state": "torchrec_cnr.offline",
    "root_info": "torchrec_cnr.offline",
    "QuantizedRows": "torchrec_cnr.quantization",
    "quantize": "torchrec_cnr.quantization",
    "write_rows": "torchrec_cnr.tracking",
}
"""The names ``__all__`` held before it was trimmed to what a job imports -> their module."""


def test_every_name_in_all_resolves_without_a_deprecation_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in torchrec_cnr.__all__:
            assert getattr(torchrec_cnr, name) is not None
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert not set(MOVED) & set(torchrec_cnr.__all__)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_still_imports_warns_and_is_its_new_spelling(name: str) -> None:
    module = MOVED[name]
    namespace: dict[str, object] = {}
    new = f"from {module} import {name}"
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        exec(f"from torchrec_cnr import {name}", namespace)
    assert namespace[name] is getattr(importlib.import_module(module), name)
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        assert getattr(torchrec_cnr, name) is namespace[name]


def test_an_unknown_name_is_still_an_import_error() -> None:
    with pytest.raises(ImportError, match="no_such_name"):
        exec("from torchrec_cnr import no_such_name", {})
