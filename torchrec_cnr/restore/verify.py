"""Verifying committed checkpoints without a model: every chain complete, every checksum right."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from torchrec_cnr.errors import CheckpointReadError, ManifestError
from torchrec_cnr.iocontext import IOContext
from torchrec_cnr.manifest import Manifest, Summary
from torchrec_cnr.snapshot import SnapshotReader, check
from torchrec_cnr.storage import Storage

__all__ = ["verify_chains", "verify_checkpoint"]


def verify_checkpoint(
    storage: Storage, manifest: Manifest, summary: Summary, io: IOContext
) -> list[str]:
    """Reads every tensor of one committed checkpoint of ``manifest`` (and its record)
    and checks it; returns the problems found."""
    try:
        ckpt = manifest.record(summary)
        shards = manifest.shards(ckpt)
        reader = SnapshotReader(storage, ckpt.id, io.io, io.object_bytes)
    except CheckpointReadError as e:
        return [str(e)]
    problems: list[str] = []
    for key in ckpt.shard_parts:  # each rank's part, which its restores read alone
        if key == "all":
            continue
        try:
            part = [r.to_json() for r in manifest.shards(ckpt, int(key))]
        except CheckpointReadError as e:
            problems.append(str(e))
            continue
        if part != [r.to_json() for r in shards if r.spec.rank == int(key)]:
            problems.append(f"{ckpt.id}: the part of rank {key} differs from its shard records")

    def attempt(read: Callable[[], torch.Tensor | bytes], expected: int, what: str) -> None:
        try:
            check(read(), expected, what)
        except CheckpointReadError as e:  # ChecksumError included
            problems.append(str(e))

    for rec in shards:
        rank = rec.spec.rank
        for name, expected in rec.checksums.items():
            what = f"{ckpt.id}: rank {rank} {rec.spec.table} {name}"
            attempt(partial(reader.rows, rank, name), expected, what)
    for name, expected in ckpt.dense_checksums.items():
        attempt(partial(reader.dense, name), expected, f"{ckpt.id}: dense {name}")
    for rank, expected in enumerate(ckpt.app_checksums):
        attempt(partial(reader.app_state, rank), expected, f"{ckpt.id}: rank {rank} app_state")
    return problems


def verify_chains(
    storage: Storage, manifest: Manifest, entries: list[Summary], io: IOContext
) -> tuple[int, list[str], list[str]]:
    """Verifies every checkpoint the chains of ``entries`` need, each once.

    Returns:
        How many checkpoints were read; the problems found, each prefixed with the step
        whose chain needs it; and the ids of the checkpoints found damaged.
    """
    problems: list[str] = []
    damaged: list[str] = []
    checked: set[str] = set()
    for entry in entries:
        # A consecutive delta whose parent was checked adds only itself: a chain holds
        # the whole chain of each of its links.
        ids = [entry.id] if entry.depth > 2 and entry.parent in checked else manifest.chain(entry)
        for ckpt_id in ids:
            if ckpt_id in checked:
                continue
            checked.add(ckpt_id)
            try:
                found = verify_checkpoint(storage, manifest, manifest.by_id(ckpt_id), io)
            except (ManifestError, CheckpointReadError) as e:
                found = [str(e)]
            problems += [f"step {entry.step}: {p}" for p in found]
            if found:
                damaged.append(ckpt_id)
    return len(checked), problems, damaged
