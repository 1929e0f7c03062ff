"""Failures that leave nothing behind: a full disk, a root that cannot be written, and
restores that fail without touching the model.

- A save that fails for lack of space raises ``CheckpointError`` on every rank, and its
  files are gone at once; ``close()`` never raises for the lease; a manager on a root it
  cannot write fails as it is built, naming the cause, and one that only restores
  (``read_only``) restores exactly; saving resumes once space returns. On a real tmpfs (root only) and, with injected ENOSPC at
  an object, the manifest and the lease, on every backend.
- An export (DCP, or a file) that does not fit a real full tmpfs fails saying so (ENOSPC),
  keeps the export that was there, even with ``overwrite``, and leaves nothing of its own.
- A restore that fails (an ``app_state`` that refuses its state on one rank, data that
  does not fit) leaves the weights, every optimizer state, the dense parameters and every
  ``app_state`` object bit-identical; an uninitialized TorchRec ``KeyedOptimizer`` in
  ``app_state`` is initialized before it loads.
- A SIGINT while a restore reads stops it with nothing changed; one while it changes the
  model is raised once the model, its optimizer state and the manager's chain are whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib
import os
import shutil
import signal
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from cnr_train.workload import TableSpec
from tests import reference
from tests.faults import Fault, FaultyStorage
from tests.jobs import Job, make_job, restores_exactly, save_reference
from tests.models import capture, differences
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointConfig, CheckpointError, CheckpointManager, export_dcp
from torchrec_cnr.cli import main as cnr
from torchrec_cnr.interop import ExportOptions
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.manifest.records import record_bytes
from torchrec_cnr.offline import export_state_dict, save_export
from torchrec_cnr.schema import part_bytes, part_path, record_path
from torchrec_cnr.storage import open_storage

TABLES = [
    TableSpec("a", 400, 16, "table_wise"),
    TableSpec("b", 300, 16, "column_wise"),
    TableSpec("c", 200, 16, "row_wise"),
]


def _job(root: str | None, seed: int, **config: Any) -> Job:
    return make_job(TABLES, root, seed=seed, data_seed=4, **config)


def _uncommitted(root: str) -> list[str]:
    """Checkpoint directories the manifest does not name."""
    named = {e.id for e in Manifest.load(root).checkpoints}
    return sorted(set(open_storage(root).children()) - named)


# -- injected ENOSPC: an object, the manifest, the lease ------------------------


def _object_or_manifest_write_fails(root: str, refs: str, where: str) -> None:
    storage = FaultyStorage(root)
    job = _job(root, seed=1, policy="consecutive", storage=storage)
    job.train(2)
    job.ckpt.save(2)
    job.ckpt.wait()
    failing_rank = 1 if where == "object" else 0  # rank 0 commits the manifest
    if dist.get_rank() == failing_rank:
        op, name = (
            ("write_object", "step0000000004") if where == "object" else ("write", "manifest.json")
        )
        storage.faults.append(Fault(op, name, times=1))
    job.train(2)
    job.ckpt.save(4)
    with pytest.raises(CheckpointError, match="step 4 failed.*No space left|no space left"):
        job.ckpt.wait()
    dist.barrier()
    assert Manifest.load(root).steps() == [2], "a failed checkpoint must not commit"
    left = {d: sorted(str(p.relative_to(root)) for p in Path(root, d).rglob("*"))
            for d in _uncommitted(root)}  # fmt: skip
    assert not left, f"the failed checkpoint's files must be gone at once: {left}"
    job.train(2)
    job.ckpt.save(6)  # holds every row changed since step 2
    save_reference(job, refs, 6)
    job.ckpt.close()


@pytest.mark.dist
@pytest.mark.parametrize("where", ["object", "manifest"])
def test_enospc_fails_the_save_on_every_rank_and_removes_its_files(
    where: str, any_root: str, refs: Path
) -> None:
    run_ranks(2, _object_or_manifest_write_fails, any_root, str(refs), where)
    assert Manifest.load(any_root).steps() == [2, 6]
    run_ranks(2, restores_exactly, TABLES, any_root, str(refs), 6, latest=True, seed=90,
              data_seed=4, policy="consecutive")  # fmt: skip


def _save_two(root: str, refs: str) -> None:
    job = _job(root, seed=1, policy="consecutive")
    for step in (2, 4):
        job.train(2)
        job.ckpt.save(step)
        save_reference(job, refs, step)
    job.ckpt.close()


def _lease_cannot_be_written(root: str, refs: str) -> None:
    # The claim writes the lease first: a root with no space left (or read-only) fails the
    # manager as it is built, before any training, on every rank alike.
    storage = FaultyStorage(root, Fault("write", "lease.json"))
    job = _job(None, seed=7)
    with pytest.raises(CheckpointError, match=r"cannot be written \(OSError: .*no space left"):
        job.attach(root, storage, policy="consecutive")
    # A job that only restores from it claims nothing, and restores exactly.
    job.attach(root, storage, policy="consecutive", read_only=True)
    assert job.ckpt.restore() == 4
    reference.assert_model_matches(job.model, job.app_state, reference.load_all(Path(refs), 4))
    job.train(2)
    with pytest.raises(CheckpointError, match=r"read_only=True"):
        job.ckpt.save(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to release: not even a warning
        job.ckpt.close()


def _lease_release_fails(root: str) -> None:
    storage = FaultyStorage(root)
    job = _job(root, seed=7, policy="consecutive", storage=storage)
    assert job.ckpt.restore() == 4
    storage.faults.append(Fault("write", "lease.json"))
    if dist.get_rank() == 0:
        with pytest.warns(UserWarning, match="could not release the lease"):
            job.ckpt.close()
    else:
        job.ckpt.close()


@pytest.mark.dist
def test_a_root_that_cannot_be_written_still_restores_and_close_never_raises(
    every_root: str, refs: Path
) -> None:
    run_ranks(2, _save_two, every_root, str(refs))
    run_ranks(2, _lease_cannot_be_written, every_root, str(refs))
    run_ranks(2, _lease_release_fails, every_root)
    assert Manifest.load(every_root).steps() == [2, 4]


# -- a real full file system ---------------------------------------------------


def _mount(path: Path, size: str, remount: bool = False) -> bool:
    opts = f"remount,size={size}" if remount else f"size={size}"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


@contextlib.contextmanager
def _tmpfs_of_1mb(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MB tmpfs, unmounted at the end; the test is skipped where root cannot
    mount one."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if not _mount(mnt, "1m"):
        pytest.skip("this machine does not let root mount a tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        shutil.rmtree(mnt, ignore_errors=True)


def _fill(path: Path) -> None:
    """Takes every byte left on the file system of ``path``."""
    try:
        with open(path / "filler", "ab") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError as e:
        assert e.errno == errno.ENOSPC


def _save_until_full(root: str, refs: str) -> None:
    job = _job(root, seed=1, policy="full")
    committed = 0
    for step in range(2, 400, 2):
        job.train(2)
        job.ckpt.save(step)
        try:
            job.ckpt.wait()
        except CheckpointError as e:  # on every rank, with the cause
            assert "No space left on device" in str(e), e
            break
        committed = step
        save_reference(job, refs, step)
    else:
        pytest.fail("the file system never filled up")
    dist.barrier()
    assert committed > 0 and Manifest.load(root).steps()[-1] == committed
    left = {d: sorted(str(p.relative_to(root)) for p in Path(root, d).rglob("*"))
            for d in _uncommitted(root)}  # fmt: skip
    assert not left, f"the failed checkpoint's files must be gone at once: {left}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lease may not be writable: a warning at most
        job.ckpt.close()


def _restore_on_full_disk(root: str, refs: str) -> None:
    job = _job(None, seed=5)
    try:
        job.attach(root, policy="full")
    except CheckpointError as e:  # claiming writes the lease: refused at once, every rank
        assert "No space left on device" in str(e), e
        job.attach(root, policy="full", read_only=True)
    step = Manifest.load(root).steps()[-1]
    assert job.ckpt.restore() == step
    reference.assert_model_matches(job.model, job.app_state, reference.load_all(Path(refs), step))
    job.train(2)
    with pytest.raises(CheckpointError):
        job.ckpt.save(step + 2)
        job.ckpt.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        job.ckpt.close()


def _save_after_growth(root: str, refs: str) -> None:
    job = _job(root, seed=5, policy="full")
    step = job.ckpt.restore()
    assert step is not None
    job.train(2)
    job.ckpt.save(step + 2)
    save_reference(job, refs, step + 2)
    job.ckpt.close()


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_a_real_full_tmpfs_fails_saves_cleanly_restores_and_recovers(tmp_path: Path) -> None:
    refs = tmp_path / "refs"
    refs.mkdir()
    with _tmpfs_of_1mb(tmp_path) as mnt:
        root = str(mnt / "ckpt")
        run_ranks(2, _save_until_full, root, str(refs))
        _fill(mnt)  # nothing left, not even for a lease
        run_ranks(2, _restore_on_full_disk, root, str(refs))
        assert _uncommitted(root) == []
        assert _mount(mnt, "16m", remount=True)
        (mnt / "filler").unlink(missing_ok=True)
        run_ranks(2, _save_after_growth, root, str(refs))
        last = Manifest.load(root).steps()[-1]
        run_ranks(2, restores_exactly, TABLES, root, str(refs), last, latest=True, seed=91,
                  data_seed=4, policy="full")  # fmt: skip


EXPORTED = {"small": TABLES[:1], "large": [TableSpec("big", 20_000, 32, "table_wise")]}
"""The roots exported onto a full disk: one that fits in 1 MB, one that does not."""


def _save_and_export(tmp: str, out: str) -> None:
    """A DCP export that does not fit fails on every rank saying so, and leaves the
    export that was there (even with ``overwrite``) and nothing of its own."""
    for name, tables in EXPORTED.items():
        job = make_job(tables, f"{tmp}/{name}", seed=1, policy="full")
        job.ckpt.save(2)
        job.ckpt.close()
    group = dist.group.WORLD
    export_dcp(f"{tmp}/small", out, group=group)
    before = sorted(p.name for p in Path(out).iterdir())
    for overwrite in (False, True):
        with pytest.raises(OSError) as failed:
            options = ExportOptions(overwrite=overwrite)
            export_dcp(f"{tmp}/large", out, options=options, group=group)
        if overwrite:
            assert failed.value.errno == errno.ENOSPC, failed.value
            assert "no space left on device" in str(failed.value), failed.value
        else:
            assert isinstance(failed.value, FileExistsError), failed.value
        dist.barrier()  # every rank has failed: then nothing of it is left
        listed = sorted(p.name for p in Path(out).parent.iterdir())
        assert listed == ["out"], (overwrite, listed, failed.value)
        assert sorted(p.name for p in Path(out).iterdir()) == before
        dist.barrier()  # every rank has looked before the next export begins


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_exports_that_do_not_fit_a_real_full_tmpfs_fail_saying_so_and_keep_the_earlier_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``export_dcp`` (2 ranks), ``save_export`` and ``cnr export`` on a 1 MB tmpfs: a clear
    ENOSPC where torch's writer says ``unexpected pos``, the export that was there
    unchanged, and no half-written files."""
    with _tmpfs_of_1mb(tmp_path) as mnt:
        out = mnt / "dcp" / "out"
        run_ranks(2, _save_and_export, str(tmp_path), str(out))
        shutil.rmtree(mnt / "dcp")
        small = export_state_dict(str(tmp_path / "small"))
        save_export(small, mnt / "model.pt")
        with pytest.raises(OSError) as failed:
            save_export(export_state_dict(str(tmp_path / "large")), mnt / "model.pt")
        assert failed.value.errno == errno.ENOSPC, failed.value
        assert sorted(p.name for p in mnt.iterdir()) == ["model.pt"]
        assert differences(torch.load(mnt / "model.pt"), small) == []
        # The command line says so in a line, exit status 1, no traceback.
        assert cnr(["export", str(tmp_path / "large"), "--out", str(mnt / "model.pt")]) == 1
        said = capsys.readouterr().err
        assert "\nerror: [Errno 28] no space left on device" in said, said
        assert "Traceback" not in said, said
        assert sorted(p.name for p in mnt.iterdir()) == ["model.pt"]


# -- restores that fail change nothing ------------------------------------------


class _Refuses:
    """An app_state object that refuses its saved state on one rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.value = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if dist.get_rank() == self.rank:
            raise RuntimeError("this object refuses its state")
        self.value.copy_(state["value"])


def _save_with_extra(root: str) -> None:
    job = _job(root, seed=1, policy="consecutive")
    job.ckpt.close()
    extra = _Refuses(rank=-1)
    extra.value += dist.get_rank() + 1
    app = {**job.app_state, "extra": extra}
    ckpt = CheckpointManager(job.model, CheckpointConfig(path=root, policy="consecutive"), app)
    for step in (2, 4):
        job.train(2)
        ckpt.save(step)
    ckpt.close()


def _app_state_refuses(root: str) -> None:
    job = _job(root, seed=3, policy="consecutive")
    job.train(1)  # a dense optimizer with state, so that its rollback is visible
    job.ckpt.close()
    extra = _Refuses(rank=1)
    app = {**job.app_state, "extra": extra}
    ckpt = CheckpointManager(job.model, CheckpointConfig(path=root, policy="consecutive"), app)
    before = capture(job.model, app)
    with pytest.raises(CheckpointError, match=r"app_state 'extra' on rank 1 refused"):
        ckpt.restore()
    assert not differences(before, capture(job.model, app)), "a failed restore changed the model"
    ckpt.close()


def _data_does_not_fit(root: str) -> None:
    job = _job(root, seed=3, policy="consecutive", verify_checksums=False)
    before = capture(job.model, job.app_state)
    with pytest.raises(CheckpointError, match="failed before any change.*holds .* rows"):
        job.ckpt.restore()
    assert not differences(before, capture(job.model, job.app_state)), (
        "a failed restore changed the model"
    )
    job.ckpt.close()


@pytest.mark.dist
def test_a_restore_that_fails_anywhere_leaves_model_and_app_state_bit_identical(
    root: str,
) -> None:
    run_ranks(2, _save_with_extra, root)
    run_ranks(2, _app_state_refuses, root)
    # A record that promises more rows than a stored tensor holds: read, then refused.
    manifest = Manifest.load(root)
    last = manifest.record(manifest.checkpoints[-1])
    shards = manifest.shards(last)
    rec = next(r for r in shards if not r.all_rows and r.saved_rows > 0)
    rec.saved_rows += 1
    storage, parts = open_storage(root), dict(last.shard_parts)
    for rank in (None, rec.spec.rank):  # every rank's shard records, and its rank's part
        mine = shards if rank is None else [r for r in shards if r.spec.rank == rank]
        data, parts["all" if rank is None else str(rank)] = part_bytes(last.id, rank, mine)
        storage.write(part_path(last.id, rank), data)
    storage.write(record_path(last.id), record_bytes(dataclasses.replace(last, shard_parts=parts)))
    run_ranks(2, _data_does_not_fit, root)


def _keyed_optimizer_job(root: str, seed: int) -> tuple[Job, Any]:
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    job = _job(root, seed=seed, policy="consecutive")
    job.ckpt.close()
    dense = {n: p for n, p in job.model.named_parameters() if "embedding" not in n}
    # Adam makes its state at the first step: a fresh one has none.
    keyed = KeyedOptimizerWrapper(dense, lambda params: torch.optim.Adam(params, lr=0.01))
    return job, keyed


def _keyed_optimizer_saves(root: str) -> None:
    job, keyed = _keyed_optimizer_job(root, seed=1)
    ckpt = CheckpointManager(job.model, CheckpointConfig(path=root), {"keyed": keyed})
    job.train(2)
    keyed.init_state()  # state to save
    keyed.step()
    ckpt.save(2)
    ckpt.close()
    torch.save(keyed.state_dict(), f"{root}-keyed-{dist.get_rank()}.pt")


def _keyed_optimizer_restores(root: str) -> None:
    job, keyed = _keyed_optimizer_job(root, seed=2)
    assert not keyed.state, "a fresh KeyedOptimizer has no state"
    ckpt = CheckpointManager(job.model, CheckpointConfig(path=root), {"keyed": keyed})
    assert ckpt.restore() == 2
    saved = torch.load(f"{root}-keyed-{dist.get_rank()}.pt", weights_only=False)
    assert not differences(saved["state"], keyed.state_dict()["state"])
    ckpt.close()


@pytest.mark.dist
def test_an_uninitialized_keyed_optimizer_in_app_state_is_initialized_before_it_loads(
    root: str,
) -> None:
    run_ranks(2, _keyed_optimizer_saves, root)
    run_ranks(2, _keyed_optimizer_restores, root)


# -- a signal while a restore runs ----------------------------------------------


@contextlib.contextmanager
def _sigint_inside(target: str) -> Iterator[list[int]]:
    """``target`` (a module's function, by dotted name) sends this process SIGINT the first
    time it is called, then runs; yields the calls it sent one in."""
    module, name = target.rsplit(".", 1)
    real = getattr(importlib.import_module(module), name)
    sent: list[int] = []

    def sends(*args: Any, **kwargs: Any) -> Any:
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    # Python's own SIGINT handler, as in a process started in the foreground (one started
    # in the background by a shell ignores SIGINT).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with mock.patch(target, sends):
            yield sent
    finally:
        signal.signal(signal.SIGINT, previous)


def _restore_interrupted(root: str) -> None:
    job = _job(root, seed=5, policy="consecutive")
    for step in (2, 4):
        job.train(2)
        job.ckpt.save(step)
    job.ckpt.wait()
    at_4 = capture(job.model, job.app_state)
    job.train(3)
    moved = capture(job.model, job.app_state)
    # While the checkpoint is read: raised at once, nothing changed.
    with _sigint_inside("torchrec_cnr.restore.collective.read_chain") as sent:
        with pytest.raises(KeyboardInterrupt):
            job.ckpt.restore()
    assert sent and not differences(moved, capture(job.model, job.app_state))
    # While the delta's rows are copied in: raised from restore() once the model, its
    # optimizer state and the manager's chain are those of step 4, whole.
    with _sigint_inside("torchrec_cnr.restore.apply.scatter_weight") as sent:
        with pytest.raises(KeyboardInterrupt):
            job.ckpt.restore()
    assert sent and not differences(at_4, capture(job.model, job.app_state))
    job.train(2)
    job.ckpt.save(6)  # a delta on the restored chain
    job.ckpt.wait()
    at_6 = capture(job.model, job.app_state)
    job.train(1)
    assert job.ckpt.restore() == 6
    assert not differences(at_6, capture(job.model, job.app_state))
    job.ckpt.close()


@pytest.mark.dist
def test_a_sigint_inside_restore_is_raised_at_once_while_reading_and_after_the_model_is_whole(
    tmp_path: Path,
) -> None:
    """Ctrl-C under torchrun reaches every rank: arriving while a restore reads, it stops it
    with nothing changed; arriving while it copies rows in, it is raised once the restore
    is whole, and training on from it saves and restores exactly."""
    run_ranks(2, _restore_interrupted, str(tmp_path / "root"))
