"""Damage to a root's files is named, never half-applied, and never hangs a job, on
every storage backend.

- A damaged or missing tensor in the last checkpoint of a chain: ``cnr verify`` names
  it; a restore raises on every rank and leaves the model exactly as it was, whether the
  chain fits in host memory or is read twice.
- A damaged, truncated, deleted or garbage manifest: every rank raises the same
  ``ManifestError`` naming it within seconds; ``cnr verify`` says the previous committed
  manifest is intact, and ``manifest_fallback=True`` restores from it; one that is not
  JSON is named by ``Manifest.load``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from cnr_train.workload import TableSpec
from tests import logged, reference
from tests.jobs import Job, make_job, save_reference
from tests.models import capture, differences
from tests.multiprocess import run_ranks
from torchrec_cnr import (
    CheckpointReadError,
    ChecksumError,
    ManifestError,
    Timeouts,
    export_state_dict,
)
from torchrec_cnr.cli import main as cnr
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.manifest.store import TAIL
from torchrec_cnr.storage import open_storage

TABLES = [
    TableSpec("a", 400, 16, "table_wise"),
    TableSpec("b", 300, 16, "column_wise"),
    TableSpec("c", 4001, 16, "row_wise"),
]


def _job(root: str, seed: int, policy: str = "consecutive", **config) -> Job:
    return make_job(TABLES, root, seed=seed, data_seed=4, policy=policy, **config)


def _save_chain(root: str) -> None:
    job = _job(root, seed=1)
    for step in (2, 4, 6):
        job.train(2)
        job.ckpt.save(step)
    job.ckpt.close()


def _restore_refused_and_nothing_changed(
    root: str, error: type[Exception], needle: str, budget_mb: int | None, step: int | None = None
) -> None:
    job = _job(root, seed=3, restore_memory_mb=budget_mb)
    before = capture(job.model, job.app_state)
    with pytest.raises(error, match=needle):
        job.ckpt.restore(step)
    assert not differences(before, capture(job.model, job.app_state)), (
        "a failed restore changed the model"
    )
    job.ckpt.close()


def _damage(root: str, name: str, start: int, end: int, how: str) -> None:
    storage = open_storage(root)
    if how == "missing":
        storage.delete(name)
        return
    got = storage.read(name)
    assert got is not None
    data = bytearray(got[0])
    if how == "truncated":
        data = data[: (start + end) // 2]
    else:
        data[(start + end) // 2] ^= 0xFF
    storage.write(name, bytes(data))


@pytest.mark.dist
@pytest.mark.parametrize("budget_mb", [None, 0], ids=["in-memory", "read-twice"])
@pytest.mark.parametrize("how", ["corrupt", "truncated", "missing"])
def test_a_damaged_tensor_is_named_and_a_restore_changes_nothing(
    how: str, budget_mb: int | None, any_root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _damaged_tensor(how, budget_mb, any_root, capsys)


@pytest.mark.dist
def test_a_corrupt_tensor_in_an_fsspec_store_is_named_and_a_restore_changes_nothing(
    fsspec_root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _damaged_tensor("corrupt", None, fsspec_root, capsys)


def _damaged_tensor(
    how: str, budget_mb: int | None, any_root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_ranks(2, _save_chain, any_root)
    assert cnr(["verify", any_root]) == 0
    last = Manifest.load(any_root).latest()
    assert last is not None and last.depth == 3
    got = open_storage(any_root).read(f"{last.id}/.snapshot_metadata")
    assert got is not None
    stored = json.loads(got[0])["manifest"]["0/rows/s0.w"]
    start, end = stored["byte_range"]
    _damage(any_root, f"{last.id}/{stored['location']}", start, end, how)
    capsys.readouterr()
    assert cnr(["verify", any_root]) == 1
    out = capsys.readouterr().out
    assert last.id in out and "s0.w" in out, out
    # A damaged byte names its tensor. A missing or truncated file holds several
    # tensors (torchsnapshot batches small ones), so each rank names the first it needs.
    error, needle = (
        (ChecksumError, "s0.w is corrupt") if how == "corrupt" else (CheckpointReadError, last.id)
    )
    run_ranks(2, _restore_refused_and_nothing_changed, any_root, error, needle, budget_mb)


def _manifest_error_on_every_rank(root: str) -> None:
    job = make_job(TABLES, seed=3, data_seed=4)  # the model first: its planning is not timed
    dist.barrier()
    began = time.monotonic()
    with pytest.raises(ManifestError, match=r"manifest\.json") as info:
        job.attach(root, policy="consecutive", timeouts=Timeouts(collective_timeout_s=120))
    assert "manifest.json.prev is intact (2 checkpoint(s), latest step 4)" in str(info.value)
    # No rank waited for the others until a collective timed out.
    assert time.monotonic() - began < 60, "every rank must learn of it at once"


def _falls_back(root: str) -> None:
    job = _job(root, seed=3, manifest_fallback=True)
    assert job.ckpt.restore() == 4
    job.train(2)
    job.ckpt.save(6)
    job.ckpt.close()


@pytest.mark.dist
@pytest.mark.parametrize("how", ["flipped", "truncated", "deleted", "garbage"])
def test_a_damaged_manifest_fails_every_rank_at_once_and_the_previous_one_is_kept(
    how: str, any_root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_ranks(2, _save_chain, any_root)
    storage = open_storage(any_root)
    got = storage.read("manifest.json")
    assert got is not None
    data = bytearray(got[0])
    # The previous committed manifest is the one the last commit (step 6) replaced.
    if how == "deleted":
        storage.delete("manifest.json")
    elif how == "truncated":
        storage.write("manifest.json", bytes(data[: len(data) // 2]))
    elif how == "garbage":
        storage.write("manifest.json", b"\x00\x17 not a manifest")
    else:
        data[data.index(b'"step":4,') + 7] ^= 0x01  # step 4 becomes step 5: valid JSON
        storage.write("manifest.json", bytes(data))
    run_ranks(2, _manifest_error_on_every_rank, any_root)
    capsys.readouterr()
    assert cnr(["verify", any_root]) == 1
    out = capsys.readouterr().out
    assert "the previous committed manifest names steps [2, 4]" in out, out
    assert "every checksum matches" in out and "manifest_fallback=True" in out
    with pytest.warns(UserWarning, match="using the previous committed manifest"):
        previous = Manifest.load(any_root, fallback=True)
    assert previous.steps() == [2, 4]
    run_ranks(2, _falls_back, any_root)
    assert Manifest.load(any_root).steps() == [2, 4, 6]
    assert cnr(["verify", any_root]) == 0


def test_corrupt_manifest_is_named(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="manifest.json"):
        Manifest.load(tmp_path)


@pytest.mark.dist
@pytest.mark.parametrize("file", ["checkpoint.json", "shards-1.json", "shards.json"])
@pytest.mark.parametrize("how", ["corrupt", "truncated", "missing"])
def test_a_damaged_checkpoint_record_is_named_and_a_restore_changes_nothing(
    how: str, file: str, any_root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The record, a rank's part of its shard records (what that rank's restore reads), or
    every rank's (what a follower, a resharding restore and the offline readers read)."""
    run_ranks(2, _save_chain, any_root)
    manifest = Manifest.load(any_root)
    last = manifest.latest()
    assert last is not None
    link = manifest.chain(last)[1]  # a delta the restore of the latest applies
    name = f"{link}/{file}"
    got = open_storage(any_root).read(name)
    assert got is not None
    _damage(any_root, name, 0, len(got[0]), how)
    capsys.readouterr()
    assert cnr(["verify", any_root]) == 1
    out = capsys.readouterr().out
    assert name in out, out
    if file == "shards.json":  # a restore on the same sharding reads its parts alone
        run_ranks(2, _restore_step, any_root, last.step)
        with pytest.raises(CheckpointReadError, match=name):
            export_state_dict(any_root)
    else:
        run_ranks(
            2, _restore_refused_and_nothing_changed, any_root, CheckpointReadError, name, None
        )


def _save_long_history(root: str) -> None:
    # Compactions run beside the commits; until one lands, the checkpoints from the one it
    # compacts stay out of the sealed history: save until a segment is sealed.
    job = _job(root, seed=1, compact_every=2)
    step = 0
    while step < 2 * TAIL + 4 or Manifest.load(root).history is None:
        assert step < 300, "no history segment was ever sealed"
        step += 1
        job.train(1)
        job.ckpt.save(step)
        job.ckpt.wait()
    job.ckpt.close()


def _restore_step(root: str, step: int) -> None:
    job = _job(root, seed=3)
    assert job.ckpt.restore(step) == step
    job.ckpt.close()


@pytest.mark.dist
def test_a_damaged_history_segment_is_named_and_the_latest_still_restores(
    every_root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_ranks(2, _save_long_history, every_root)
    manifest = Manifest.load(every_root)
    assert manifest.history is not None
    old = manifest.checkpoints[0].step
    got = open_storage(every_root).read(manifest.history.name)
    assert got is not None
    _damage(every_root, manifest.history.name, 0, len(got[0]), "corrupt")
    capsys.readouterr()
    assert cnr(["verify", every_root]) == 1
    out = capsys.readouterr().out
    assert f"{manifest.history.name} is not valid JSON" in out, out
    refused = (ManifestError, manifest.history.name, None, old)
    run_ranks(2, _restore_refused_and_nothing_changed, every_root, *refused)
    latest = manifest.latest()
    assert latest is not None
    run_ranks(2, _restore_step, every_root, latest.step)
    with pytest.raises(ManifestError, match=manifest.history.name):
        Manifest.load(every_root).find(old)


END = 10
"""The step the jobs of the fall-back test train to."""


def _save_chain_and_go_on(root: str, refs: str, policy: str) -> None:
    job = _job(root, seed=1, policy=policy)
    for step in range(1, END + 1):
        job.step(step)
        if step in (2, 4, 6):
            job.ckpt.save(step)
            job.ckpt.wait()
            save_reference(job, refs, step)
    save_reference(job, refs, END)  # the uninterrupted job's state
    job.ckpt.close()


def _resumes_past_the_damage(root: str, refs: str, policy: str, on_damaged: str) -> None:
    job = _job(root, seed=3, policy=policy, on_damaged=on_damaged)
    with logged("torchrec_cnr.manager", logging.WARNING) as warned:
        start = job.ckpt.restore()
    assert start == 2
    if dist.get_rank() == 0:
        manifest = Manifest.load(root)
        latest = [e for e in manifest.checkpoints if e.step == 6] if on_damaged != "retire" else []
        said = " ".join(warned)
        assert "step 6" in said and "restored step 2" in said, said
        assert all(e.id in said for e in latest), said
    for step in range(start + 1, END + 1):
        job.step(step)
    # Trained on from the intact checkpoint, it ends where the job that never stopped did.
    reference.assert_model_matches(job.model, job.app_state, reference.load_all(Path(refs), END))
    job.ckpt.save(END)
    job.ckpt.close()


@pytest.mark.dist
@pytest.mark.parametrize("on_damaged", ["fall_back", "retire"])
@pytest.mark.parametrize("policy", ["consecutive", "intermittent"])
def test_a_restore_past_a_damaged_latest_resumes_from_the_newest_intact_checkpoint(
    policy: str, on_damaged: str, root: str, refs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_ranks(2, _save_chain_and_go_on, root, str(refs), policy)
    manifest = Manifest.load(root)
    four = manifest.find(4)
    assert four is not None
    # Step 4's stored rows are corrupt: consecutive, step 6's chain holds it; intermittent,
    # step 6 is a delta on it (its rule took a baseline at 4) or on 2, whose chain is intact.
    got = open_storage(root).read(f"{four.id}/.snapshot_metadata")
    assert got is not None
    stored = json.loads(got[0])["manifest"]["0/rows/s0.w"]
    start, end = stored["byte_range"]
    _damage(root, f"{four.id}/{stored['location']}", start, end, "corrupt")
    six = manifest.find(6)
    assert six is not None
    if four.id not in manifest.chain(six):  # then 6 restores: damage it as well
        got = open_storage(root).read(f"{six.id}/.snapshot_metadata")
        assert got is not None
        stored = json.loads(got[0])["manifest"]["0/rows/s0.w"]
        start, end = stored["byte_range"]
        _damage(root, f"{six.id}/{stored['location']}", start, end, "corrupt")
    # Without the option, the restore names the damage and changes nothing.
    run_ranks(2, _restore_refused_and_nothing_changed, root, ChecksumError, "corrupt", None)
    run_ranks(2, _resumes_past_the_damage, root, str(refs), policy, on_damaged)
    capsys.readouterr()
    if on_damaged == "fall_back":  # nothing was deleted: the damage is still there
        assert cnr(["verify", root]) == 1
        assert "cnr retire" in capsys.readouterr().out
        assert {four.id, six.id} <= {e.id for e in Manifest.load(root).checkpoints}
        assert cnr(["retire", root, "--damaged"]) == 0
        assert f"the latest is now step {END}" in capsys.readouterr().out
    assert Manifest.load(root).steps() == [2, END], "the damaged and what builds on them left"
    assert set(open_storage(root).children()) == {e.id for e in Manifest.load(root).checkpoints}
    assert cnr(["verify", root]) == 0
    assert cnr(["inspect", root]) == 0
