"""Background writes: training goes on meanwhile, and failures surface and lose nothing
(damaged files: ``test_damage.py``)."""

from __future__ import annotations

import errno
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cnr_train.workload import TableSpec
from tests import reference
from tests.faults import Fault, FaultyStorage, cut_at
from tests.jobs import Job, assert_restores, make_job, restores_exactly, save_reference
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointError, Timeouts
from torchrec_cnr.errors import RemoteTraceback
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.storage import open_storage
from torchrec_cnr.tracking import model_state

TABLES = [
    TableSpec("a", 400, 16, "table_wise"),
    TableSpec("b", 300, 16, "column_wise"),
    TableSpec("c", 200, 16, "table_wise"),
]


def _job(root: str, seed: int, **config) -> Job:
    return make_job(TABLES, root, seed=seed, data_seed=4, **config)


def _restores_latest(root: str, refs: str, step: int, policy: str = "consecutive") -> None:
    restores_exactly(TABLES, root, refs, step, latest=True, seed=90, data_seed=4, policy=policy)


# -- training during a write; back-pressure --------------------------------


def _trains_while_writing(root: str, refs: str) -> None:
    hold = Fault("make_durable", "step0000000002", "hold")
    job = _job(
        root, seed=1, policy="consecutive", on_busy="skip", storage=FaultyStorage(root, hold)
    )
    job.train(2)
    assert job.ckpt.save(2)
    save_reference(job, refs, 2)
    assert job.ckpt._background.busy == "checkpoint of step 2", "save must return mid-write"
    job.train(2)  # trains while step 2 is being written (held until released below)
    with pytest.warns(UserWarning, match="checkpoint of step 4 skipped"):
        assert not job.ckpt.save(4)
    hold.released.set()
    job.ckpt.wait()
    assert Manifest.load(root).steps() == [2]
    job.train(2)
    assert job.ckpt.save(6)  # holds the rows of steps 3..6, including the skipped interval
    save_reference(job, refs, 6)
    job.ckpt.wait()


@pytest.mark.dist
def test_training_continues_during_a_write_and_a_skipped_save_loses_nothing(
    tmp_path, monkeypatch
) -> None:
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    run_ranks(2, _trains_while_writing, root, str(refs))
    run_ranks(2, _restores_latest, root, str(refs), 6)


# -- interrupts: a wait, a save ---------------------------------------------


class _Interrupt(Exception):
    """What a signal handler raises into the training thread."""


def _interrupted_wait(root: str, refs: str) -> None:
    hold = Fault("write_object", "step0000000002", "hold", times=1)
    job = _job(root, seed=1, policy="consecutive", storage=FaultyStorage(root, hold))
    job.train(2)
    assert job.ckpt.save(2)
    save_reference(job, refs, 2)

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(_Interrupt):  # as it is, not as the checkpoint failing
            job.ckpt.wait()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert job.ckpt._background.busy == "checkpoint of step 2", "the job runs on"
    job.train(2)  # updates rows that step 2 holds
    hold.released.set()
    job.ckpt.wait()  # waits for that same job
    assert Manifest.load(root).steps() == [2]


@pytest.mark.dist
def test_an_interrupted_wait_raises_the_interrupt_and_the_checkpoint_still_commits_exact(
    tmp_path,
) -> None:
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    run_ranks(2, _interrupted_wait, root, str(refs))
    run_ranks(2, _restores_latest, root, str(refs), 2)


def _saves_interrupted_anywhere(
    root: str, refs: str, cuts: int, staging: str, background: str
) -> None:
    job = _job(root, seed=1, policy="consecutive", staging=staging, background=background)
    job.train(2)
    job.ckpt.save(2)
    job.ckpt.wait()
    save_reference(job, refs, 2)
    interrupted, lines = 0, 0
    # Lines spread over the whole save, then each of its last ones (the job's submission),
    # counted from the last save that ran to its end (a delta's, as these are).
    for i in range(cuts + 12):
        for interrupt in (True, False):
            job.train(1)  # rows an interrupted save may have cleared the bits of
            save_reference(job, refs, job.data.position)  # its job may run on and commit
            at = (i * lines // cuts if i < cuts else lines - (i - cuts)) if interrupt else None
            saved, ran = cut_at(at or None, lambda: job.ckpt.save(job.data.position))
            job.ckpt.wait()  # the job, if it started: it commits
            assert saved is None or saved, "a save was skipped"
            interrupted += saved is None
            if not interrupt:
                assert saved is not None
                lines = ran
    assert interrupted >= cuts + 8, f"only {interrupted} of {cuts + 12} saves were interrupted"
    job.ckpt.close()


def _every_saved_step_restores(root: str, refs: str) -> None:
    job = _job(root, seed=90)
    for step in Manifest.load(root).steps():
        assert_restores(job, refs, step)
    job.ckpt.close()


@pytest.mark.dist
@pytest.mark.parametrize(
    "staging, background", [("lazy", "thread"), ("eager", "thread"), ("lazy", "process")]
)
def test_a_save_interrupted_at_any_line_loses_no_row_and_every_checkpoint_restores_exact(
    tmp_path, staging: str, background: str
) -> None:
    """KeyboardInterrupt raised from inside ``save()`` at evenly spread lines of its own
    code (staging, clearing the bits, submitting the job): the save is withdrawn with its
    bits put back, or its job runs on and commits; the next save holds every row changed
    since the last commit, and each committed step restores to its reference."""
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    run_ranks(1, _saves_interrupted_anywhere, root, str(refs), 16, staging, background)
    run_ranks(1, _every_saved_step_restores, root, str(refs))


def _compact_interrupted(job: Job, refs: str, at: int | None) -> int | None:
    """Two saves, then ``job``'s compaction, interrupted at line ``at`` of the library's
    code (its wait for the last save's job first): the lines it ran if not cut short."""
    for _ in range(2):  # a chain of two links at least, to compact
        job.train(1)
        job.ckpt.save(job.data.position)
        save_reference(job, refs, job.data.position)
    compacted, lines = cut_at(at, job.ckpt.compact)
    if compacted is None:
        return None
    assert compacted
    return lines


def _compactions_interrupted_anywhere(root: str, refs: str) -> None:
    job = _job(root, seed=1, policy="consecutive")
    lines = _compact_interrupted(job, refs, None)
    assert lines is not None
    # Each of its first lines (taking the last save's outcome), then some over the rest.
    ats = sorted({*range(1, 17), *(i * lines // 9 for i in range(1, 9))})
    for at in ats:
        assert _compact_interrupted(job, refs, at) is None, f"line {at} of {lines} not reached"
        job.ckpt.wait()  # the compaction, if it started: never a job that cannot end
    job.ckpt.close()


@pytest.mark.dist
def test_a_compaction_interrupted_at_any_line_never_hangs_a_wait_and_every_step_restores(
    tmp_path,
) -> None:
    """KeyboardInterrupt from inside ``compact()`` (at each of its first 16 lines, then at 8
    spread over the rest), which first takes the outcome of the save before it: a job cut
    short stays waited for, none that cannot start is left behind, and every committed
    step restores to its reference (before, an interrupt as the outcome was taken dropped
    the job and its chain: the next delta built on a stale one)."""
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    run_ranks(1, _compactions_interrupted_anywhere, root, str(refs))
    run_ranks(1, _every_saved_step_restores, root, str(refs))


# -- injected I/O error ----------------------------------------------------


def _io_error_then_recover(root: str, refs: str, policy: str) -> None:
    full = Fault("make_durable", "step0000000004") if dist.get_rank() == 1 else None
    job = _job(root, seed=1, policy=policy, storage=FaultyStorage(root, *filter(None, [full])))
    job.train(2)
    job.ckpt.save(2)
    job.ckpt.wait()
    job.train(2)
    job.ckpt.save(4)  # rank 1 fails with ENOSPC in the background
    with pytest.raises(CheckpointError, match="step 4 failed") as info:
        job.ckpt.wait()
    _reported_as_documented(info.value, failed_rank=1, cause="injected: no space left")
    assert Manifest.load(root).steps() == [2], "a failed checkpoint must not commit"
    job.train(2)
    job.ckpt.save(6)
    save_reference(job, refs, 6)
    job.ckpt.wait()


def _causes(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while error is not None:
        chain.append(error)
        error = error.__cause__  # type: ignore[assignment]
    return chain


def _reported_as_documented(error: BaseException, failed_rank: int, cause: str) -> None:
    """docs/user-guide.md, "When a save fails": every rank the same message naming the
    failing rank and its error, ``rank`` and ``remote_traceback`` set; ``__cause__`` leads
    to the failing rank's own exception there and to a ``RemoteTraceback`` elsewhere."""
    assert f"on rank {failed_rank}: " in str(error) and cause in str(error)
    assert len(set(_gather(str(error)))) == 1, "every rank raises the same message"
    assert getattr(error, "rank", None) == failed_rank
    remote = getattr(error, "remote_traceback", None)
    assert remote is not None and "Traceback" in remote and cause in remote
    causes = _causes(error)
    if dist.get_rank() == failed_rank:
        own = [e for e in causes if type(e) is OSError and e.errno == errno.ENOSPC]
        assert own and cause in str(own[0]) and "on rank" not in str(own[0])
    else:
        assert isinstance(causes[-1], RemoteTraceback) and str(causes[-1]) == remote


def _gather(obj: str) -> list[str]:
    out: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("policy", ["consecutive", "intermittent"])
def test_injected_io_error_surfaces_on_every_rank_as_documented_keeps_previous_and_carries_rows(
    policy, tmp_path, monkeypatch
) -> None:
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    run_ranks(2, _io_error_then_recover, root, str(refs), policy)
    assert Manifest.load(root).steps() == [2, 6]
    run_ranks(2, _restores_latest, root, str(refs), 6, policy)


# -- a rank killed mid-write -------------------------------------------------


def _save_then_get_killed(root: str, refs: str) -> None:
    # The whole job dies mid-write (a rank that survived would remove the files at once).
    storage = FaultyStorage(root, Fault("make_durable", "step0000000004", "sigkill"))
    job = _job(
        root,
        seed=1,
        policy="consecutive",
        timeouts=Timeouts(collective_timeout_s=30),
        storage=storage,
    )
    job.train(2)
    job.ckpt.save(2)
    save_reference(job, refs, 2)
    job.ckpt.wait()
    job.train(2)
    job.ckpt.save(4)  # both ranks are SIGKILLed inside the background write
    job.ckpt.wait()


def _restore_then_save_again(root: str, refs: str) -> None:
    job = _job(root, seed=5, policy="consecutive")
    assert job.ckpt.restore() == 2
    reference.assert_model_matches(job.model, job.app_state, reference.load_all(Path(refs), 2))
    job.train(3)
    job.ckpt.save(5)
    save_reference(job, refs, 5)
    job.ckpt.wait()


@pytest.mark.dist
def test_rank_killed_mid_write_leaves_previous_checkpoint_exact(
    every_root: str, refs: Path
) -> None:
    root = every_root
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        run_ranks(2, _save_then_get_killed, root, str(refs))
    assert Manifest.load(root).steps() == [2]
    folders = open_storage(root).children
    assert any("step0000000004" in name for name in folders()), "the killed write left files"
    run_ranks(2, _restore_then_save_again, root, str(refs))
    assert Manifest.load(root).steps() == [2, 5]
    # The restarted job claimed a newer generation, which removes the dead write's files.
    assert not any("step0000000004" in name for name in folders())
    run_ranks(2, _restores_latest, root, str(refs), 5)


# -- replicas that drifted apart -----------------------------------------------


def _drifted_replica(root: str) -> None:
    job = _job(root, seed=1)
    job.train(2)
    if dist.get_rank() == 1:
        with torch.no_grad():
            next(iter(model_state.dense_state(job.model).values())).add_(1.0)
    job.ckpt.save(2)
    with pytest.raises(CheckpointError, match=r"dense tensors \['.*'\] differ between ranks"):
        job.ckpt.wait()
    job.ckpt.close()


@pytest.mark.dist
def test_dense_replicas_that_differ_between_ranks_fail_the_checkpoint(root: str) -> None:
    run_ranks(2, _drifted_replica, root)
    assert Manifest.load(root).steps() == []
