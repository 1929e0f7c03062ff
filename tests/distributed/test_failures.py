"""Background writes: training goes on meanwhile, failures surface and lose
nothing, and damaged files are named by restore and by ``cnr verify``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from torchsnapshot import Snapshot

from cnr_train.workload import TableSpec
from tests import reference
from tests.jobs import Job, make_job
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointError, CheckpointReadError, ChecksumError
from torchrec_cnr.cli import main as cnr
from torchrec_cnr.commit import Manifest

TABLES = [
    TableSpec("a", 400, 16, "table_wise"),
    TableSpec("b", 300, 16, "column_wise"),
    TableSpec("c", 200, 16, "table_wise"),
]


def _job(root: str, seed: int, **config) -> Job:
    return make_job(TABLES, root, seed=seed, data_seed=4, **config)


def _restore_matches(root: str, refs: str, step: int, policy: str = "consecutive") -> None:
    job = _job(root, seed=90, policy=policy)
    assert job.ckpt.restore() == step
    reference.assert_model_matches(job.model, job.app, reference.load_all(Path(refs), step))


# -- training during a write; back-pressure --------------------------------


def _trains_while_writing(root: str, refs: str) -> None:
    job = _job(root, seed=1, policy="consecutive", on_busy="skip")
    job.train(2)
    assert job.ckpt.save(2)
    reference.save(reference.take(job.model, job.app), Path(refs), 2)
    in_flight = job.ckpt._in_flight
    assert in_flight is not None and not in_flight.future.done(), "save must return mid-write"
    job.train(2)  # trains while step 2 is being written (3 s injected delay)
    with pytest.warns(UserWarning, match="checkpoint of step 4 skipped"):
        assert not job.ckpt.save(4)
    job.ckpt.wait()
    assert Manifest.load(root).steps() == [2]
    job.train(2)
    assert job.ckpt.save(6)  # holds the rows of steps 3..6, including the skipped interval
    reference.save(reference.take(job.model, job.app), Path(refs), 6)
    job.ckpt.wait()


@pytest.mark.dist
def test_training_continues_during_a_write_and_a_skipped_save_loses_nothing(
    tmp_path, monkeypatch
) -> None:
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    monkeypatch.setenv("TORCHREC_CNR_INJECT_FAULT", "delay@2:*")
    run_ranks(2, _trains_while_writing, root, str(refs))
    monkeypatch.delenv("TORCHREC_CNR_INJECT_FAULT")
    run_ranks(2, _restore_matches, root, str(refs), 6)


# -- injected I/O error ----------------------------------------------------


def _io_error_then_recover(root: str, refs: str, policy: str) -> None:
    job = _job(root, seed=1, policy=policy)
    job.train(2)
    job.ckpt.save(2)
    job.ckpt.wait()
    job.train(2)
    job.ckpt.save(4)  # rank 1 fails with ENOSPC in the background
    with pytest.raises(CheckpointError, match="step 4 failed"):
        job.ckpt.wait()
    assert Manifest.load(root).steps() == [2], "a failed checkpoint must not commit"
    job.train(2)
    job.ckpt.save(6)
    reference.save(reference.take(job.model, job.app), Path(refs), 6)
    job.ckpt.wait()


@pytest.mark.dist
@pytest.mark.parametrize("policy", ["consecutive", "intermittent"])
def test_injected_io_error_surfaces_keeps_previous_and_carries_rows(
    policy, tmp_path, monkeypatch
) -> None:
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    monkeypatch.setenv("TORCHREC_CNR_INJECT_FAULT", "oserror@4:1")
    run_ranks(2, _io_error_then_recover, root, str(refs), policy)
    monkeypatch.delenv("TORCHREC_CNR_INJECT_FAULT")
    assert Manifest.load(root).steps() == [2, 6]
    run_ranks(2, _restore_matches, root, str(refs), 6, policy)


# -- a rank killed mid-write -------------------------------------------------


def _save_then_get_killed(root: str, refs: str) -> None:
    job = _job(root, seed=1, policy="consecutive")
    job.train(2)
    job.ckpt.save(2)
    reference.save(reference.take(job.model, job.app), Path(refs), 2)
    job.ckpt.wait()
    job.train(2)
    job.ckpt.save(4)  # rank 1 is SIGKILLed inside the background write
    job.ckpt.wait()


def _restore_then_save_again(root: str, refs: str) -> None:
    job = _job(root, seed=5, policy="consecutive")
    assert job.ckpt.restore() == 2
    reference.assert_model_matches(job.model, job.app, reference.load_all(Path(refs), 2))
    job.train(3)
    job.ckpt.save(5)
    reference.save(reference.take(job.model, job.app), Path(refs), 5)
    job.ckpt.wait()


@pytest.mark.dist
def test_rank_killed_mid_write_leaves_previous_checkpoint_exact(tmp_path, monkeypatch) -> None:
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    monkeypatch.setenv("TORCHREC_CNR_INJECT_FAULT", "sigkill@4:1")
    monkeypatch.setenv("TORCHREC_CNR_COLLECTIVE_TIMEOUT_S", "30")
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        run_ranks(2, _save_then_get_killed, root, str(refs))
    monkeypatch.delenv("TORCHREC_CNR_INJECT_FAULT")
    assert Manifest.load(root).steps() == [2]
    assert any(p.name.endswith("step0000000004") for p in Path(root).iterdir()), (
        "the killed write left files"
    )
    run_ranks(2, _restore_then_save_again, root, str(refs))
    assert Manifest.load(root).steps() == [2, 5]
    run_ranks(2, _restore_matches, root, str(refs), 5)


# -- damaged files -----------------------------------------------------------


def _save_two(root: str) -> None:
    job = _job(root, seed=1, policy="consecutive")
    for step in (2, 4):
        job.train(2)
        job.ckpt.save(step)
    job.ckpt.wait()


def _restore_fails(root: str, error: type[Exception], needle: str) -> None:
    job = _job(root, seed=3, policy="consecutive")
    with pytest.raises(error, match=needle):
        job.ckpt.restore()
    job.ckpt.close()


def _damage(path: Path, byte_range: list[int], how: str) -> None:
    """Damages the bytes of one stored tensor inside torchsnapshot's (possibly batched) file."""
    start, end = byte_range
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        os.truncate(path, (start + end) // 2)
    else:
        data = bytearray(path.read_bytes())
        data[(start + end) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.dist
@pytest.mark.parametrize("how", ["corrupt", "truncated", "missing"])
def test_damaged_file_is_named_by_restore_and_cnr_verify(how: str, tmp_path: Path, capsys) -> None:
    root = tmp_path / "ckpt"
    run_ranks(2, _save_two, str(root))
    assert cnr(["verify", str(root)]) == 0
    delta = Manifest.load(root).checkpoints[1].id
    stored = Snapshot(str(root / delta)).get_manifest()["0/rows/s0.w"]
    _damage(root / delta / stored.location, stored.byte_range, how)  # type: ignore[attr-defined]
    capsys.readouterr()
    assert cnr(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert delta in out and "s0.w" in out, out
    # A damaged byte names its tensor. A missing or truncated file holds several
    # tensors (torchsnapshot batches small ones), so each rank names the first it needs.
    error, needle = (
        (ChecksumError, "s0.w is corrupt") if how == "corrupt" else (CheckpointReadError, delta)
    )
    run_ranks(2, _restore_fails, str(root), error, needle)
