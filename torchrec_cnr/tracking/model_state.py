"""What a checkpoint reads from and writes into a DistributedModelParallel model."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.shard import LocalShard
from torchrec_cnr.tracking.tracker import TRACKER_ATTR, DeltaFeed, RowTracker

_WRAPPERS = ("_dmp_wrapped_module", "module")


def _public_path(name: str) -> str:
    parts = [p for p in name.split(".") if p and p not in _WRAPPERS]
    return ".".join(parts)


def trackers(model: nn.Module) -> dict[str, RowTracker]:
    """Module path -> tracker, for every tracked sharded module in ``model``.

    A model sharded with TorchRec's own sharders whose ``DistributedModelParallel`` has a
    delta tracker (``init_torchrec_delta_tracker``) gets trackers fed by it
    (:class:`~torchrec_cnr.tracking.tracker.DeltaFeed`) on the first call.

    Raises:
        ValueError: if the model has no tracked module, i.e. it was sharded neither with
            :func:`torchrec_cnr.tracking_sharders` nor with TorchRec's delta tracker on; or
            if its delta tracker cannot feed a checkpoint.
    """
    found = _attached(model) or _fed_by_delta_tracker(model)
    if not found:
        raise ValueError(
            "model has no tracked embedding modules: pass torchrec_cnr.tracking_sharders() "
            "to the planner and to DistributedModelParallel, or turn TorchRec's delta "
            "tracker on (model.init_torchrec_delta_tracker(DeltaTrackerConfig("
            f"consumers=[{DeltaFeed.CONSUMER!r}])))"
        )
    return found


def _attached(model: nn.Module) -> dict[str, RowTracker]:
    found = {}
    for name, module in model.named_modules():
        tracker = getattr(module, TRACKER_ATTR, None)
        if tracker is not None:
            found[_public_path(name)] = tracker
    return found


def _fed_by_delta_tracker(model: nn.Module) -> dict[str, RowTracker]:
    """Attaches a tracker fed by the model's TorchRec delta tracker to each sharded
    embedding module, if the model has a delta tracker."""
    get = getattr(model, "get_delta_tracker", None)
    delta = get() if callable(get) else None
    if delta is None:
        return {}
    feed = DeltaFeed(delta)
    for name, module in model.named_modules():
        if isinstance(module, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)):
            types = {t: p.sharding_type for t, p in module.module_sharding_plan.items()}
            tracker = RowTracker(module, types, module._env.rank, feed=feed,
                                 feed_prefix=_public_path(name))  # fmt: skip
            setattr(module, TRACKER_ATTR, tracker)
    return _attached(model)


def local_shards(model: nn.Module) -> list[LocalShard]:
    """Every embedding shard this rank holds, with live views into its kernels."""
    shards = []
    for prefix, tracker in trackers(model).items():
        shards.extend(tracker.shards(prefix))
    return shards


def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Replicated tensors of the model: dense parameters, buffers, data-parallel tables.

    The tensors share storage with the model, so ``copy_`` into them restores it.
    """
    return {
        key: value
        for key, value in model.state_dict().items()
        if isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor)
    }


def write_rows(model: nn.Module, table: str, rows: torch.Tensor, values: torch.Tensor) -> int:
    """Writes whole rows of a sharded table outside training, the way training's updates
    reach a checkpoint: a save in progress keeps the rows as they were at its step (its
    copy-on-write hooks see the write first), and the next checkpoint holds the new values.

    Call it on every rank, on the training thread, between steps; each rank writes the
    rows its shards hold (column shards their columns).

    Args:
        model: the sharded model (sharded with :func:`torchrec_cnr.tracking_sharders`).
        table: the table's name (``t0``) or its fully qualified name.
        rows: ``(n,)`` global row indices.
        values: ``(n, embedding_dim)`` new rows.

    Returns:
        The rows this rank wrote (column shards counted once each).

    Raises:
        ValueError: no rank holds a row-tracked shard of that table, or ``values`` of the
            wrong shape.
    """

    def named(qualified: str) -> bool:
        return table in (qualified, qualified.rsplit(".", 1)[-1])

    found = trackers(model)
    names = {n for prefix, t in found.items() for n in t.sharded_tables(prefix)}
    if not any(named(n) for n in names):
        raise ValueError(
            f"no tracked shard of table {table!r}: the row-tracked tables are {sorted(names)}"
        )
    shards = [s for prefix, t in found.items() for s in t.shards(prefix) if named(s.spec.table)]
    if shards and values.shape != (rows.numel(), shards[0].spec.embedding_dim):
        raise ValueError(
            f"values of shape {tuple(values.shape)} for {rows.numel()} rows of {table!r} "
            f"(dim {shards[0].spec.embedding_dim})"
        )
    rows = rows.to(torch.int64)
    written = 0
    for s in shards:
        mine = (rows >= s.spec.row_offset) & (rows < s.spec.row_offset + s.spec.rows)
        local = (rows[mine] - s.spec.row_offset).to(s.weight.device)
        if local.numel() == 0:
            continue
        if s.lookups is not None:  # a lazy save copies these rows before they change
            s.lookups.before(local + s.lookup_base)
        part = values[mine][:, s.spec.col_offset : s.spec.col_offset + s.spec.cols]
        with torch.no_grad():
            s.weight[local] = part.to(s.weight.device, s.weight.dtype)
        s.drain()
        if s.words is not None and s.recent is not None:
            bitmap.set_bits_in_both(s.words, s.recent, local)
        elif s.words is not None:
            bitmap.set_bits(s.words, local)
        written += local.numel()
    return written
