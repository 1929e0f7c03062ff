"""The thread that polls a root at an interval, backing off while polls fail.

A failed poll must not stop a follower: the last good step stays served, and the next
poll tries again. While polls keep failing (a store that is down, say) the wait doubles
each time, up to a cap, so that a follower does not hammer a store that is already in
trouble; the first poll that succeeds brings it back to the interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from torchrec_cnr.errors import CnrError

__all__ = ["MAX_BACKOFF_S", "Poller"]

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
"""The longest wait between failing polls, unless the interval is longer."""


class Poller:
    """Calls ``poll`` on a daemon thread, every ``interval_s`` given to :meth:`start`,
    until :meth:`stop`; it may be started again after.

    Args:
        poll: one poll; whatever it raises is logged, kept in :attr:`last_error` and
            counted in :attr:`failures`.
        name: what the log says failed (the root's URL).
        max_backoff_s: the longest wait while polls fail (the interval, if longer).

    Example::

        poller = Poller(follower.poll, name=url)
        poller.start(interval_s=5.0)
        ...
        poller.stop()   # after the poll in flight
    """

    def __init__(
        self, poll: Callable[[], Any], name: str = "", max_backoff_s: float = MAX_BACKOFF_S
    ) -> None:
        self.poll = poll
        self.interval_s = 5.0
        """Seconds between polls that succeed (set by :meth:`start`)."""
        self.name = name
        self.max_backoff_s = max_backoff_s
        self.failures = 0
        """Polls that failed, on every thread started."""
        self.last_error: Exception | None = None
        """Why the last poll failed, if it did (``None`` once one succeeds)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """Whether the thread was started and not stopped."""
        return self._thread is not None

    def wait_after(self, failed: int) -> float:
        """Seconds to wait after ``failed`` polls in a row failed (0: the last succeeded)."""
        return min(self.interval_s * 2 ** min(failed, 16), max(self.interval_s, self.max_backoff_s))

    def start(self, interval_s: float) -> None:
        """Starts the thread, polling every ``interval_s``.

        Raises:
            CnrError: it is running already.
        """
        if self._thread is not None:
            raise CnrError("the follower is already polling")
        self.interval_s = interval_s
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="cnr-follower", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failed = 0  # in a row: the wait doubles, up to the cap
        while True:
            try:
                self.poll()
                self.last_error, failed = None, 0
            except Exception as e:  # keep serving the last good step
                self.last_error, failed = e, failed + 1
                self.failures += 1
                logger.warning("follower of %s: update failed: %s", self.name, e)
            if self._stop.wait(self.wait_after(failed)):
                return

    def stop(self) -> None:
        """Stops the thread, after the poll in flight."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
