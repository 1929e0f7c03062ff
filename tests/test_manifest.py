"""The manifest contract: versioned, atomic, and loud about corruption."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchrec_cnr import CheckpointConfig
from torchrec_cnr.manifest import FORMAT_VERSION, Manifest, ManifestError


def _entry(seq: int, step: int, chain: list[str], nbytes: int) -> dict:
    return Manifest.entry(
        seq=seq,
        step=step,
        kind="full" if len(chain) == 1 else "delta",
        policy="consecutive",
        chain=chain,
        sizes=[],
        world_size=2,
        tables={},
        dense={},
        shards=[],
        dense_checksums={},
        app_checksums=[],
        nbytes=nbytes,
    )


def test_manifest_round_trips_and_names_its_format_version(tmp_path: Path) -> None:
    m = Manifest()
    m.checkpoints.append(_entry(0, 10, ["a"], 100))
    m.checkpoints.append(_entry(1, 20, ["a", "b"], 10))
    m.save(tmp_path)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["format_version"] == FORMAT_VERSION
    loaded = Manifest.load(tmp_path)
    assert loaded.steps() == [10, 20] and loaded.next_seq() == 2
    assert (
        loaded.find(None)["id"] == "b" and loaded.find(10)["id"] == "a" and loaded.find(30) is None
    )
    assert loaded.chain_bytes(loaded.find(20)) == 110
    assert loaded.needed_ids(1) == {"a", "b"}
    assert not list(tmp_path.glob(".manifest.json.*"))  # no temporary file left behind


def test_missing_manifest_means_no_checkpoint(tmp_path: Path) -> None:
    assert Manifest.load(tmp_path).latest() is None


def test_corrupt_manifest_is_named(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="manifest.json"):
        Manifest.load(tmp_path)


def test_unknown_format_version_is_refused(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 99, "checkpoints": []}))
    with pytest.raises(ManifestError, match="format_version 99"):
        Manifest.load(tmp_path)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"policy": "weekly"}, "policy"),
        ({"interval_steps": 0}, "interval_steps"),
        ({"keep_last": 0}, "keep_last"),
        ({"baseline_rule": "x"}, "baseline_rule"),
        ({"path": ""}, "path"),
    ],
)
def test_config_rejects_out_of_range_values_naming_the_field(kwargs: dict, field: str) -> None:
    args = {"path": "/tmp/x", **kwargs}
    with pytest.raises(ValueError, match=field):
        CheckpointConfig(**args)
