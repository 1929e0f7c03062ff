"""Stage 5: the chain manifest read and committed, the commit that makes a checkpoint exist,
this job's fence on the root (lease, generation), retention and the background writer."""

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
from torchrec_cnr.commit.manifest import FORMAT_VERSION, Entry, Manifest, saved_fraction
from torchrec_cnr.commit.retention import retire

__all__ = [
    "FORMAT_VERSION",
    "Entry",
    "Manifest",
    "Pending",
    "CommitTarget",
    "append",
    "count_restore",
    "drop",
    "remove_failed",
    "retire",
    "saved_fraction",
    "write_and_commit",
    "write_rank",
]
