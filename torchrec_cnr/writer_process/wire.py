"""What goes between the training process and its writer process, and how.

Messages are tuples pickled with the standard pickler over a Unix socket (never
``multiprocessing``'s, which would try to share tensors in a way of its own). A tensor in
a shared staging buffer travels as a :class:`~torchrec_cnr.staging.shared.View`; any
other (a few ids) as its bytes. An exception travels as itself where it pickles, or as a
``RuntimeError`` naming its type, with its traceback.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch

from torchrec_cnr.collectives import Collective
from torchrec_cnr.errors import RemoteTraceback
from torchrec_cnr.staging import SourceInfo, StagedShard
from torchrec_cnr.staging.shard import RecentBits
from torchrec_cnr.staging.shared import MappedBuffers, SharedBuffers, View

__all__ = ["Closed", "PickledCollective", "SentShard", "Wire", "pack_error", "unpack_error"]

Sent = View | torch.Tensor
T = TypeVar("T")


class Closed(EOFError):
    """The other process is gone."""


class Wire:
    """One end of the socket between the two processes."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, *message: Any) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, ConnectionError) as e:
            raise Closed(str(e)) from e

    def recv(self) -> tuple[Any, ...]:
        try:
            message: tuple[Any, ...] = pickle.loads(self.conn.recv_bytes())
        except (EOFError, ConnectionError) as e:
            raise Closed(str(e)) from e
        return message

    def close(self) -> None:
        self.conn.close()


class PickledCollective(Collective):
    """Collectives whose payloads are pickled here and cross as bytes: ``call(op, *args)``
    runs ``Collective.<op>(*args)`` over the ranks' group (in the training process), which
    never unpickles them."""

    def __init__(self, call: Callable[..., Any], rank: int, world_size: int) -> None:
        self.pg = None
        self.rank, self.world_size = rank, world_size
        self._call = call

    def barrier(self) -> None:
        self._call("barrier")

    def gather(self, obj: T) -> list[T]:
        return [pickle.loads(b) for b in self._call("gather", pickle.dumps(obj))]

    def gather_on_rank0(self, obj: T) -> list[T] | None:
        out = self._call("gather_on_rank0", pickle.dumps(obj))
        return None if out is None else [pickle.loads(b) for b in out]

    def broadcast(self, obj: T | None, src: int = 0) -> T:
        data = pickle.dumps(obj) if self.rank == src else None
        return pickle.loads(self._call("broadcast", data, src))  # type: ignore[no-any-return]

    def any(self, flag: bool) -> bool:
        return bool(self._call("any", flag))

    def max(self, values: list[float]) -> list[float]:
        return list(self._call("max", values))


def _sent(shared: SharedBuffers, t: torch.Tensor) -> Sent:
    view = shared.view(t)
    return view if view is not None else t.cpu()


def _received(mapped: MappedBuffers, t: Sent) -> torch.Tensor:
    return mapped.tensor(t) if isinstance(t, View) else t


@dataclass(frozen=True)
class SentShard:
    """A :class:`StagedShard` on its way to the writer process: its rows stay where they
    were staged."""

    source: SourceInfo | None
    """What the shard is; ``None`` when it was sent with an earlier one of the same ``key``."""
    key: str
    ids: Sent | None
    weight: Sent
    states: dict[str, Sent]
    scalars: dict[str, float]
    first_row: int
    recent: Sent | None
    recent_bits: int | None
    """The shard's rows, where ``recent`` is the bitmap of :class:`RecentBits`."""
    tail: bool

    @classmethod
    def of(cls, s: StagedShard, shared: SharedBuffers, known: set[str]) -> SentShard:
        """``s`` as sent; ``known``: the keys whose source was sent (``s``'s is added)."""
        recent = s.recent.words if isinstance(s.recent, RecentBits) else s.recent
        source = None if s.key in known else SourceInfo(s.shard.spec, s.shard.optimizer)
        known.add(s.key)
        return cls(
            source,
            s.key,
            None if s.ids is None else _sent(shared, s.ids),
            _sent(shared, s.weight),
            {k: _sent(shared, v) for k, v in s.states.items()},
            dict(s.scalars),
            s.first_row,
            None if recent is None else _sent(shared, recent),
            s.recent.num_rows if isinstance(s.recent, RecentBits) else None,
            s.tail,
        )

    def staged(self, mapped: MappedBuffers, sources: dict[str, SourceInfo]) -> StagedShard:
        """The staged shard, its rows in ``mapped``; ``sources``: each key's source so far."""
        if self.source is not None:
            sources[self.key] = self.source
        recent: torch.Tensor | RecentBits | None = None
        if self.recent is not None:
            recent = _received(mapped, self.recent)
            if self.recent_bits is not None:
                recent = RecentBits(recent, self.recent_bits)
        return StagedShard(
            sources[self.key],
            self.key,
            None if self.ids is None else _received(mapped, self.ids),
            _received(mapped, self.weight),
            {k: _received(mapped, v) for k, v in self.states.items()},
            self.scalars,
            self.first_row,
            recent,
            self.tail,
        )


def sent_tensors(tensors: dict[str, torch.Tensor], shared: SharedBuffers) -> dict[str, Sent]:
    return {k: _sent(shared, v) for k, v in tensors.items()}


def received_tensors(tensors: dict[str, Sent], mapped: MappedBuffers) -> dict[str, torch.Tensor]:
    return {k: _received(mapped, v) for k, v in tensors.items()}


def pack_error(error: BaseException) -> Exception:
    """``error`` as it can cross: itself if it pickles and unpickles, else a
    ``RuntimeError`` naming its type and message; its traceback text as ``remote_traceback``."""
    text = getattr(error, "remote_traceback", None) or "".join(
        traceback.format_exception(type(error), error, error.__traceback__)
    )
    packed: Exception = RuntimeError(f"{type(error).__name__}: {error}")
    try:
        crossed = pickle.loads(pickle.dumps(error))
        if isinstance(crossed, Exception):
            packed = crossed
    except Exception:  # it stays a RuntimeError naming it
        pass
    packed.__traceback__ = None
    packed.remote_traceback = text  # type: ignore[attr-defined]
    return packed


def unpack_error(error: BaseException) -> BaseException:
    """A received error, its traceback in the writer process as its cause."""
    text = getattr(error, "remote_traceback", None)
    if text:
        error.__cause__ = RemoteTraceback(text)
    return error
