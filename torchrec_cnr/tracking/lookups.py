"""What a TBE kernel's lookups tell others: the rows about to be updated, and whether an
update is still to come."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["KernelLookups"]


class KernelLookups:
    """What one TBE kernel's lookups tell others, synchronously, on the training thread.

    Lazy staging (copy-on-write) subscribes to it: a kernel with a fused optimizer updates
    a row only in the backward of a batch that looked it up, so a listener called before
    each lookup can copy the rows the batch will update while they still hold their
    checkpointed values.

    Attributes:
        lock: held while listeners run; whoever copies this kernel's rows off the
            training thread holds it too, so that a row is never copied twice or while
            a listener copies it, and calls :meth:`yield_to_lookups` before taking it
            again.
        enabled: whether the tracker's hooks are installed (see ``RowTracker.set_enabled``).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.enabled = True
        self._listeners: list[Callable[[torch.Tensor], None]] = []
        self._looked_up = 0
        self._updated = 0
        self._waiting = 0  # lookups blocked on ``lock``
        self._count = threading.Lock()

    def subscribe(self, listener: Callable[[torch.Tensor], None]) -> None:
        """Calls ``listener(rows)`` before every lookup from now on, under :attr:`lock`;
        ``rows`` are int64 positions in the kernel's bitmap (see ``LocalShard.lookup_base``),
        duplicates included."""
        with self.lock:
            self._listeners = [*self._listeners, listener]

    def unsubscribe(self, listener: Callable[[torch.Tensor], None]) -> None:
        with self.lock:
            self._listeners = [f for f in self._listeners if f is not listener]

    @property
    def listened(self) -> bool:
        """Whether someone listens (a checkpoint's rows are being copied lazily)."""
        return bool(self._listeners)

    def update_pending(self) -> bool:
        """Whether the latest lookup that builds a graph has not had its backward yet: a
        pipeline that looks up a batch before the previous batch's update (TorchRec's
        ``TrainPipelineSemiSync``), or a save called between forward and backward. Rows
        that lookup read will change without another lookup."""
        return self._updated < self._looked_up

    def yield_to_lookups(self) -> None:
        """Waits, without :attr:`lock`, until no lookup waits for it.

        ``threading.Lock`` is not fair: a thread that releases it and takes it again at
        once keeps it from a waiting lookup, which then waits for every chunk a background
        copy takes (measured: 60-175 ms per checkpoint, as long as eager staging's
        stall). Called between chunks, this hands the lock to the lookup first, so a
        lookup waits for one chunk at most.
        """
        while self._waiting:
            time.sleep(0.0002)

    def before(self, rows: torch.Tensor) -> None:
        listeners = self._listeners
        if listeners:
            with self._count:
                self._waiting += 1
            try:
                self.lock.acquire()
            finally:
                with self._count:
                    self._waiting -= 1
            try:
                for listener in listeners:
                    listener(rows)
            finally:
                self.lock.release()

    def after(self, output: Any) -> None:
        grad_fn = getattr(output, "grad_fn", None)
        if grad_fn is None:
            return  # no backward will follow (no_grad, eval): nothing changes
        self._looked_up += 1
        n = self._looked_up

        def updated(*_: Any) -> None:
            self._updated = max(self._updated, n)

        grad_fn.register_hook(updated)
