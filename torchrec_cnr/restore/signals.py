"""A restore is whole or changes nothing, even when a signal arrives while it changes the model.

Python runs a signal's handler in the main thread between two bytecodes. A handler that
raises (``KeyboardInterrupt`` on SIGINT, a preemption handler's exception on SIGTERM) would
cut a restore short between any two of the rows it copies, leaving the model, its optimizer
state and the manager's chain of different steps. :class:`DeferredSignals` keeps such a
signal from the restore once it begins to change anything (:meth:`DeferredSignals.hold`)
until it ends, then runs the handler as it would have run: the restore is whole, and the
exception is raised from ``restore()``. Before that, while the checkpoint is read and
verified (the long part), a signal is handled at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["DeferredSignals"]

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals kept from a restore's changes where a Python handler is installed for them
(a signal left to the system's default ends the process, and with it the model)."""


class DeferredSignals:
    """Within ``with``: the handlers of :data:`SIGNALS` run at once until :meth:`hold`, and
    after it only once the block ends. In any thread but the main one (which signals never
    interrupt) it does nothing."""

    def __init__(self) -> None:
        self.holding = False
        self.caught: list[tuple[int, FrameType | None]] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> DeferredSignals:
        if threading.current_thread() is threading.main_thread():
            for number in SIGNALS:
                handler = signal.getsignal(number)
                if callable(handler):
                    self._previous[number] = handler
                    signal.signal(number, self._handle)
        return self

    def hold(self) -> None:
        """From now on, a signal waits for the block to end (the model begins to change)."""
        self.holding = True

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if not self.holding:
            self._previous[number](number, frame)
            return
        if not self.caught:
            logger.warning(
                "%s arrived while the restore changes the model: handled once it is whole",
                signal.Signals(number).name,
            )
        self.caught.append((number, frame))

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        caught, self.caught = self.caught, []
        for number, frame in caught:  # as each would have run: the first that raises ends it
            self._previous[number](number, frame)
