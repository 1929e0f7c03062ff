"""Damage named in one process: a manifest that is not JSON or not a manifest, a damaged
history segment or checkpoint record, each named by ``Manifest.load`` or on first use.
What a job, a restore and ``cnr verify`` do with damage on every backend is in
``tests/distributed/test_damage.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_manifest import _commit_run
from torchrec_cnr import CheckpointReadError, ManifestError
from torchrec_cnr.manifest import FORMAT_VERSION, Manifest
from torchrec_cnr.schema import checkpoint_id
from torchrec_cnr.storage.fs import FsStorage


def test_corrupt_manifest_is_named(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="manifest.json"):
        Manifest.load(tmp_path)


def test_malformed_manifest_is_named(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(
        json.dumps({"format_version": FORMAT_VERSION, "checkpoints": [{"id": "x"}]})
    )
    with pytest.raises(ManifestError, match="malformed"):
        Manifest.load(tmp_path)


def test_a_damaged_segment_or_record_is_named(tmp_path: Path) -> None:
    storage = FsStorage(tmp_path)
    _commit_run(storage, 40)
    segment = sorted(tmp_path.glob("history-*.json"))[0]
    segment.write_bytes(segment.read_bytes().replace(b'"step":10,', b'"step":11,'))
    manifest = Manifest.load(tmp_path)
    assert manifest.latest() is not None  # the latest needs no segment
    with pytest.raises(ManifestError, match=f"{segment.name} is damaged"):
        manifest.steps()
    record = tmp_path / checkpoint_id(39, 390, 0) / "checkpoint.json"
    record.write_bytes(record.read_bytes()[:-10])
    manifest = Manifest.load(tmp_path)
    latest = manifest.latest()
    assert latest is not None
    with pytest.raises(CheckpointReadError, match="checkpoint.json"):
        manifest.record(latest)
