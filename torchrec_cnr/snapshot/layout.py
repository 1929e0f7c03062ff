"""Names inside a checkpoint root: checkpoint directories and the tensors each holds.

A root holds the chain manifest, the previous committed one, the writer's lease, and one
torchsnapshot snapshot per checkpoint::

    ROOT/manifest.json
    ROOT/manifest.json.prev
    ROOT/lease.json
    ROOT/000000-step0000000500-g0001/
        <rank>/rows/<name>    a shard's stored tensors (see torchrec_cnr.encoding.codec)
        dense/<name>          replicated tensors, written once (read as 0/dense/<name>)
        <rank>/app/blob       the rank's app_state, serialized
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "CheckpointName",
    "LEASE_NAME",
    "MANIFEST_NAME",
    "PREVIOUS_MANIFEST_NAME",
    "SNAPSHOT_MARKER",
    "app_path",
    "checkpoint_id",
    "dense_path",
    "parse_checkpoint_id",
    "rows_path",
    "stored_ids",
    "stored_part",
    "stored_recent",
    "stored_state",
    "stored_weight",
]

MANIFEST_NAME = "manifest.json"
PREVIOUS_MANIFEST_NAME = "manifest.json.prev"
LEASE_NAME = "lease.json"
SNAPSHOT_MARKER = ".snapshot_metadata"
"""torchsnapshot writes it last: a checkpoint directory without it was never completed."""


def checkpoint_id(seq: int, step: int, generation: int, compacted: bool = False) -> str:
    """Directory name of a checkpoint: unique even when a step is saved twice, and never
    shared by two writers (``generation`` is the writer's, see ``commit.lease``). A
    compaction of checkpoint ``seq`` takes its name with a ``-c``.

    :func:`parse_checkpoint_id` reads it back."""
    return f"{seq:06d}-step{step:010d}-g{generation:04d}" + ("-c" if compacted else "")


# Format 1 names carry no generation (it reads as 0).
_CHECKPOINT_ID = re.compile(r"^(\d{6,})-step(\d{10,})(?:-g(\d+))?(-c)?$")


@dataclass(frozen=True)
class CheckpointName:
    """The parts of a checkpoint directory's name."""

    seq: int
    step: int
    generation: int
    compacted: bool


def parse_checkpoint_id(name: str) -> CheckpointName | None:
    """The parts of a name :func:`checkpoint_id` made; ``None`` for any other name."""
    match = _CHECKPOINT_ID.match(name)
    if match is None:
        return None
    seq, step, generation, compacted = match.groups()
    return CheckpointName(int(seq), int(step), int(generation or 0), compacted is not None)


def stored_weight(key: str) -> str:
    """Stored name of shard ``key``'s fp32 rows."""
    return f"{key}.w"


def stored_part(key: str, part: str) -> str:
    """Stored name of one part of shard ``key``'s quantized rows (codes, scale, ...)."""
    return f"{key}.w.{part}"


def stored_ids(key: str) -> str:
    """Stored name of the global ids of the rows shard ``key`` holds (absent: every row)."""
    return f"{key}.ids"


def stored_recent(key: str) -> str:
    """Stored name of the global ids of shard ``key``'s stored rows that changed since the
    previous checkpoint (absent: every stored row did)."""
    return f"{key}.recent"


def stored_state(key: str, state: str) -> str:
    """Stored name of one optimizer state of shard ``key``, by FBGEMM name."""
    return f"{key}.{state}"


def rows_path(rank: int, name: str) -> str:
    """Logical path of a shard tensor ``name`` written by ``rank``."""
    return f"{rank}/rows/{name}"


def dense_path(name: str) -> str:
    """Logical path of a replicated dense tensor."""
    return f"0/dense/{name}"


def app_path(rank: int) -> str:
    """Logical path of ``rank``'s serialized app_state."""
    return f"{rank}/app/blob"
