"""The collective restore of one committed checkpoint into a live model.

All or nothing, on every rank: the model must fit the checkpoint, and every rank reads
and verifies all it needs before any rank changes anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit.manifest import Entry, Manifest, TableShape
from torchrec_cnr.errors import CheckpointError
from torchrec_cnr.restore.apply import apply_chain, read_chain
from torchrec_cnr.restore.compat import check_compatible
from torchrec_cnr.restore.partial import select_shards
from torchrec_cnr.staging import StagingPool
from torchrec_cnr.storage import Storage
from torchrec_cnr.tracking.shard import LocalShard

__all__ = ["restore_entry"]


def restore_entry(
    group: Collective,
    storage: Storage,
    manifest: Manifest,
    entry: Entry,
    shards: list[LocalShard],
    dense: Mapping[str, torch.Tensor],
    app_state: Mapping[str, Any],
    *,
    ranks: list[int] | None = None,
    tables: list[str] | None = None,
    verify: bool = True,
    budget_bytes: int | None = None,
    pool: StagingPool | None = None,
) -> list[torch.Tensor]:
    """Restores ``entry`` into this rank's ``shards``, ``dense`` and ``app_state``.

    With ``ranks`` or ``tables`` it is a partial recovery: only those shards reload, and
    dense tensors, ``app_state`` and the kernels' step counters keep their live values.
    ``pool``: staging buffers to read the baseline into (see :func:`read_chain`).

    Returns:
        For each local shard, a ``(rows,)`` bool mask of rows that came from a delta.

    Raises:
        ModelMismatchError: the checkpoint belongs to another model; nothing changed.
        CheckpointReadError, ChecksumError: a file is missing or damaged; nothing changed.
        CheckpointError: applying verified data failed (on any rank).
    """
    seen: dict[str, TableShape] = {}
    for part in group.gather(Entry.signature([s.spec for s in shards], {})[0]):
        seen.update(part)
    check_compatible(entry, seen, Entry.signature([], dense)[1], storage.url)
    partial = ranks is not None or tables is not None
    chosen = select_shards(shards, group.rank, group.world_size, ranks, tables, seen)
    error: BaseException | None = None
    try:
        read = read_chain(
            storage, manifest, entry, chosen,
            [] if partial else list(dense),
            None if partial or not app_state else group.rank,
            verify, budget_bytes, pool,
        )  # fmt: skip
    except Exception as e:
        error = e
    group.agree(error)
    touched: list[torch.Tensor] = []
    try:
        touched = apply_chain(
            read, chosen, {} if partial else dense, {} if partial else app_state,
            scalars=not partial,
        )  # fmt: skip
    except Exception as e:  # verified data that fails to apply: say what it means
        error = CheckpointError(f"restore of step {entry.step} failed while applying: {e}")
    group.agree(error)
    return touched
