"""Whoever starts a thread joins it: the manager on close(), the offline readers, the cnr
command and a follower before they return (and the manager frees its staging buffers)."""

from __future__ import annotations

import threading

import pytest
import torch

import torchrec_cnr
from cnr_train.workload import TableSpec, dlrm
from tests.jobs import make_job
from tests.multiprocess import run_ranks
from torchrec_cnr import QuantizeConfig, cli, offline
from torchrec_cnr.interop import ExportOptions
from torchrec_cnr.tracking import model_state

TABLES = [TableSpec("a", 2000, 16, "table_wise"), TableSpec("b", 1500, 16, "column_wise")]

# Every thread the library starts is named so: writer, I/O, encoding, lease, tracker.
PREFIX = "cnr-"


def _library_threads(but: set[threading.Thread] | None = None) -> list[str]:
    """Live threads of the library, except ``but`` (those of earlier tests' managers in
    these long-lived rank processes)."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith(PREFIX) and t not in (but or set())
    )


def _close_releases_everything(root: str) -> None:
    earlier = set(threading.enumerate())
    quantized = QuantizeConfig(method="adaptive", bits=4, min_rows=0)
    job = make_job(TABLES, root, seed=1, policy="intermittent", quantize=quantized)
    for step in (2, 4):
        job.train(2)
        job.ckpt.save(step)
    job.ckpt.wait()
    running = _library_threads(earlier)
    assert any(n.startswith("cnr-encode") for n in running), running
    assert any(n.startswith("cnr-tracker") for n in running), running
    assert job.ckpt._stager.pool.nbytes > 0, "the staging pool holds buffers between saves"
    job.ckpt.close()
    assert _library_threads(earlier) == [], "close() must stop every thread of the library"
    assert job.ckpt._stager.pool.nbytes == 0, "close() must give the staging buffers back"
    # Training goes on after close: tracking starts its thread again, and stops it again.
    job.train(1)
    for tracker in model_state.trackers(job.model).values():
        tracker.close()
    assert _library_threads(earlier) == []


@pytest.mark.dist
def test_close_stops_every_library_thread_and_frees_staging_memory(root: str) -> None:
    run_ranks(2, _close_releases_everything, root)


def _readers_leave_no_thread(root: str, out: str) -> None:
    """Every path that reads a root outside training joins what it started: the offline
    readers, the ``cnr`` command, a follower closed or used as a context manager."""
    job = make_job(TABLES, root, seed=1)
    with job.ckpt:
        job.train(1)
        job.ckpt.save(1)
    for tracker in model_state.trackers(job.model).values():
        tracker.close()
    earlier = set(threading.enumerate())
    reads = [
        lambda: torchrec_cnr.read_table(root, "a"),
        lambda: torchrec_cnr.read_table(root, "a", rows=[0, 5]),
        lambda: offline.read_optimizer_state(root, "a"),
        lambda: torchrec_cnr.export_state_dict(root),
        lambda: offline.list_checkpoints(root),
        lambda: torchrec_cnr.export_dcp(root, f"{out}/dcp", options=ExportOptions(overwrite=True)),
        lambda: cli.main(["verify", root]),
        lambda: cli.main(["export", root, "--out", f"{out}/model.pt"]),
    ]
    for read in reads:
        before = set(threading.enumerate())
        read()
        assert _library_threads(before) == [], read
    served = torchrec_cnr.FloatTarget(dlrm(TABLES, 4, torch.device("cpu"), torch.device("cpu")))
    with torchrec_cnr.Follower(root, served) as follower:
        follower.start(interval_s=0.01)
        assert follower.poll() is not None
    assert not [n for n in _library_threads(earlier) if "follower" in n or "io" in n]


@pytest.mark.dist
def test_the_offline_readers_the_cli_and_a_follower_join_every_thread_they_start(
    root: str, tmp_path
) -> None:
    run_ranks(1, _readers_leave_no_thread, root, str(tmp_path))
