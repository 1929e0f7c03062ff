"""The manager owns its threads and buffers, and ``close()`` releases every one of them."""

from __future__ import annotations

import threading

import pytest

from cnr_train.workload import TableSpec
from tests.jobs import make_job
from tests.multiprocess import run_ranks
from torchrec_cnr import QuantizeConfig
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
