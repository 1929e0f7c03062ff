"""Checksums of stored tensors, and verification of committed checkpoints.

Every tensor a checkpoint stores gets a CRC32 of its raw bytes in the
manifest. A restore recomputes it on every tensor it reads; ``cnr verify``
reads and checks every tensor of every checkpoint a chain needs.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch

from torchrec_cnr.manifest import Manifest


class CheckpointReadError(RuntimeError):
    """A committed checkpoint's files are missing, unreadable or corrupt."""


class ChecksumError(CheckpointReadError):
    """A stored tensor's bytes do not match the checksum recorded at save time."""


def crc32(tensor: torch.Tensor) -> int:
    """CRC32 of the tensor's raw bytes (zlib runs at several GB/s)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return 0
    return zlib.crc32(t.view(-1).view(torch.uint8).numpy().data)


def crc32_bytes(data: bytes) -> int:
    return zlib.crc32(data)


def check(value: torch.Tensor | bytes, expected: int | None, what: str) -> None:
    """Raises :class:`ChecksumError` naming ``what`` if ``value`` does not match ``expected``."""
    if expected is None:
        return
    got = crc32_bytes(value) if isinstance(value, bytes) else crc32(value)
    if got != expected:
        raise ChecksumError(f"{what} is corrupt: checksum {got:#010x}, recorded {expected:#010x}")


def verify_entry(root: Path, manifest: Manifest, entry: dict[str, Any]) -> list[str]:
    """Reads every tensor of ``entry``'s chain and checks it; returns the problems found."""
    from torchrec_cnr.writer import SnapshotReader

    problems: list[str] = []
    for ckpt_id in entry["chain"]:
        try:
            ckpt = manifest.by_id(ckpt_id)
        except ValueError as e:
            problems.append(str(e))
            continue
        try:
            reader = SnapshotReader(root / ckpt_id)
        except CheckpointReadError as e:
            problems.append(str(e))
            continue
        for rec in ckpt["shards"]:
            rank = rec["spec"]["rank"]
            for name, expected in rec["checksums"].items():
                what = f"{ckpt_id}: rank {rank} {rec['spec']['table']} {name}"
                try:
                    check(reader.rows(rank, name), expected, what)
                except (CheckpointReadError, ChecksumError) as e:
                    problems.append(str(e))
        for name, expected in ckpt["dense_checksums"].items():
            try:
                check(reader.dense(name), expected, f"{ckpt_id}: dense {name}")
            except (CheckpointReadError, ChecksumError) as e:
                problems.append(str(e))
        for rank, expected in enumerate(ckpt["app_checksums"]):
            try:
                check(reader.app_state(rank), expected, f"{ckpt_id}: rank {rank} app_state")
            except (CheckpointReadError, ChecksumError) as e:
                problems.append(str(e))
    return problems
