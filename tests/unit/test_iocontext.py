"""One IOContext: its threads yield to training (each lowers its own priority when it
starts), and every I/O setting, the four implementation switches included, is an
IOOptions field whose default comes from the environment."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from torchrec_cnr.config import CheckpointConfig, Timeouts
from torchrec_cnr.iocontext import IOContext, IOOptions, lowered_priority

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice: Linux")


def _nice_of_a_thread(pool: ThreadPoolExecutor) -> int:
    return pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()


@linux
def test_pool_threads_run_below_their_creator_and_the_creator_keeps_its_priority() -> None:
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with IOContext(IOOptions(threads=2, encode_threads=2, nice=7)) as pools:
        assert _nice_of_a_thread(pools.io) == min(19, own + 7)
        assert _nice_of_a_thread(pools.encode) == min(19, own + 7)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    with IOContext(IOOptions(threads=1, encode_threads=1, nice=0)) as pools:
        assert _nice_of_a_thread(pools.io) == own


@linux
def test_the_lowered_priority_stops_at_19() -> None:
    lower = lowered_priority(19)
    assert lower is not None
    seen: list[int] = []

    def twice() -> None:
        lower()
        lower()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=twice)
    thread.start()
    thread.join()
    assert seen == [19]


def test_no_initializer_without_a_change() -> None:
    assert lowered_priority(0) is None


@pytest.mark.parametrize("bad", [-1, 20, 2.5, True])
def test_io_options_refuse_a_nice_out_of_range(bad: object) -> None:
    with pytest.raises(ValueError, match="io.nice"):
        IOOptions(nice=bad)  # type: ignore[arg-type]


def test_the_environment_gives_the_default_and_an_argument_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert IOOptions().nice == 10
    monkeypatch.setenv("TORCHREC_CNR_NICE", "3")
    assert IOOptions().nice == 3
    assert IOOptions(nice=0).nice == 0


def test_object_size_is_in_mb_from_the_environment_and_an_argument_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCHREC_CNR_OBJECT_MB")  # conftest's small objects
    assert IOOptions().object_mb == 64 and IOOptions().object_bytes == 64 << 20
    monkeypatch.setenv("TORCHREC_CNR_OBJECT_MB", "0.0625")
    assert IOOptions().object_bytes == 64 << 10
    assert IOOptions(object_mb=1.5).object_bytes == 3 << 19


@pytest.mark.parametrize("bad", [0, 1 / 2048, -1.0, float("inf"), float("nan"), True, "64"])
def test_io_options_refuse_an_object_size_under_a_kib_or_not_a_number(bad: object) -> None:
    with pytest.raises(ValueError, match="io.object_mb"):
        IOOptions(object_mb=bad)  # type: ignore[arg-type]


def test_one_read_bound_for_every_reader_a_readers_own_option_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCHREC_CNR_READ_MEMORY_MB", raising=False)
    unset = IOOptions()
    assert unset.read_memory_mb is None
    assert unset.read_budget(None, None) is None  # no bound anywhere: none
    assert unset.read_budget(None, 256) == 256 << 20  # the reader's default
    monkeypatch.setenv("TORCHREC_CNR_READ_MEMORY_MB", "16")
    bounded = IOOptions()
    assert bounded.read_budget(None, 256) == bounded.read_budget(None, None) == 16 << 20
    assert bounded.read_budget(1.5, None) == 3 << 19  # the reader's own option wins
    assert IOOptions(read_memory_mb=2).read_budget(None, None) == 2 << 20  # an argument wins
    with pytest.raises(ValueError, match="io.read_memory_mb"):
        IOOptions(read_memory_mb=0)
    monkeypatch.setenv("TORCHREC_CNR_READ_MEMORY_MB", "lots")
    with pytest.raises(ValueError, match="TORCHREC_CNR_READ_MEMORY_MB"):
        IOOptions()


def test_the_object_size_in_kib_that_object_mb_replaced_still_counts_deprecated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCHREC_CNR_OBJECT_MB", raising=False)
    monkeypatch.setenv("TORCHREC_CNR_OBJECT_KB", "96")
    with pytest.warns(DeprecationWarning, match="TORCHREC_CNR_OBJECT_KB .*TORCHREC_CNR_OBJECT_MB"):
        assert IOOptions().object_bytes == 96 << 10
    monkeypatch.setenv("TORCHREC_CNR_OBJECT_MB", "2")  # the new one wins
    assert IOOptions().object_bytes == 2 << 20
    with pytest.warns(DeprecationWarning, match=r"IOOptions\(object_kb=\.\.\.\) is deprecated"):
        options = IOOptions(object_kb=128)
    assert options.object_mb == 0.125 and options.object_bytes == 128 << 10
    assert dataclasses.replace(options, threads=2).object_bytes == 128 << 10


SWITCHES = {
    "direct_writes": "TORCHREC_CNR_DIRECT_WRITES",
    "direct_reads": "TORCHREC_CNR_DIRECT_READS",
    "compiled_search": "TORCHREC_CNR_COMPILED_SEARCH",
    "compiled_staging": "TORCHREC_CNR_COMPILED_STAGING",
}


@pytest.mark.parametrize("field", sorted(SWITCHES))
def test_each_switch_is_an_option_whose_default_reads_the_environment(
    field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert getattr(IOOptions(), field) is True
    monkeypatch.setenv(SWITCHES[field], "0")
    assert getattr(IOOptions(), field) is False
    assert getattr(IOOptions(**{field: True}), field) is True  # an argument wins
    monkeypatch.setenv(SWITCHES[field], "maybe")
    with pytest.raises(ValueError, match=f"{SWITCHES[field]}='maybe'"):
        IOOptions()
    with pytest.raises(ValueError, match=f"io.{field} must be a bool"):
        IOOptions(**{field: 1})  # type: ignore[arg-type]


def test_timeouts_are_options_whose_defaults_read_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Timeouts() == Timeouts(collective_timeout_s=600, lease_ttl_s=60)
    monkeypatch.setenv("TORCHREC_CNR_COLLECTIVE_TIMEOUT_S", "30")
    monkeypatch.setenv("TORCHREC_CNR_LEASE_TTL_S", "5")
    assert Timeouts() == Timeouts(collective_timeout_s=30, lease_ttl_s=5)
    assert Timeouts(lease_ttl_s=9).lease_ttl_s == 9  # an argument wins
    assert CheckpointConfig(path="/tmp/x").timeouts.lease_ttl_s == 5
    for bad in (0, -1, float("nan"), "60", True):
        with pytest.raises(ValueError, match="lease_ttl_s must be > 0"):
            Timeouts(lease_ttl_s=bad)  # type: ignore[arg-type]
    assert not hasattr(IOOptions(), "lease_ttl_s")  # performance knobs only


def test_no_library_module_but_the_options_names_a_variable_of_ours() -> None:
    """The I/O options (``iocontext.py``) and the timeouts (``config.py``) read them."""
    package = Path(__file__).resolve().parents[2] / "torchrec_cnr"
    options = {"iocontext.py", "config.py"}
    readers = sorted(
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if str(p.relative_to(package)) not in options
        and re.search(r"[\"']TORCHREC_CNR_", p.read_text())
    )
    assert readers == [], f"TORCHREC_CNR_* variables read outside {sorted(options)}: {readers}"
