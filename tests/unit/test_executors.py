"""The background threads yield to training: each lowers its own priority when it starts."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from torchrec_cnr.config import IOOptions
from torchrec_cnr.executors import Executors, lowered_priority

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice: Linux")


def _nice_of_a_thread(pool: ThreadPoolExecutor) -> int:
    return pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()


@linux
def test_pool_threads_run_below_their_creator_and_the_creator_keeps_its_priority() -> None:
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with Executors(2, 2, 1 << 20, nice=7) as pools:
        assert _nice_of_a_thread(pools.io) == min(19, own + 7)
        assert _nice_of_a_thread(pools.encode) == min(19, own + 7)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    with Executors(1, 1, 1 << 20, nice=0) as pools:
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
