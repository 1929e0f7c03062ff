"""The collective restore of one committed checkpoint into a live model.

All or nothing, on every rank, in four steps, each agreed by every rank before the next:

1. the model must fit the checkpoint (tables, shapes, dense tensors);
2. every rank reads, verifies and plans all it needs (:func:`read_chain`);
3. every rank loads its ``app_state`` objects, which may refuse their state; if any
   refuses on any rank, every rank puts back the state its objects had;
4. the shards, optimizer states, step counters and dense tensors are written.

Nothing changes before step 3, and step 4 only copies data that was read, verified and
checked against where it goes.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchrec_cnr.collectives import Collective
from torchrec_cnr.errors import CheckpointError
from torchrec_cnr.manifest import Entry, TableShape
from torchrec_cnr.read.chain import ChainReader
from torchrec_cnr.restore.apply import (
    PreparedRestore,
    ReadOptions,
    apply_chain,
    own_part_suffices,
    read_chain,
)
from torchrec_cnr.restore.compat import check_compatible
from torchrec_cnr.restore.partial import RestoreScope, select_shards
from torchrec_cnr.restore.signals import DeferredSignals
from torchrec_cnr.snapshot.objects import serialize_app_state
from torchrec_cnr.tracking.shard import LocalShard

__all__ = ["LocalModel", "load_app_state", "restore_entry"]


@dataclass(frozen=True)
class LocalModel:
    """This rank's part of the live model: what a restore writes into."""

    shards: list[LocalShard]
    """This rank's embedding shards."""
    dense: Mapping[str, torch.Tensor]
    """This rank's dense tensors, by name."""
    app_state: Mapping[str, Any]
    """Objects with ``state_dict`` and ``load_state_dict`` (optimizers, dataloaders...)."""


def _init_empty_optimizer(obj: Any) -> None:
    """TorchRec's convention: a ``KeyedOptimizer`` (``CombinedOptimizer`` included) whose
    state is still empty is initialized before it loads a state dict, which it otherwise
    refuses (``Different parameter count``)."""
    try:
        from torchrec.optim.keyed import KeyedOptimizer
    except ImportError:  # pragma: no cover - torchrec is a dependency of every caller
        return
    if isinstance(obj, KeyedOptimizer) and not obj.state:
        obj.init_state()


def load_app_state(
    group: Collective,
    app_state: Mapping[str, Any],
    saved: dict[str, Any] | None,
    dense: Mapping[str, torch.Tensor],
) -> None:
    """Loads ``saved`` into the ``app_state`` objects, on every rank or on none.

    Objects missing from ``saved`` are left as they are, with a warning. If any object
    refuses its state on any rank, every rank loads back what its objects held before,
    and the dense tensors (which an optimizer's ``init_state`` may touch) too.

    Raises:
        CheckpointError: an object refused its state; the message names the rank and
            the ``app_state`` key.
    """
    error: Exception | None = None
    before: bytes | None = None
    dense_before: dict[str, torch.Tensor] = {}
    loaded: list[str] = []
    refused: str | None = None
    if saved is not None and app_state:
        before = serialize_app_state(app_state)
        dense_before = {k: v.detach().clone() for k, v in dense.items()}
        for name, obj in app_state.items():
            if name not in saved:
                warnings.warn(
                    f"app_state {name!r} is not in the checkpoint; left as is", stacklevel=3
                )
                continue
            try:
                _init_empty_optimizer(obj)
                obj.load_state_dict(saved[name])
                loaded.append(name)
            except Exception as e:
                refused = name
                error = CheckpointError(
                    f"app_state {name!r} on rank {group.rank} refused its saved state: "
                    f"{type(e).__name__}: {e}; nothing was restored"
                )
                error.__cause__ = e
                break
    if group.any(error is not None) and before is not None:
        # These bytes are this process's own, serialized from its live objects above,
        # never read from a root: they may hold any type those objects hold.
        previous = torch.load(io.BytesIO(before), weights_only=False)
        with torch.no_grad():
            for name in loaded:
                app_state[name].load_state_dict(previous[name])
            if refused is not None:
                try:  # it may have taken part of the new state before it refused
                    app_state[refused].load_state_dict(previous[refused])
                except Exception:  # it refuses its old state too: it kept it, then
                    pass
            for key, value in dense_before.items():
                dense[key].copy_(value)
    group.agree(error)


def restore_entry(
    group: Collective,
    chain: ChainReader,
    model: LocalModel,
    scope: RestoreScope,
    options: ReadOptions,
    signals: DeferredSignals | None = None,
) -> list[torch.Tensor]:
    """Restores ``chain`` into this rank's ``model``.

    A partial ``scope`` is a partial recovery: only its shards reload, and dense tensors,
    ``app_state`` and the kernels' step counters keep their live values. ``options``: the
    memory budget, the staging buffers to read the baseline into and the types
    ``app_state`` may hold (see :func:`read_chain`). ``signals``: held from the first
    change on (see :mod:`torchrec_cnr.restore.signals`).

    Returns:
        For each local shard, a ``(rows,)`` bool mask of rows that came from a delta.

    Raises:
        ModelMismatchError: the checkpoint belongs to another model; nothing changed.
        CheckpointReadError, ChecksumError: a file is missing or damaged; nothing changed.
        CheckpointError: an ``app_state`` object refused its state, or the data does not
            fit the model; nothing changed.
        UnsafeObjectError: a saved ``app_state`` names a type not in ``safe_globals``;
            nothing ran and nothing changed.
    """
    entry: Entry = chain.entry
    shards, dense, app_state = model.shards, model.dense, model.app_state
    seen: dict[str, TableShape] = {}
    for part in group.gather(Entry.signature([s.spec for s in shards], {})[0]):
        seen.update(part)
    check_compatible(entry, seen, Entry.signature([], dense)[1], chain.storage.url)
    partial = scope.partial
    chosen = select_shards(shards, group.rank, group.world_size, scope, seen)
    error: BaseException | None = None
    prepared: PreparedRestore | None = None
    try:
        if own_part_suffices(chain, chosen, group.rank):
            chain = chain.narrowed(chain.links, only_rank=group.rank)  # its records alone
        prepared = read_chain(
            chain, chosen,
            [] if partial else list(dense),
            None if partial or not app_state else group.rank,
            options, group.world_size,
        )  # fmt: skip
    except ValueError as e:  # read fine, but does not fit: say what it means
        error = CheckpointError(f"restore of step {entry.step} failed before any change: {e}")
    except Exception as e:
        error = e
    group.agree(error)
    assert prepared is not None
    if signals is not None:
        signals.hold()  # every rank read and verified all of it: from here on, it changes
    load_app_state(group, {} if partial else app_state, prepared.app_state, dense)
    touched: list[torch.Tensor] = []
    error = None
    try:
        touched = apply_chain(prepared, chosen, {} if partial else dense, scalars=not partial)
    except Exception as e:  # verified and checked data that fails to apply: a bug
        error = CheckpointError(
            f"restore of step {entry.step} failed while applying verified data: {e}; the "
            "model is partly restored: restore again"
        )
    group.agree(error)
    return touched
