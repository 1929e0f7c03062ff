"""Stage 3: copy what a checkpoint needs out of the live model into host memory.

Two ways, chosen by ``CheckpointConfig.staging``:

- :mod:`~torchrec_cnr.staging.eager`: ``save()`` copies every selected row before it
  returns; the stall grows with the checkpoint.
- :mod:`~torchrec_cnr.staging.lazy`: copy-on-write. ``save()`` copies only the small
  things and returns; the rows are copied afterwards, by the background writer and,
  for a row that training is about to update, by the tracker's lookup hook first.

Both copy into a :class:`~torchrec_cnr.staging.pool.StagingPool` and hand each shard
to the checkpoint's writer (a :class:`~torchrec_cnr.staging.shard.Sink`).
"""

from torchrec_cnr.staging.eager import stage
from torchrec_cnr.staging.lazy import LazyStaging, lazy_fallback
from torchrec_cnr.staging.pool import StagingPool
from torchrec_cnr.staging.shard import (
    Sink,
    StagedCheckpoint,
    StagedShard,
    stage_shard,
)

__all__ = [
    "LazyStaging",
    "Sink",
    "StagedCheckpoint",
    "StagedShard",
    "StagingPool",
    "lazy_fallback",
    "stage",
    "stage_shard",
]
