"""Where a follower applies an update: the lock serving shares with it, and the writes.

Serving code holds the shared side of a :class:`SharedLock` around each forward; an
update writes its rows and dense tensors under the exclusive side, and names its step as
served under the same hold (:class:`Applier`). A lookup therefore sees one committed
step, the one :attr:`Applier.served` names, never the rows of one step under the name of
another.

Copy mode (the default) copies an update's rows into the served tables with lookups held
off. Swap mode writes them into the target's second copy of its tables while the served
copy serves, and under the hold only swaps the two; the copy served until then lacks the
update, so the applier replays it onto that copy before writing the next update into it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

from torchrec_cnr.manifest import Entry
from torchrec_cnr.serving.gate import PendingUpdate
from torchrec_cnr.serving.rows import PreparedRows, memory_bytes
from torchrec_cnr.serving.targets import ServingTarget

__all__ = ["Applier", "SharedLock"]


class SharedLock:
    """Many readers (forwards) or one writer (an update), writers first once waiting."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: not self._writer and not self._waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._cv:
                self._readers -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cv:
            self._waiting += 1
            self._cv.wait_for(lambda: not self._writer and not self._readers)
            self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cv:
                self._writer = False
                self._cv.notify_all()


class Applier:
    """Writes updates into ``target`` and keeps the name of the step it serves.

    Args:
        target: the serving model, wrapped.
        swap: swap mode: the target keeps a second copy of its tables. The first update,
            before which nothing is served, is written in place like a copy-mode one; the
            second copy is then made from it (:meth:`make_spare`), instead of a blank copy
            being made first and filled, swapped in and copied back.
        lock: the lock serving code shares; a new one if ``None``.
    """

    def __init__(
        self, target: ServingTarget, swap: bool = False, lock: SharedLock | None = None
    ) -> None:
        self.target = target
        self.lock = SharedLock() if lock is None else lock
        self.swap = swap
        """Whether updates after the first are written into the second copy and swapped in."""
        self.served: Entry | None = None
        """The checkpoint served; ``None`` before the first update."""
        self.spare_bytes = 0
        """Memory the second copy of the tables takes (swap mode, from the first update on)."""
        self._behind: list[tuple[str, torch.Tensor, PreparedRows]] | None = []
        """Swap mode: what the spare copy lacks of the served step (``None``: unknown,
        copied whole before the next update)."""

    def apply(self, update: PendingUpdate) -> tuple[float, int]:
        """Writes what was read and names its step as served, both under the exclusive side
        of the lock. Returns how long serving was blocked, and the bytes the update's rows
        held."""
        if update.spill is not None:
            prepared, held = update.spill.pieces, update.spill.held_bytes
        else:
            prepared = [
                (key, ids, self.target.prepare(key, rows)) for key, ids, rows in update.rows
            ]
            held = memory_bytes(
                [ids for _, ids, _ in update.rows]
                + [t for _, _, rows in update.rows for t in rows.tensors()]
                + [t for _, _, rows in prepared for t in rows.tensors]
            )
        swap = self.target.swapping
        if swap:
            self._write_spare(prepared)
        with self.lock.exclusive():
            began = time.perf_counter()
            with torch.no_grad():
                if swap:
                    self.target.swap()
                else:
                    for key, ids, rows in prepared:
                        self.target.write_prepared(key, ids, rows)
                for name, tensor in update.dense.items():
                    self.target.write_dense(name, tensor)
            self.served = update.plan.target
            blocked = time.perf_counter() - began
        if swap:  # the spare (the copy served until now) lacks this update
            self._behind = prepared
            if update.plan.cold:
                self._behind = None  # every row: copied whole at the next update
        return blocked, held

    @property
    def spare_due(self) -> bool:
        """Swap mode, a step served (written in place) and no second copy made yet."""
        return self.swap and self.served is not None and not self.target.swapping

    def make_spare(self) -> None:
        """Swap mode, once the first update is served (it was written in place): the second
        copy, made from the served one while lookups go on. The step is served before it
        is made, so a follower's first step is not held up by it."""
        if self.spare_due:
            self.spare_bytes = self.target.enable_swap()

    def _write_spare(self, prepared: list[tuple[str, torch.Tensor, PreparedRows]]) -> None:
        """Brings the spare copy to the served step, then writes the update into it."""
        behind, self._behind = self._behind, None  # unknown until written
        if behind is None:
            self.target.sync_spare()
            behind = []
        with torch.no_grad():
            for key, ids, rows in [*behind, *prepared]:
                self.target.write_prepared(key, ids, rows, spare=True)
