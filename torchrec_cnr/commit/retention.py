"""Retention: keep what restoring the last N checkpoints needs, delete the rest."""

from __future__ import annotations

import shutil
from pathlib import Path

from torchrec_cnr.commit.manifest import Manifest

__all__ = ["retire"]


def retire(root: Path, manifest: Manifest, keep_last: int | None) -> list[str]:
    """Drops every checkpoint the chains of the last ``keep_last`` do not need (rank 0 only).

    The manifest forgets them before their files go, so no committed manifest ever
    names a missing file.

    Returns:
        The ids deleted.
    """
    if keep_last is None:
        return []
    needed = manifest.needed_ids(keep_last)
    dropped = [e.id for e in manifest.checkpoints if e.id not in needed]
    if not dropped:
        return []
    manifest.checkpoints = [e for e in manifest.checkpoints if e.id in needed]
    manifest.save(root)
    for ckpt_id in dropped:
        shutil.rmtree(root / ckpt_id, ignore_errors=True)
    return dropped
