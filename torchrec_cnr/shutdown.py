"""Every thread the library starts is stopped by its owner, and at the latest at exit.

Why at exit: Python ends a daemon thread that is still running when the interpreter
finalizes by calling ``pthread_exit`` the next time it takes the GIL. A thread that is
then inside a torch op, or any C++ frame that cannot be unwound, takes the process down
with ``terminate called without an active exception``, after its work is done: a job
manager counts that exit as a failure. So no library thread is left to finalization:
each owner (a row tracker's worker, a lease heartbeat, a follower's poller) registers
here while its thread runs and unregisters when its ``close()`` stops it; whatever a
user forgot to close is stopped by :func:`stop_all`, which ``atexit`` runs before
Python finalizes (and before torch's own exit handlers, registered earlier, run).
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Protocol

__all__ = ["Stoppable", "register", "stop_all", "unregister"]

logger = logging.getLogger(__name__)


class Stoppable(Protocol):
    def stop_thread(self) -> None:
        """Stops the owner's thread and waits for it; safe to call more than once."""


_live: dict[int, Stoppable] = {}
_lock = threading.Lock()


def register(owner: Stoppable) -> None:
    """``owner`` runs a thread until its ``stop_thread()``."""
    with _lock:
        _live[id(owner)] = owner


def unregister(owner: Stoppable) -> None:
    """``owner``'s thread has stopped."""
    with _lock:
        _live.pop(id(owner), None)


def stop_all() -> None:
    """Stops every registered thread (at exit; a test may call it too)."""
    with _lock:
        owners = list(_live.values())
        _live.clear()
    for owner in owners:
        try:
            owner.stop_thread()
        except Exception as e:  # exiting anyway: say what could not stop cleanly
            logger.warning("torchrec_cnr: stopping %r at exit failed: %s", owner, e)


atexit.register(stop_all)
