"""The writer process (``background="process"``) under faults: one killed, between jobs
or mid-commit, fails the checkpoint on every rank at once with the same error and leaves
the previous one the restore target; one that cannot start fails every job with why; it ends with close() and with its
training process, SIGKILL included; bad configurations fail at once. (That its checkpoints restore bit-identically, every policy,
lazy and eager, file system and S3: ``tests/contract/test_resume.py``.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.jobs import make_job
from tests.multiprocess import free_port, run_ranks
from torchrec_cnr import CheckpointConfig, CheckpointError, Timeouts
from torchrec_cnr.manifest import Manifest

WRITER = "torchrec_cnr.writer_process.server"


def _writers(pid: int) -> list[int]:
    """The writer processes that process ``pid`` started."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended since the listing
            continue
    return [c for c in children if WRITER in _cmdline(c)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if WRITER not in _cmdline(pid):  # exited (a zombie's cmdline is empty)
            return True
        time.sleep(0.1)
    return False


def _killed_writer_fails_everywhere(root: str) -> None:
    job = make_job("ebc", root, seed=1, policy="consecutive", background="process")
    job.train(2)
    job.ckpt.save(2)
    job.ckpt.wait()
    writer = job.ckpt.writer_pid
    assert writer is not None and writer in _writers(os.getpid())
    if dist.get_rank() == 1:
        os.kill(writer, signal.SIGKILL)
        assert _gone(writer, 10)
    job.train(2)
    job.ckpt.save(4)
    with pytest.raises(CheckpointError, match="writer process of rank 1") as raised:
        job.ckpt.wait()
    assert "on rank 1" in str(raised.value), "every rank raises rank 1's error"
    latest = Manifest.load(root).latest()
    assert latest is not None and latest.step == 2, "the previous checkpoint stays the target"
    # Nothing more is written, and every rank says why.
    job.ckpt.save(6)
    with pytest.raises(CheckpointError, match="on rank 1: .*writer process of rank 1 .*is gone"):
        job.ckpt.wait()
    job.ckpt._release()
    assert _gone(writer, 30)


@pytest.mark.dist
def test_a_killed_writer_process_fails_the_checkpoint_on_every_rank(root: str) -> None:
    run_ranks(2, _killed_writer_fails_everywhere, root)


def _killed_mid_commit_fails_everywhere(root: str, after: str) -> None:
    """Rank 1's writer process is SIGKILLed once the ranks have run the first, or the
    last, of a commit's collectives: rank 0's writer then waits in a later collective,
    or has finished, and either way every rank must raise rank 1's error at once (not
    at the collective timeout, which the test's own outlasts)."""
    from torchrec_cnr.writer_process import client

    job = make_job("ebc", root, seed=1, policy="consecutive", background="process",
                   timeouts=Timeouts(collective_timeout_s=3600))  # fmt: skip
    relayed: list[tuple[Any, ...]] = []
    run_on = client._run_on

    def counting(group: Any, *args: Any) -> Any:
        relayed.append(args)
        return run_on(group, *args)

    setattr(client, "_run_on", counting)  # noqa: B010 - the relay looks it up per call
    try:
        job.train(2)
        job.ckpt.save(2)
        job.ckpt.wait()
        per_commit, relayed[:] = len(relayed), []
        assert per_commit >= 2, "a commit runs collectives"
        kill_at = 1 if after == "first" else per_commit
        writer = job.ckpt.writer_pid
        assert writer is not None

        def killing(group: Any, *args: Any) -> Any:
            out = counting(group, *args)
            if dist.get_rank() == 1 and len(relayed) == kill_at:
                os.kill(writer, signal.SIGKILL)
            return out

        setattr(client, "_run_on", killing)  # noqa: B010
        job.train(2)
        job.ckpt.save(4)
        with pytest.raises(CheckpointError, match="on rank 1: .*writer process of rank 1"):
            job.ckpt.wait()
        assert len(relayed) == kill_at, "no collective runs once a writer process is gone"
    finally:
        setattr(client, "_run_on", run_on)  # noqa: B010
    latest = Manifest.load(root).latest()
    assert latest is not None and latest.step in (2, 4)
    if after == "first":
        assert latest.step == 2, "the previous checkpoint stays the target"
    job.ckpt.save(6)
    with pytest.raises(CheckpointError, match="writer process of rank 1 .*is gone"):
        job.ckpt.wait()
    job.ckpt._release()


@pytest.mark.dist
@pytest.mark.parametrize("after", ["first", "last"])
def test_a_writer_process_killed_mid_commit_fails_every_rank_at_once(root: str, after: str) -> None:
    run_ranks(2, _killed_mid_commit_fails_everywhere, root, after)


def _close_ends_the_writer(root: str) -> None:
    job = make_job("ebc", root, seed=1, background="process")
    (writer,) = _writers(os.getpid())
    job.train(1)
    job.ckpt.save(1)
    job.ckpt.close()
    assert _gone(writer, 30), "close() must end the writer process"
    assert _writers(os.getpid()) == []


@pytest.mark.dist
def test_close_ends_the_writer_process(root: str) -> None:
    run_ranks(2, _close_ends_the_writer, root)


_JOB = textwrap.dedent(
    """
    import os, sys, time
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    from tests.jobs import make_job
    from torchrec_cnr.launch import init_distributed
    init_distributed("gloo")
    job = make_job("ebc", sys.argv[1], seed=1, background="process")
    job.train(1)
    job.ckpt.save(1)
    job.ckpt.wait()
    job.train(1)
    job.ckpt.save(2)  # writing while it is killed
    print("saved", flush=True)
    time.sleep(600)
    """
)


def test_the_writer_process_ends_with_a_sigkilled_trainer(tmp_path: Path) -> None:
    trainer = subprocess.Popen(
        [sys.executable, "-c", _JOB, str(tmp_path / "root"), str(free_port())],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    try:
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "saved"
        (writer,) = _writers(trainer.pid)
        trainer.kill()
        trainer.wait()
        assert _gone(writer, 30), "a writer process must not outlive its training process"
    finally:
        trainer.kill()


def test_bad_writer_process_configurations_fail_at_once(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="background must be one of"):
        CheckpointConfig(path=str(tmp_path), background="fork")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="staging_memory_mb must be None"):
        CheckpointConfig(path=str(tmp_path), background="process", staging_memory_mb=64)


class UnreadableStorage:
    """A storage that pickles here and cannot be unpickled in the writer process."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_refuse, ())


def _refuse() -> None:
    raise RuntimeError("this storage cannot be opened here")


def test_a_writer_process_that_fails_to_start_fails_the_job_with_why(tmp_path: Path) -> None:
    from torchrec_cnr.collectives import Collective
    from torchrec_cnr.commit import CommitTarget
    from torchrec_cnr.selection import ChainState, Policy
    from torchrec_cnr.writer_process import WriterProcess

    config = CheckpointConfig(path=str(tmp_path), background="process")
    writer = WriterProcess(config, 0, 1, UnreadableStorage())  # type: ignore[arg-type]
    target = CommitTarget(None, Policy("full"), 1, None)  # type: ignore[arg-type]
    try:
        for _ in range(2):  # and every job after it
            with pytest.raises(CheckpointError, match=r"rank 0 .* is gone \(exit code 1\)"):
                writer.compact(target, ChainState(), "compaction", Collective.alone())
    finally:
        writer.close()
