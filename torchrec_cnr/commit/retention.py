"""Retention: keep what restoring the last N checkpoints needs, delete the rest.

Only the root's current writer deletes, and only right after its own commit succeeded:
an older generation never deletes anything (see :mod:`torchrec_cnr.commit.lease`).
"""

from __future__ import annotations

from torchrec_cnr.manifest import Keep, Manifest
from torchrec_cnr.schema import parse_checkpoint_id
from torchrec_cnr.storage import Storage

__all__ = ["retire"]


def retire(
    storage: Storage,
    manifest: Manifest,
    keep_last: int | None,
    generation: int,
    sweep: bool = True,
    keep: Keep | None = None,
) -> list[str]:
    """Drops what the chains of the last ``keep_last`` checkpoints, and ``keep``, do not
    need (rank 0 only).

    With ``sweep`` (a writer's first commit), also deletes directories that older
    generations started but never committed: it lists the root and reads the whole history.
    The manifest forgets checkpoints before their files go, so no committed manifest ever
    names a missing file.

    Returns:
        The directories deleted.
    """
    dropped = []
    if keep_last is not None:
        needed = manifest.needed_ids(keep_last) | (keep.ids if keep is not None else set())
        dropped = [e.id for e in manifest.checkpoints if e.id not in needed]
        if dropped:
            manifest.checkpoints = [e for e in manifest.checkpoints if e.id in needed]
            manifest.save(storage, keep.seq if keep is not None else None)
    if sweep:
        named = {e.id for e in manifest.checkpoints}
        for name in storage.children():
            found = parse_checkpoint_id(name)
            if name not in named and found is not None and found.generation < generation:
                dropped.append(name)
    for ckpt_id in dropped:
        storage.delete_tree(ckpt_id)
    return dropped
