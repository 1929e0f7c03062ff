"""A checkpoint retired while a reader reads it is read again from the manifest as it
stands now; an unreadable checkpoint that is still committed is an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_manifest import _commit_run
from torchrec_cnr import CheckpointReadError
from torchrec_cnr.manifest import Manifest, Summary
from torchrec_cnr.read.retry import load_committed
from torchrec_cnr.storage.fs import FsStorage


def _shards(manifest: Manifest, entry: Summary) -> tuple[str, int]:
    return entry.id, len(manifest.shards(entry))  # read from the checkpoint's own record


def test_a_checkpoint_retired_while_read_is_read_again_from_the_new_manifest(
    tmp_path: Path,
) -> None:
    storage = FsStorage(tmp_path)
    _commit_run(storage, 1, keep_last=1)
    before = Manifest.load(storage)
    _commit_run(storage, 1, start=7, keep_last=1)  # a new baseline: retires the first
    retired = before.latest()
    assert retired is not None and Manifest.load(storage).find_id(retired.id) is None
    assert not (tmp_path / retired.id).exists(), "retention deleted its files"
    views = iter([before])

    def manifest() -> Manifest:
        return next(views, None) or Manifest.load(storage)

    loaded = load_committed(manifest, None, _shards, storage.url)
    assert loaded is not None
    entry, (read_id, count) = loaded
    assert entry.seq == 7 and read_id == entry.id and count == 1


def test_an_unreadable_checkpoint_still_committed_raises(tmp_path: Path) -> None:
    storage = FsStorage(tmp_path)
    _commit_run(storage, 2)
    latest = Manifest.load(storage).latest()
    assert latest is not None
    (tmp_path / latest.id / "checkpoint.json").unlink()
    with pytest.raises(CheckpointReadError, match="checkpoint.json is missing"):
        load_committed(lambda: Manifest.load(storage), None, _shards, storage.url)
