"""The manifest contract: versioned, atomic, and loud about corruption."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchrec_cnr import CheckpointConfig, ManifestError
from torchrec_cnr.commit.manifest import FORMAT_VERSION, DenseInfo, Entry, Manifest, TableShape
from torchrec_cnr.encoding import FP32, ShardRecord, StateInfo
from torchrec_cnr.storage.fs import FsStorage
from torchrec_cnr.tracking import ShardSpec


def _entry(seq: int, step: int, chain: list[str], nbytes: int) -> Entry:
    spec = ShardSpec("m.t", 0, "row_wise", 0, 0, 10, 4, 19, 4)
    record = ShardRecord(
        spec=spec,
        key="s0",
        saved_rows=3,
        all_rows=False,
        optimizer="EXACT_ADAGRAD",
        states={"momentum1": StateInfo("s0.momentum1", "element", "float32")},
        scalars={"iter": 7},
        format=FP32,
        parts=[],
        nbytes=60,
        checksums={"s0.w": 1, "s0.ids": 2, "s0.momentum1": 3},
    )
    return Entry(
        id=chain[-1],
        seq=seq,
        step=step,
        kind="full" if len(chain) == 1 else "delta",
        policy="consecutive",
        chain=chain,
        sizes=[],
        world_size=2,
        tables={"m.t": TableShape(19, 4)},
        dense={"over.weight": DenseInfo.of(torch.zeros(2, 3))},
        shards=[record],
        dense_checksums={"over.weight": 4},
        app_checksums=[5, 6],
        bytes=nbytes,
    )


def test_manifest_round_trips_and_names_its_format_version(tmp_path: Path) -> None:
    m = Manifest()
    m.checkpoints.append(_entry(0, 10, ["a"], 100))
    m.checkpoints.append(_entry(1, 20, ["a", "b"], 10))
    m.save(FsStorage(tmp_path))
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["format_version"] == FORMAT_VERSION
    loaded = Manifest.load(tmp_path)
    assert loaded.checkpoints == m.checkpoints  # every typed field survives JSON
    assert loaded.steps() == [10, 20] and loaded.next_seq() == 2
    latest, first = loaded.find(None), loaded.find(10)
    assert latest is not None and latest.id == "b"
    assert first is not None and first.id == "a" and loaded.find(30) is None
    assert loaded.chain_bytes(latest) == 110
    assert latest.checksums_by_path() == {
        "0/rows/s0.w": 1,
        "0/rows/s0.ids": 2,
        "0/rows/s0.momentum1": 3,
        "0/dense/over.weight": 4,
        "0/app/blob": 5,
        "1/app/blob": 6,
    }
    assert loaded.needed_ids(1) == {"a", "b"}
    assert not list(tmp_path.glob(".manifest.json.*"))  # no temporary file left behind


def test_missing_manifest_means_no_checkpoint(tmp_path: Path) -> None:
    assert Manifest.load(tmp_path).latest() is None


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
