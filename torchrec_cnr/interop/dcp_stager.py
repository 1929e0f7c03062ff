"""A DCP stager for TorchRec models: ``dcp.async_save`` of a ``DistributedModelParallel``
model returns in milliseconds, and the checkpoint holds the state at the call.

DCP's ``async_save`` first *stages* the state dict (a copy that training may not change),
then writes the copy from a thread or a process. Its ``DefaultStager`` fails on the
``ShardedTensor`` s of a TorchRec model, and the blocking alternatives copy every row
before they return. :class:`DcpStager` stages the way the manager's ``save()`` does
(copy-on-write, :mod:`torchrec_cnr.staging.lazy`):

- at the call, it copies what is small (dense parameters and buffers, a dense optimizer's
  state, data-parallel tables, anything it does not recognise) and starts copy-on-write of
  every embedding shard the library's sharders track: their rows and fused optimizer state
  are copied afterwards into host buffers, by a thread of its own, and by the tracker's
  lookup hook first for any row a batch is about to update;
- it returns a future of the staged state dict: the same structure, each
  ``ShardedTensor`` (``DTensor``, TorchRec's ``LocalShardsWrapper``) rebuilt over the host
  buffers with the same global metadata, so that what DCP writes is plain DCP, which stock
  ``dcp.load`` reads at any world size;
- the future resolves once every rank's copy is complete (agreed over a gloo group of its
  own): staging that failed on any rank fails ``async_save`` on every rank, with that
  rank's error, rather than leaving the others waiting in DCP's collectives.

Shards that copy-on-write cannot hold (a kernel with no fused optimizer, a UVM cache, a
batch looked up and not yet updated: :func:`~torchrec_cnr.staging.lazy.lazy_fallback`) are
copied at the call instead, with the reason logged once; so is every table of a model
sharded with TorchRec's stock sharders (it has no tracker). The bytes written are the same.

Each staged state dict owns its buffers while DCP writes it; the next ``stage`` reuses them
once DCP has let go of every one, and takes new ones otherwise.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager

from torchrec_cnr.collectives import Collective
from torchrec_cnr.errors import CheckpointError, wrapping
from torchrec_cnr.iocontext import IOOptions
from torchrec_cnr.schema import shard_key
from torchrec_cnr.selection.policy import Decision
from torchrec_cnr.staging import LazyStaging, StagingPool, lazy_fallback
from torchrec_cnr.staging.plan import ShardPlan
from torchrec_cnr.tracking import model_state
from torchrec_cnr.tracking.shard import LocalShard

__all__ = ["DcpStager"]

logger = logging.getLogger(__name__)

_FULL = Decision("full", clear_bits=False)
"""Every row, and no bit touched: a DCP save is no checkpoint of the manager's chain."""


class DcpStager(AsyncStager):
    """Stages a TorchRec model's state dict for ``dcp.async_save``, copy-on-write.

    Build it once, on every rank (collective: it makes a gloo group), and pass it to every
    ``async_save``; ``close()`` it at the end.

    Args:
        model: the ``DistributedModelParallel`` model whose state the state dicts hold
            (sharded with :func:`~torchrec_cnr.tracking_sharders` for copy-on-write;
            with TorchRec's own sharders every row is copied at the call).
        pg: the process group of the model's ranks; the default group if ``None``.
        io: ``compiled_staging`` (the copier that claims rows without a lock).
        timeout_s: how long a rank waits for the others to finish staging.

    Example::

        stager = DcpStager(model)
        state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
        response = dcp.async_save(state, checkpoint_id=path, async_stager=stager,
                                  process_group=dcp_group)  # a gloo group
        train_step(model, batch)          # at once: the checkpoint holds the rows as they were
        response.upload_completion.result()
        stager.close()
    """

    _synchronize_after_execute = False  # stage() returns a future: DCP waits on it

    def __init__(
        self,
        model: nn.Module,
        pg: dist.ProcessGroup | None = None,
        io: IOOptions | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self._shards = model_state.local_shards(model)
        ranks = dist.get_process_group_ranks(pg) if pg is not None else None
        self._group = Collective(
            dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
        )
        self._io = io if io is not None else IOOptions()
        self._pool = self._new_pool()
        self._views: list[weakref.ref[torch.Tensor]] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cnr-dcp-stager")
        self._pending: weakref.ref[Future[Any]] | None = None
        """The last staging's future, weakly: its result holds the buffers, which must go
        with DCP's last reference to them (see :meth:`_begin`)."""
        self._said: set[str] = set()
        self.stall_s = 0.0
        """Seconds the last :meth:`stage` took (the part training waits for)."""
        self.copied_bytes = 0
        """Bytes the last :meth:`stage` copied at the call."""
        self.copy_on_write_bytes = 0
        """Bytes it left to copy-on-write."""

    def _new_pool(self) -> StagingPool:
        cuda = any(s.weight.device.type == "cuda" for s in self._shards)
        # A budget only to take exact sizes: one stage's buffers are all it holds.
        return StagingPool(sys.maxsize, pin=cuda, compiled=self._io.compiled_staging)

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]]:  # type: ignore[override]
        """Starts staging ``state_dict`` (whose values DCP has already turned from
        ``Stateful`` objects into state dicts); returns the future of its staged copy.

        Raises nothing itself: a failure on any rank fails the future on every rank. An
        interrupt (``KeyboardInterrupt``, a signal handler's exception) passes through,
        leaving no copy-on-write hook behind.
        """
        began = time.perf_counter()
        self._wait()  # one staging at a time (they take milliseconds)
        lazy: LazyStaging | None = None
        try:
            lazy, copies = self._begin()
            staged, self.copied_bytes = _restage(state_dict, copies)
            self.copy_on_write_bytes = 0 if lazy is None else lazy.nbytes
            self._views = [weakref.ref(t) for t in copies.values()]
            future = self._executor.submit(self._finish, lazy, staged, None)
        except BaseException as e:  # an interrupt too: no hook left copying rows
            if lazy is not None:
                lazy.detach()
            if not isinstance(e, Exception):
                raise
            # Reported once every rank agrees, on every rank.
            future = self._executor.submit(self._finish, None, None, e)
        self._pending = weakref.ref(future)
        self.stall_s = time.perf_counter() - began
        return future

    def _begin(self) -> tuple[LazyStaging | None, dict[tuple[int, tuple[int, ...]], torch.Tensor]]:
        """Starts copy-on-write of the shards that allow it and copies the others; returns
        the copy-on-write and each live view's buffer, by the view's address and shape."""
        if any(ref() is not None for ref in self._views):
            self._pool = self._new_pool()  # DCP still writes the last ones
        pool = self._pool
        pool.begin()
        for shard in self._shards:
            shard.drain()
        lazy_plans: list[ShardPlan] = []
        copies: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        for i, shard in enumerate(self._shards):
            why = lazy_fallback(shard)
            if why is None:
                lazy_plans.append(ShardPlan(shard, shard_key(i), "lazy"))
                continue
            self._say(f"{shard.spec.table}: copied at the call, not copy-on-write: {why}")
            for live in _live(shard):
                copies[_address(live)] = live.detach().to("cpu", copy=True)
        lazy = LazyStaging.begin(lazy_plans, _FULL, pool) if lazy_plans else None
        if lazy is not None:
            try:
                for plan in lazy_plans:
                    for live, buffer in zip(_live(plan.shard), lazy.buffers(plan.shard)):
                        copies[_address(live)] = buffer
            except BaseException:
                lazy.detach()
                raise
        return lazy, copies

    def _finish(
        self, lazy: LazyStaging | None, staged: dict[str, Any] | None, error: Exception | None
    ) -> dict[str, Any]:
        """On the stager's thread: completes the copy, then agrees with every rank."""
        if lazy is not None and error is None:
            try:
                lazy.run(_Done())
            except Exception as e:
                error = e
        try:
            self._group.agree(error)
        except Exception as e:
            raise wrapping(CheckpointError(f"DCP staging failed: {e}"), e) from e
        assert staged is not None
        return staged

    def synchronize_staging(self) -> None:
        """Waits for the staging in flight, if any (``async_save`` waits on its future)."""
        pending = self._pending() if self._pending is not None else None
        if pending is not None:
            pending.result()

    def _wait(self) -> None:
        """Waits for the staging in flight, if any, whatever its outcome (DCP reports it)."""
        pending = self._pending() if self._pending is not None else None
        if pending is not None:
            pending.exception()

    def close(self) -> None:
        """Waits for the staging in flight, then stops the stager's thread and group."""
        self._wait()
        self._executor.shutdown(wait=True)
        if dist.is_initialized():
            dist.destroy_process_group(self._group.pg)

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            logger.info("DcpStager: %s", message)


class _Done:
    """Where lazy staging hands each finished shard: nowhere, the buffers are the result."""

    def add(self, shard: Any, row0: int = 0, total: int | None = None) -> None:
        pass

    def start(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def abandon(self) -> None:
        pass


def _live(shard: LocalShard) -> list[torch.Tensor]:
    """The live views of a shard that a state dict shows: its rows, then its states."""
    return [shard.weight, *shard.states.values()]


def _address(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return t.data_ptr(), tuple(t.shape)


def _restage(obj: Any, copies: dict[tuple[int, tuple[int, ...]], torch.Tensor]) -> tuple[Any, int]:
    """``obj`` with every tensor replaced by its staged copy: a tracked view by its buffer
    (filled copy-on-write), any other tensor by a copy in host memory, now; and the bytes
    copied now."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed.tensor import DTensor

    copied = [0]

    def tensor(t: torch.Tensor) -> torch.Tensor:
        found = copies.get(_address(t))
        if found is not None:
            return found
        copied[0] += t.numel() * t.element_size()
        return t.detach().to("cpu", copy=True)

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return type(value)((k, walk(v)) for k, v in value.items())
        if isinstance(value, list | tuple):
            return type(value)(walk(v) for v in value)
        if isinstance(value, ShardedTensor):
            shards = [Shard(tensor(s.tensor), _on_host(s.metadata)) for s in value.local_shards()]
            meta = value.metadata()
            meta = replace(meta, shards_metadata=[_on_host(m) for m in meta.shards_metadata])
            if shards:  # the staged buffers are pinned where the tables are on a GPU
                props = replace(meta.tensor_properties, pin_memory=shards[0].tensor.is_pinned())
                meta = replace(meta, tensor_properties=props)
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, meta, process_group=value._process_group
            )
        if isinstance(value, DTensor):
            local = walk(value.to_local())
            return DTensor.from_local(local, value.device_mesh, value.placements,
                                      run_check=False, shape=value.shape,
                                      stride=value.stride())  # fmt: skip
        wrapper: Any = _shards_wrapper()
        if wrapper is not None and isinstance(value, wrapper):
            held: Any = value
            return wrapper([tensor(t) for t in held.local_shards()],
                           [tuple(o) for o in held.local_offsets()])  # fmt: skip
        if isinstance(value, torch.Tensor):
            return tensor(value)
        return value

    return walk(obj), copied[0]


def _on_host(meta: Any) -> Any:
    """A shard's metadata placed on the host (its buffer's device), same rank."""
    placement = meta.placement
    if placement is None or placement.device().type == "cpu":
        return meta
    return replace(meta, placement=type(placement)(f"rank:{placement.rank()}/cpu"))


def _shards_wrapper() -> type | None:
    try:
        from torchrec.distributed.shards_wrapper import LocalShardsWrapper
    except ImportError:  # pragma: no cover - an older TorchRec
        return None
    return LocalShardsWrapper
