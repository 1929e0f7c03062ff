"""Compaction: a chain merged into one full checkpoint and committed like any save.

It reads a chain as a restore does (:mod:`torchrec_cnr.restore`) and writes and commits
as a save does (:mod:`torchrec_cnr.commit`), so it sits after both; the model-free
reads of :mod:`torchrec_cnr.offline` stay read-only.
"""

from torchrec_cnr.compaction.compact import (
    commit_and_compact,
    compact,
    compact_entry,
    compaction_job,
)

__all__ = ["commit_and_compact", "compact", "compact_entry", "compaction_job"]
