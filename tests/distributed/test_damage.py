"""Damage to a root's files is named, never half-applied, and never hangs a job, on
every storage backend.

- A damaged or missing tensor in the last checkpoint of a chain: ``cnr verify`` names
  it; a restore raises on every rank and leaves the model exactly as it was, whether the
  chain fits in host memory or is read twice.
- A damaged, truncated, deleted or garbage manifest: every rank raises the same
  ``ManifestError`` naming it within seconds; ``cnr verify`` says the previous committed
  manifest is intact, and ``manifest_fallback=True`` restores from it.
- A damaged, truncated or missing checkpoint record or shard record, or history segment:
  named by ``cnr verify`` and by a restore, which changes nothing.
- A missing baseline: a restore of a chain on it names it and changes nothing.
- A damaged block of rows: a resharding restore that reads only some blocks of a saved
  shard fails on every rank, whether it holds its windows or reads them twice.
- ``on_damaged``: a restore can go past a damaged latest checkpoint to the newest intact one.

What ``Manifest.load`` names in one process (a manifest, a record, a history segment) is
tested in ``tests/unit/test_damage_unit.py``. Follower updates over damaged files are
tested with the follower (``tests/contract/test_follower.py``), a damaged DCP checkpoint
with the DCP import (``test_dcp.py``), and a flipped byte in one object with the snapshot
reader (``tests/unit/test_snapshot.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from cnr_train.workload import TableSpec
from tests import logged, reference
from tests.jobs import Job, assert_restore_refused, make_job, save_reference
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointReadError, ManifestError, Timeouts, export_state_dict
from torchrec_cnr.cli import main as cnr
from torchrec_cnr.errors import ChecksumError
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.manifest.store import TAIL
from torchrec_cnr.read import ChainReader
from torchrec_cnr.schema import rows_path
from torchrec_cnr.storage import open_storage

TABLES = [
    TableSpec("a", 400, 16, "table_wise"),
    TableSpec("b", 300, 16, "column_wise"),
    TableSpec("c", 4001, 16, "row_wise"),
]


def _job(
    root: str, seed: int, policy: str = "consecutive", tables: list[TableSpec] = TABLES, **config
) -> Job:
    return make_job(tables, root, seed=seed, data_seed=4, policy=policy, **config)


def _save(
    root: str,
    steps: tuple[int, ...] = (2, 4, 6),
    tables: list[TableSpec] = TABLES,
    policy: str = "consecutive",
) -> None:
    """Trains a step at a time to the last of ``steps``, saving at each."""
    job = _job(root, seed=1, policy=policy, tables=tables)
    for step in range(1, max(steps) + 1):
        job.train(1)
        if step in steps:
            job.ckpt.save(step)
    job.ckpt.close()


def _refused(
    root: str,
    error: type[Exception],
    needle: str,
    budget_mb: float | None = None,
    step: int | None = None,
    tables: list[TableSpec] = TABLES,
    policy: str = "consecutive",
) -> None:
    job = _job(root, seed=3, policy=policy, tables=tables, restore_memory_mb=budget_mb)
    assert_restore_refused(job, error, [needle], step)


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
    run_ranks(2, _save, any_root)
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
    run_ranks(2, _refused, any_root, error, needle, budget_mb)


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
    run_ranks(2, _save, any_root)
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


@pytest.mark.dist
@pytest.mark.parametrize("file", ["checkpoint.json", "shards-1.json", "shards.json"])
@pytest.mark.parametrize("how", ["corrupt", "truncated", "missing"])
def test_a_damaged_checkpoint_record_is_named_and_a_restore_changes_nothing(
    how: str, file: str, any_root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The record, a rank's part of its shard records (what that rank's restore reads), or
    every rank's (what a follower, a resharding restore and the offline readers read)."""
    run_ranks(2, _save, any_root)
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
        run_ranks(2, _refused, any_root, CheckpointReadError, name, None)


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
    run_ranks(2, _refused, every_root, *refused)
    latest = manifest.latest()
    assert latest is not None
    run_ranks(2, _restore_step, every_root, latest.step)
    with pytest.raises(ManifestError, match=manifest.history.name):
        Manifest.load(every_root).find(old)


MIXED = [
    TableSpec("a", 400, 16, "table_wise"),
    TableSpec("b", 300, 16, "column_wise"),
    TableSpec("c", 250, 16, "table_column_wise"),
    TableSpec("d", 120, 16, "data_parallel"),
]


@pytest.mark.dist
def test_missing_checkpoint_files_are_named_and_change_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(2, _save, str(root), (2, 4), MIXED, "intermittent")
    baseline = sorted(p for p in root.iterdir() if p.is_dir())[0]
    shutil.rmtree(baseline)
    refused = (CheckpointReadError, baseline.name, None, None, MIXED, "intermittent")
    run_ranks(2, _refused, str(root), *refused)


ROW_WISE = [TableSpec("r", 20000, 16, "row_wise"), TableSpec("s", 12000, 16, "row_wise")]
TABLE_WISE = [dataclasses.replace(t, sharding="table_wise") for t in ROW_WISE]


@pytest.mark.dist
@pytest.mark.parametrize("budget_mb", [None, 0.2])
def test_a_damaged_block_fails_a_resharding_restore_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget_mb: float | None
) -> None:
    """Saved table-wise in blocks of rows, each with its checksum; restored row-wise, each
    rank reading only the blocks its rows lie in: with every window held, or each read
    twice (``restore_memory_mb`` under one table's window)."""
    monkeypatch.setenv("TORCHREC_CNR_OBJECT_MB", "0.0625")  # 20 and 12 blocks of rows
    root = str(tmp_path / "ckpt")
    run_ranks(2, _save, root, (2,), TABLE_WISE, "intermittent")
    with ChainReader.open(root) as chain:
        rec = next(r for r in chain.link_records(-1) if r.spec.table.endswith(".r"))
        name = rec.weight_name(rec.key)
        assert len(rec.block_checksums[name]) == 1 + 20
        reader = chain.reader(-1)
        segments = reader._segments(rows_path(rec.spec.rank, name))
        assert segments is not None
        _, _, block = segments[-1]  # its last object: rows 19,xxx
    assert block.byte_range is not None
    data = Path(root, chain.entry.id, block.location)
    raw = bytearray(data.read_bytes())
    raw[block.byte_range[0] + 100] ^= 0xFF
    data.write_bytes(bytes(raw))
    refused = (ChecksumError, name, budget_mb, None, ROW_WISE, "intermittent")
    run_ranks(2, _refused, root, *refused)


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
    run_ranks(2, _refused, root, ChecksumError, "corrupt", None)
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
