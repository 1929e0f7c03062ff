"""Stage 5: the commit that makes a checkpoint exist (the manifest it commits is
:mod:`torchrec_cnr.manifest`'s), this job's fence on the root (lease, generation),
retention, the background writer and the save's commit job."""

from torchrec_cnr.commit.commit import (
    CommitTarget,
    Pending,
    append,
    count_restore,
    drop,
    remove_failed,
    write_and_commit,
    write_rank,
)
from torchrec_cnr.commit.retention import retire

__all__ = [
    "Pending",
    "CommitTarget",
    "append",
    "count_restore",
    "drop",
    "remove_failed",
    "retire",
    "write_and_commit",
    "write_rank",
]
