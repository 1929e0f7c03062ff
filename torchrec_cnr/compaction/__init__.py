"""Stage 8: a chain merged into one full checkpoint and committed like any save.

It reads a chain as a restore does (:mod:`torchrec_cnr.restore`) and writes and commits
as a save does (:mod:`torchrec_cnr.commit`), so it sits after both; the model-free
reads of :mod:`torchrec_cnr.offline` stay read-only. :mod:`.compact` merges;
:mod:`.background` runs it in the job, beside the commits (``compact_every``) or on
request (``compact()``).
"""

from torchrec_cnr.compaction.background import (
    BackgroundCompaction,
    CompactionHook,
    compact,
    compaction_job,
    finishing_job,
)
from torchrec_cnr.compaction.compact import compact_entry

__all__ = [
    "BackgroundCompaction",
    "CompactionHook",
    "compact",
    "compact_entry",
    "compaction_job",
    "finishing_job",
]
