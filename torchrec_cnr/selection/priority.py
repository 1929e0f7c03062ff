"""CPR's prioritized selection: the modified rows worth the most, within a byte budget.

CPR (Maeng et al., MLSys'21, Sec. 4.3) saves the most frequently used rows (MFU) or the
rows a sampled subset of lookups touched (SSU) first, so that a failure loses fewer of
the updates that matter. The priorities come from :mod:`torchrec_cnr.tracking.priority`.
"""

from __future__ import annotations

import torch

from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.shard import LocalShard

__all__ = ["prioritize"]


def prioritize(shards: list[LocalShard], budget_bytes: int) -> list[torch.Tensor]:
    """The modified rows with the highest priority that fit ``budget_bytes``.

    Rows are ranked across all of this rank's shards, ties broken by shard and row
    order. Each row costs what it takes in an fp32 checkpoint (values, states, id).

    Returns:
        For each shard, the ``(k,)`` ascending local rows to save.

    Raises:
        ValueError: a shard keeps no priority (tracking mode ``bitmap``).
    """
    cand, scores, costs, owner = [], [], [], []
    for i, shard in enumerate(shards):
        if shard.words is None or shard.priority is None:
            raise ValueError(
                f"{shard.spec.table}: prioritized saves need tracking_sharders(mode='mfu' or 'ssu')"
            )
        rows = bitmap.to_indices(shard.words, shard.spec.rows)
        score = shard.priority.scores(rows)
        cand.append(rows)
        scores.append(score)
        costs.append(torch.full_like(score, float(shard.row_bytes())))
        owner.append(torch.full_like(rows, i))
    if not cand:
        return []
    order = torch.argsort(torch.cat(scores), descending=True, stable=True)
    keep = order[torch.cumsum(torch.cat(costs)[order], 0) <= budget_bytes]
    rows_all, owner_all = torch.cat(cand)[keep], torch.cat(owner)[keep]
    return [rows_all[owner_all == i].sort().values for i in range(len(shards))]
