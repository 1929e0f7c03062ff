"""The writer lease: who may claim a root, with which generation, and what blocks a claim."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.faults import Fault, FaultyStorage
from torchrec_cnr.commit.lease import Lease, LeaseHolder, holder_gone
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.storage import Storage, open_storage

TTL_S = 10.0
"""Long enough that a fresh foreign heartbeat stays fresh for a test; the heartbeat
thread's wait is interrupted by ``release()`` whatever the TTL."""


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    return open_storage(str(tmp_path / "root"))


@pytest.fixture
def leases() -> Iterator[list[Lease]]:
    """Leases a test made: each is released at the end, which stops its heartbeat."""
    made: list[Lease] = []
    yield made
    for lease in made:
        lease.release()
        assert lease._thread is None or not lease._thread.is_alive()


def _lease(leases: list[Lease], storage: Storage, take_over: bool = False) -> Lease:
    lease = Lease(storage, take_over=take_over, fallback=False, ttl_s=TTL_S)
    leases.append(lease)
    return lease


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _holder(
    generation: int = 5,
    host: str = "some-other-host",
    pid: int = 4242,
    run_id: str = "",
    age_s: float = 0.0,
    released: bool = False,
) -> LeaseHolder:
    now = time.time()
    return LeaseHolder(generation, run_id, host, pid, now - 3600, now - age_s, released)


def _write_lease(storage: Storage, holder: LeaseHolder) -> None:
    storage.create()
    storage.write("lease.json", json.dumps(asdict(holder)).encode())


# holder_gone


def test_a_released_holder_is_gone() -> None:
    assert holder_gone(_holder(released=True), TTL_S)


def test_a_holder_silent_past_the_ttl_is_gone() -> None:
    assert holder_gone(_holder(age_s=TTL_S + 1), TTL_S)
    assert not holder_gone(_holder(age_s=TTL_S - 1), TTL_S)


def test_a_holder_whose_process_died_on_this_host_is_gone() -> None:
    assert holder_gone(_holder(host=socket.gethostname(), pid=_dead_pid()), TTL_S)


def test_a_live_holder_is_not_gone() -> None:
    assert not holder_gone(_holder(host=socket.gethostname(), pid=os.getpid()), TTL_S)
    # On another host its pid says nothing: only its heartbeat counts.
    assert not holder_gone(_holder(host="some-other-host", pid=_dead_pid()), TTL_S)


# Claims


def test_first_claim_takes_generation_1_and_records_it_in_the_manifest(
    storage: Storage, leases: list[Lease]
) -> None:
    lease = _lease(leases, storage)
    assert lease.claim() is None
    assert lease.mine is not None and lease.mine.generation == 1
    assert Manifest.load(storage).writer_generation == 1
    holder = lease.holder()
    assert holder is not None
    assert (holder.generation, holder.pid, holder.host) == (1, os.getpid(), socket.gethostname())
    assert not holder.released


def test_a_second_lease_of_this_process_takes_the_root_with_the_next_generation(
    storage: Storage, leases: list[Lease]
) -> None:
    first, second = _lease(leases, storage), _lease(leases, storage)
    assert first.claim() is None
    assert second.claim() is None
    assert second.mine is not None and second.mine.generation == 2
    assert Manifest.load(storage).writer_generation == 2
    assert not first.refresh()  # the old holder learns it lost the root
    first.release()  # and giving it up leaves the new holder's lease alone
    holder = second.holder()
    assert holder is not None and holder.generation == 2 and not holder.released


def test_refresh_renews_the_heartbeat(storage: Storage, leases: list[Lease]) -> None:
    lease = _lease(leases, storage)
    assert lease.claim() is None
    before = lease.holder()
    assert before is not None
    time.sleep(0.01)
    assert lease.refresh()
    after = lease.holder()
    assert after is not None and after.heartbeat_at > before.heartbeat_at


def test_a_live_foreign_holder_blocks_a_claim_with_a_message_naming_it(
    storage: Storage, leases: list[Lease]
) -> None:
    _write_lease(storage, _holder(generation=5, host="some-other-host", pid=4242))
    lease = _lease(leases, storage)
    reason = lease.claim()
    assert reason is not None
    assert "generation 5" in reason and "some-other-host" in reason and "pid 4242" in reason
    assert "take_over=True" in reason
    assert lease.mine is None and lease._thread is None
    holder = lease.holder()
    assert holder is not None and holder.generation == 5  # untouched
    assert Manifest.load(storage).writer_generation == 0


def test_take_over_claims_from_a_live_holder(storage: Storage, leases: list[Lease]) -> None:
    _write_lease(storage, _holder(generation=5))
    lease = _lease(leases, storage, take_over=True)
    assert lease.claim() is None
    assert lease.mine is not None and lease.mine.generation == 6
    assert Manifest.load(storage).writer_generation == 6


@pytest.mark.parametrize(
    "gone",
    [
        pytest.param(_holder(generation=5, age_s=10 * TTL_S), id="stale-heartbeat"),
        pytest.param(_holder(generation=5, released=True), id="released"),
    ],
)
def test_a_stale_or_released_lease_can_be_claimed(
    storage: Storage, leases: list[Lease], gone: LeaseHolder
) -> None:
    _write_lease(storage, gone)
    lease = _lease(leases, storage)
    assert lease.claim() is None
    assert lease.mine is not None and lease.mine.generation == 6


def test_a_lease_of_a_dead_process_on_this_host_can_be_claimed(
    storage: Storage, leases: list[Lease]
) -> None:
    _write_lease(storage, _holder(generation=2, host=socket.gethostname(), pid=_dead_pid()))
    lease = _lease(leases, storage)
    assert lease.claim() is None
    assert lease.mine is not None and lease.mine.generation == 3


def test_a_restart_of_the_same_torchrun_job_takes_its_own_lease(
    storage: Storage, leases: list[Lease], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    _write_lease(storage, _holder(generation=3, run_id="job-42"))
    lease = _lease(leases, storage)
    assert lease.claim() is None
    assert lease.mine is not None and lease.mine.generation == 4
    assert lease.mine.run_id == "job-42"


def test_another_torchrun_job_does_not_take_a_live_lease(
    storage: Storage, leases: list[Lease], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    _write_lease(storage, _holder(generation=3, run_id="job-41"))
    assert _lease(leases, storage).claim() is not None


def test_an_unreadable_lease_blocks_nobody(storage: Storage, leases: list[Lease]) -> None:
    storage.create()
    storage.write("lease.json", b"{not json")
    lease = _lease(leases, storage)
    assert lease.claim() is None
    assert lease.mine is not None and lease.mine.generation == 1


def test_release_marks_the_lease_released_so_the_next_job_claims_at_once(
    storage: Storage, leases: list[Lease]
) -> None:
    lease = _lease(leases, storage)
    assert lease.claim() is None
    lease.release()
    assert lease.mine is None
    holder = lease.holder()
    assert holder is not None and holder.released and holder.generation == 1
    following = _lease(leases, storage)
    assert following.claim() is None
    assert following.mine is not None and following.mine.generation == 2


# A root that cannot be written


def _read_only_root(path: Path) -> Storage:
    """``path`` made read-only; where that does not stop writes (running as root), a
    storage whose writes fail with ENOSPC instead."""
    path.mkdir()
    path.chmod(0o500)
    try:
        (path / ".probe").write_bytes(b"")
    except PermissionError:
        return open_storage(str(path))
    (path / ".probe").unlink()
    return FaultyStorage(str(path), Fault("write"))


def test_claim_on_a_read_only_root_returns_a_reason_instead_of_raising(
    tmp_path: Path, leases: list[Lease]
) -> None:
    root = tmp_path / "root"
    storage = _read_only_root(root)
    try:
        lease = _lease(leases, storage)
        reason = lease.claim()
        assert reason is not None
        assert "cannot be written" in reason and str(root) in reason
        assert lease.mine is None and lease._thread is None
    finally:
        root.chmod(0o700)


@pytest.mark.parametrize("name", ["lease.json", "manifest.json"])
def test_a_failed_write_of_the_lease_or_the_manifest_abandons_the_claim(
    storage: Storage, leases: list[Lease], name: str
) -> None:
    faulty = FaultyStorage(storage, Fault("write", name))
    lease = _lease(leases, faulty)
    reason = lease.claim()
    assert reason is not None and "OSError" in reason and "no space left" in reason
    assert lease.mine is None and lease._thread is None
