"""Verifying committed checkpoints without a model: every chain complete, every checksum right."""

from __future__ import annotations

from pathlib import Path

from torchrec_cnr.commit.manifest import Entry, Manifest
from torchrec_cnr.encoding import check
from torchrec_cnr.errors import CheckpointReadError, ManifestError
from torchrec_cnr.storage import SnapshotReader

__all__ = ["verify_chains", "verify_checkpoint"]


def verify_checkpoint(root: Path, ckpt: Entry) -> list[str]:
    """Reads every tensor of one checkpoint and checks it; returns the problems found."""
    try:
        reader = SnapshotReader(root / ckpt.id)
    except CheckpointReadError as e:
        return [str(e)]
    problems: list[str] = []

    def attempt(read, expected: int, what: str) -> None:  # type: ignore[no-untyped-def]
        try:
            check(read(), expected, what)
        except CheckpointReadError as e:  # ChecksumError included
            problems.append(str(e))

    for rec in ckpt.shards:
        rank = rec.spec.rank
        for name, expected in rec.checksums.items():
            what = f"{ckpt.id}: rank {rank} {rec.spec.table} {name}"
            attempt(lambda r=rank, n=name: reader.rows(r, n), expected, what)
    for name, expected in ckpt.dense_checksums.items():
        attempt(lambda n=name: reader.dense(n), expected, f"{ckpt.id}: dense {name}")
    for rank, expected in enumerate(ckpt.app_checksums):
        attempt(lambda r=rank: reader.app_state(r), expected, f"{ckpt.id}: rank {rank} app_state")
    return problems


def verify_chains(root: Path, manifest: Manifest, entries: list[Entry]) -> tuple[int, list[str]]:
    """Verifies every checkpoint the chains of ``entries`` need, each once.

    Returns:
        How many checkpoints were read, and the problems found, each prefixed with the
        step whose chain needs it.
    """
    problems: list[str] = []
    checked: set[str] = set()
    for entry in entries:
        for ckpt_id in entry.chain:
            if ckpt_id in checked:
                continue
            checked.add(ckpt_id)
            try:
                ckpt = manifest.by_id(ckpt_id)
            except ManifestError as e:
                problems.append(f"step {entry.step}: {e}")
                continue
            problems += [f"step {entry.step}: {p}" for p in verify_checkpoint(root, ckpt)]
    return len(checked), problems
