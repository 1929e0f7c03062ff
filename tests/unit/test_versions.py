"""The supported releases: the installed stack is inside them, and one outside warns."""

from __future__ import annotations

import warnings

import pytest

from torchrec_cnr import versions


def test_the_installed_stack_is_one_the_library_supports() -> None:
    found = versions.installed()
    assert {"torch", "torchrec", "fbgemm_gpu", "torchsnapshot"} <= found.keys()
    assert versions.unsupported(found) == []


def test_a_release_outside_the_range_is_named_with_the_range() -> None:
    assert versions.unsupported({"torchrec": "1.6.1", "fbgemm_gpu": "1.8.0+cpu"}) == []
    assert versions.unsupported({"torchrec": "1.5.0", "torch": "2.14.0.dev20261101"}) == [
        "torchrec 1.5.0 (supported: 1.6 to 1.8)",
        "torch 2.14.0.dev20261101 (supported: 2.11 to 2.13)",
    ]
    with pytest.raises(ValueError, match="not a release"):
        versions.unsupported({"torch": "nightly"})


def test_an_unsupported_release_warns_and_a_supported_one_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(versions, "installed", lambda: {"torchrec": "1.9.0"})
    with pytest.warns(UserWarning, match=r"torchrec 1\.9\.0 \(supported: 1\.6 to 1\.8\)"):
        versions.warn_unsupported()
    monkeypatch.setattr(versions, "installed", lambda: {"torchrec": "1.8.0"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.warn_unsupported()
