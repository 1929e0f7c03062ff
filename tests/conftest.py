"""Shared fixtures: a checkpoint root and a folder for reference copies per test."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def root(tmp_path: Path) -> str:
    """A fresh checkpoint root (not created: the manager creates it)."""
    return str(tmp_path / "ckpt")


@pytest.fixture
def refs(tmp_path: Path) -> Path:
    """A folder for :mod:`tests.reference` copies of the model at saved steps."""
    path = tmp_path / "refs"
    path.mkdir()
    return path
