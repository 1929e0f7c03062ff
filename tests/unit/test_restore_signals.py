""":class:`~torchrec_cnr.restore.DeferredSignals`: a signal handler runs at once until the
restore holds it, then once the block ends; the handlers are put back; off the main thread
it changes nothing."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import pytest

from torchrec_cnr.restore import DeferredSignals


def test_a_held_signal_runs_its_handler_once_the_block_ends_and_the_handlers_are_put_back() -> None:
    ran: list[str] = []

    def handler(number: int, frame: FrameType | None) -> None:
        ran.append(signal.Signals(number).name)

    before = signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # not a held signal: untouched
    previous = signal.signal(signal.SIGTERM, handler)
    # Python's own, as in a process started in the foreground (one started in the
    # background by a shell ignores SIGINT).
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with DeferredSignals() as signals:
            assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
            os.kill(os.getpid(), signal.SIGTERM)
            assert ran == ["SIGTERM"], "not held yet: handled at once"
            signals.hold()
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            assert ran == ["SIGTERM"], "held"
        assert ran == ["SIGTERM"] * 3 and signal.getsignal(signal.SIGTERM) is handler
        with pytest.raises(KeyboardInterrupt), DeferredSignals() as signals:
            signals.hold()
            os.kill(os.getpid(), signal.SIGINT)
            ran.append("after")  # the block goes on to its end
        assert ran[-1] == "after"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGUSR1, before)
        signal.signal(signal.SIGINT, interrupt)


def test_off_the_main_thread_it_changes_no_handler() -> None:
    seen: list[object] = []
    handler = signal.getsignal(signal.SIGINT)

    def run() -> None:
        with DeferredSignals() as signals:
            signals.hold()
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [handler]
