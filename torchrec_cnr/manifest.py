"""The chain manifest: the versioned contract between save and restore.

One JSON file, ``<root>/manifest.json``, lists every committed checkpoint. It
is replaced atomically (write a temporary file, fsync, rename, fsync the
directory) and only after every rank's data is durable, so its rename is the
commit: a checkpoint directory the manifest does not name does not exist for a
restore.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FORMAT_VERSION", "MANIFEST_NAME", "Manifest", "ManifestError"]

FORMAT_VERSION = 2
"""2: optimizer states by FBGEMM name with layout and dtype, and the kernels' step counters."""
MANIFEST_NAME = "manifest.json"

# Version 1 named each shard's states state0, state1, ... in FBGEMM's order.
_V1_STATE_ORDER = {
    "EXACT_ADAGRAD": ["momentum1"],
    "EXACT_ROWWISE_ADAGRAD": ["momentum1", "prev_iter", "row_counter"],
    "ADAM": ["momentum1", "momentum2"],
    "PARTIAL_ROWWISE_ADAM": ["momentum1", "momentum2"],
    "LAMB": ["momentum1", "momentum2"],
    "PARTIAL_ROWWISE_LAMB": ["momentum1", "momentum2"],
}


def _upgrade_v1(entry: dict[str, Any]) -> None:
    for rec in entry["shards"]:
        order = _V1_STATE_ORDER.get(rec["optimizer"], [])
        states = {}
        for j, old in enumerate(rec["states"]):
            # The dtype was not recorded; "unknown" keeps restore off its in-place path.
            name = order[j] if j < len(order) else old
            states[name] = {"tensor": f"{rec['key']}.{old}", "layout": None, "dtype": "unknown"}
        rec["states"] = states
        rec["scalars"] = {}


class ManifestError(ValueError):
    """The manifest is missing, corrupt, or of an unknown format."""


@dataclass
class Manifest:
    """The parsed manifest of a checkpoint root."""

    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    """Committed checkpoints, oldest first; see :meth:`entry` for the keys."""
    restores: int = 0
    """Restores performed from this root."""

    @staticmethod
    def path(root: str | os.PathLike[str]) -> Path:
        return Path(root) / MANIFEST_NAME

    @classmethod
    def load(cls, root: str | os.PathLike[str]) -> Manifest:
        """Reads the manifest; an empty one if the root has none yet.

        Raises:
            ManifestError: the file is not valid JSON or has another format version.
        """
        path = cls.path(root)
        if not path.exists():
            return cls()
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ManifestError(f"cannot read checkpoint manifest {path}: {e}") from e
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if version not in (1, FORMAT_VERSION):
            raise ManifestError(
                f"{path} has format_version {version!r}; this torchrec_cnr reads 1 to {FORMAT_VERSION}"
            )
        checkpoints = list(raw.get("checkpoints", []))
        if version == 1:
            for entry in checkpoints:
                _upgrade_v1(entry)
        return cls(checkpoints=checkpoints, restores=int(raw.get("restores", 0)))

    def save(self, root: str | os.PathLike[str]) -> None:
        """Atomically replaces the manifest on disk."""
        path = self.path(root)
        tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}.tmp")
        payload = {
            "format_version": FORMAT_VERSION,
            "restores": self.restores,
            "checkpoints": self.checkpoints,
        }
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)

    def latest(self) -> dict[str, Any] | None:
        return self.checkpoints[-1] if self.checkpoints else None

    def find(self, step: int | None) -> dict[str, Any] | None:
        """The newest committed checkpoint of ``step`` (the latest one if ``None``)."""
        if step is None:
            return self.latest()
        for entry in reversed(self.checkpoints):
            if entry["step"] == step:
                return entry
        return None

    def by_id(self, ckpt_id: str) -> dict[str, Any]:
        for entry in self.checkpoints:
            if entry["id"] == ckpt_id:
                return entry
        raise ManifestError(f"checkpoint {ckpt_id!r} is named in a chain but not in the manifest")

    def steps(self) -> list[int]:
        return [e["step"] for e in self.checkpoints]

    def next_seq(self) -> int:
        return max((e["seq"] for e in self.checkpoints), default=-1) + 1

    @staticmethod
    def entry(
        *,
        seq: int,
        step: int,
        kind: str,
        policy: str,
        chain: list[str],
        sizes: list[float],
        world_size: int,
        tables: dict[str, dict[str, int]],
        dense: dict[str, dict[str, Any]],
        shards: list[dict[str, Any]],
        dense_checksums: dict[str, int],
        app_checksums: list[int],
        nbytes: int,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A manifest entry for one committed checkpoint."""
        ckpt_id = chain[-1]
        return {
            "id": ckpt_id,
            "seq": seq,
            "step": step,
            "kind": kind,
            "policy": policy,
            "chain": chain,
            "sizes": sizes,
            "world_size": world_size,
            "tables": tables,
            "dense": dense,
            "shards": shards,
            "dense_checksums": dense_checksums,
            "app_checksums": app_checksums,
            "bytes": nbytes,
            "committed_at": time.time(),
            **(extra or {}),
        }

    def chain_bytes(self, entry: dict[str, Any]) -> int:
        """Bytes a restore of ``entry`` reads: its chain's checkpoints."""
        return sum(self.by_id(i)["bytes"] for i in entry["chain"])

    def needed_ids(self, last: int | None) -> set[str]:
        """Ids the chains of the last ``last`` checkpoints need (all if ``None``)."""
        entries = self.checkpoints if last is None else self.checkpoints[-last:]
        return {i for e in entries for i in e["chain"]}


def saved_fraction(shards: list[dict[str, Any]]) -> float:
    """Elements stored by these shard records, as a fraction of the whole shards (S_i of BRIEF 1.3)."""
    total = sum(s["spec"]["rows"] * s["spec"]["cols"] for s in shards)
    saved = sum(s["saved_rows"] * s["spec"]["cols"] for s in shards)
    return saved / total if total else 0.0


def checkpoint_id(seq: int, step: int) -> str:
    """Directory name of a checkpoint; unique even when a step is saved twice."""
    return f"{seq:06d}-step{step:010d}"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsyncs every file and directory under ``path`` (torchsnapshot's fs plugin never does)."""
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def tree_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of every file under ``path``."""
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)
