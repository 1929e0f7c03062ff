"""Stage 6: the typed chain manifest, the commit that makes a checkpoint exist, retention."""

from torchrec_cnr.commit.commit import (
    CommitTarget,
    Pending,
    append,
    count_restore,
    remove_failed,
    write_and_commit,
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
    "remove_failed",
    "retire",
    "saved_fraction",
    "write_and_commit",
]
