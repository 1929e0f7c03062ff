"""Collectives over one process group, and the one way ranks agree on a failure.

Checkpointing is collective: when one rank fails (a full disk, a NaN row, a damaged
file), every rank must learn of it at the same point, raise, and leave together. A rank
that raised alone would leave the others waiting in the next collective until its
timeout. :meth:`Collective.agree` is that point: every rank says whether it failed, and
if any did, every rank raises the same error, built from the lowest failing rank's: its
type, a message that names that rank and repeats its message, ``rank`` and
``remote_traceback`` set (see :mod:`torchrec_cnr.errors`). The failing rank's ``__cause__``
is its own exception; elsewhere it is a :class:`~torchrec_cnr.errors.RemoteTraceback`.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torchrec_cnr.errors import RemoteTraceback

__all__ = ["Collective", "Failure"]

T = TypeVar("T")


@dataclass(frozen=True)
class Failure:
    """What a failing rank tells the others: enough to raise the same error there."""

    kind: type[BaseException]
    message: str
    traceback: str

    @classmethod
    def of(cls, error: BaseException) -> Failure:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return cls(type(error), str(error), text)

    def rebuild(self, rank: int, others: str = "") -> Exception:
        """The same exception type, its message prefixed with the failing ``rank`` (and
        ``others``, the other failing ranks' messages, appended), with ``rank`` and
        ``remote_traceback`` set; ``RuntimeError`` where the type cannot be built from a
        message."""
        message = f"on rank {rank}: {self.message}{others}"
        error: Exception | None = None
        try:
            if issubclass(self.kind, Exception):
                error = self.kind(message)
        except Exception:  # an exception type whose constructor wants more than a message
            pass
        if error is None:
            error = RuntimeError(f"{self.kind.__name__}: {message}")
        error.rank = rank  # type: ignore[attr-defined]
        error.remote_traceback = self.traceback  # type: ignore[attr-defined]
        error.__cause__ = RemoteTraceback(self.traceback)
        return error


def _raise_agreed(failures: list[tuple[int, Failure]], own: BaseException | None) -> None:
    """Raises the error every rank raises for ``failures`` (in rank order): the lowest
    failing rank's, naming the others, caused by ``own`` (that rank's own exception, on
    that rank)."""
    (rank, first), rest = failures[0], failures[1:]
    others = "".join(f"; also on rank {r}: {f.kind.__name__}: {f.message}" for r, f in rest)
    error = first.rebuild(rank, others)
    if own is not None:
        raise error from own
    raise error


class Collective:
    """The collectives torchrec_cnr uses, bound to one process group.

    Args:
        pg: the process group; the default group if ``None``.
    """

    def __init__(self, pg: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torchrec_cnr needs an initialized torch.distributed process group")
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)

    @staticmethod
    def alone() -> Collective:
        """The collectives of one process without ``torch.distributed`` (``cnr compact``):
        each returns what this process passes."""
        return _Alone()

    def barrier(self) -> None:
        if self.world_size > 1:  # alone (every collective below): nothing to wait for or send
            dist.barrier(group=self.pg)

    def gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def gather_on_rank0(self, obj: T) -> list[T] | None:
        """Every rank's ``obj``, in rank order, on rank 0 only (``None`` elsewhere): what
        only rank 0 needs is not sent to, or held by, every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, group=self.pg, group_dst=0)
        return out

    def broadcast(self, obj: T | None, src: int = 0) -> T:
        """Rank ``src``'s ``obj`` on every rank."""
        if self.world_size == 1:
            return obj  # type: ignore[return-value]
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=src, group=self.pg)
        return box[0]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return bool(t.item())

    def max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over ranks."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return [float(v) for v in t.tolist()]

    def agree(self, error: BaseException | None) -> None:
        """Raises on every rank if any rank passes an error; returns on every rank otherwise.

        Every rank raises the same error (:meth:`Failure.rebuild`): the lowest failing
        rank's type, ``"on rank N: <its message>"`` (with the other failing ranks'
        messages after it), ``rank`` and ``remote_traceback`` set. On rank N its
        ``__cause__`` is the rank's own exception, elsewhere a ``RemoteTraceback``.
        """
        report = None if error is None else Failure.of(error)
        failures = [(r, f) for r, f in enumerate(self.gather(report)) if f is not None]
        if failures:
            _raise_agreed(failures, error if failures[0][0] == self.rank else None)

    def agree_on(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on every rank; returns its result, or raises on every rank (see
        :meth:`agree`) if it failed on any."""
        result: Any = None
        error: Exception | None = None
        try:
            result = fn()
        except Exception as e:
            error = e
        self.agree(error)
        return result  # type: ignore[no-any-return]

    def on_rank0(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on rank 0 only; every rank gets its result, or raises its error.

        No rank waits for a collective that rank 0 will never join: rank 0 broadcasts
        whatever happened, and every rank raises the same error, as :meth:`agree` does.
        """
        result: Any = None
        error: Exception | None = None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as e:
                error = e
        report = (True, result) if error is None else (False, Failure.of(error))
        ok, value = self.broadcast(report)
        if ok:
            return value  # type: ignore[no-any-return]
        _raise_agreed([(0, value)], error)
        raise AssertionError("unreachable")


class _Alone(Collective):
    """:meth:`Collective.alone`: a group of one, no process group (every collective of a
    group of one returns at once)."""

    def __init__(self) -> None:
        self.pg = None
        self.rank, self.world_size = 0, 1
