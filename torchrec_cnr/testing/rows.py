"""Rows modified on purpose: a test or a benchmark states exactly which rows of each local
shard changed since the last checkpoint, so that the next delta holds those and no others."""

from __future__ import annotations

import torch

from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.shard import LocalShard

__all__ = ["modify"]


def modify(shards: list[LocalShard], rows: list[torch.Tensor]) -> None:
    """Exactly ``rows`` are modified since the last checkpoint: their tracker bits set,
    every other bit cleared, and their weights nudged so that a delta holds real changes.

    Args:
        shards: this rank's local shards, as the manager tracks them.
        rows: for each shard, its local row indices, ``(n,)`` int64.
    """
    with torch.no_grad():
        for s, r in zip(shards, rows):
            s.drain()
            s.weight[r] += 1e-3
            if s.words is not None and s.recent is not None:
                s.words.zero_()
                s.recent.zero_()  # what a follower reads: changed since the last checkpoint
                bitmap.set_bits_in_both(s.words, s.recent, r)
