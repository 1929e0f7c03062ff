"""Stage 3: copy what a checkpoint needs out of the live model into host memory.

:class:`~torchrec_cnr.staging.stager.Stager` stages each save as its plan says
(:mod:`~torchrec_cnr.staging.plan`: each shard's rows, and which of two ways stages it,
from ``CheckpointConfig.staging``, the memory budget and what each shard allows):

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
from torchrec_cnr.staging.plan import SavePlan, ShardPlan, plan_save
from torchrec_cnr.staging.pool import StagingPool
from torchrec_cnr.staging.shard import (
    RecordingSink,
    Sink,
    SourceInfo,
    StagedCheckpoint,
    StagedShard,
    stage_shard,
)
from torchrec_cnr.staging.stager import Stager

__all__ = [
    "LazyStaging",
    "SavePlan",
    "RecordingSink",
    "ShardPlan",
    "Sink",
    "SourceInfo",
    "StagedCheckpoint",
    "StagedShard",
    "Stager",
    "StagingPool",
    "lazy_fallback",
    "plan_save",
    "stage",
    "stage_shard",
]
