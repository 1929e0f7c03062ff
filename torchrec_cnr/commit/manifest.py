"""The chain manifest: the versioned contract between save and restore.

One JSON file, ``<root>/manifest.json``, lists every committed checkpoint. It is
replaced atomically (write a temporary file, fsync, rename, fsync the directory) and
only after every rank's data is durable, so its rename is the commit: a checkpoint
directory the manifest does not name does not exist for a restore.

Each entry type is a dataclass with ``to_json``/``from_json``; nothing outside this
module reads the JSON.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchrec_cnr.encoding import ShardRecord
from torchrec_cnr.errors import ManifestError
from torchrec_cnr.selection.policy import Kind
from torchrec_cnr.storage.fs import fsync_dir
from torchrec_cnr.storage.layout import MANIFEST_NAME, app_path, dense_path, rows_path
from torchrec_cnr.tracking.shard import ShardSpec

__all__ = [
    "FORMAT_VERSION",
    "DenseInfo",
    "Entry",
    "Manifest",
    "TableShape",
    "saved_fraction",
]

FORMAT_VERSION = 2
"""2: optimizer states by FBGEMM name with layout and dtype, and the kernels' step counters."""

# Version 1 named each shard's states state0, state1, ... in FBGEMM's order.
_V1_STATE_ORDER = {
    "EXACT_ADAGRAD": ["momentum1"],
    "EXACT_ROWWISE_ADAGRAD": ["momentum1", "prev_iter", "row_counter"],
    "ADAM": ["momentum1", "momentum2"],
    "PARTIAL_ROWWISE_ADAM": ["momentum1", "momentum2"],
    "LAMB": ["momentum1", "momentum2"],
    "PARTIAL_ROWWISE_LAMB": ["momentum1", "momentum2"],
}


def _upgrade_v1(rec: dict[str, Any]) -> dict[str, Any]:
    order = _V1_STATE_ORDER.get(rec["optimizer"], [])
    states = {}
    for j, old in enumerate(rec["states"]):
        # The dtype was not recorded; "unknown" keeps restore off its in-place path.
        name = order[j] if j < len(order) else old
        states[name] = {"tensor": f"{rec['key']}.{old}", "layout": None, "dtype": "unknown"}
    return rec | {"states": states, "scalars": {}}


@dataclass(frozen=True)
class TableShape:
    """A whole table's shape, as the model defines it."""

    num_embeddings: int
    embedding_dim: int

    @classmethod
    def of(cls, spec: ShardSpec) -> TableShape:
        return cls(spec.num_embeddings, spec.embedding_dim)


@dataclass(frozen=True)
class DenseInfo:
    """A dense tensor's shape and dtype."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> DenseInfo:
        return cls(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))

    def __str__(self) -> str:
        return f"{list(self.shape)} {self.dtype}"


def saved_fraction(shards: list[ShardRecord]) -> float:
    """Elements stored by these shard records, as a fraction of the whole shards (Check-N-Run's S_i)."""
    total = sum(s.spec.rows * s.spec.cols for s in shards)
    saved = sum(s.saved_rows * s.spec.cols for s in shards)
    return saved / total if total else 0.0


@dataclass
class Entry:
    """One committed checkpoint."""

    id: str
    """Its directory name (see :func:`torchrec_cnr.storage.checkpoint_id`)."""
    seq: int
    step: int
    kind: Kind
    policy: str
    chain: list[str]
    """Ids a restore of this checkpoint applies, baseline first."""
    sizes: list[float]
    """S_1..S_i of the deltas since the baseline."""
    world_size: int
    tables: dict[str, TableShape]
    dense: dict[str, DenseInfo]
    shards: list[ShardRecord]
    dense_checksums: dict[str, int]
    app_checksums: list[int]
    """One per rank."""
    bytes: int
    """Bytes on disk."""
    committed_at: float = field(default_factory=time.time)
    restores_before: int = 0
    """Restores recorded in the manifest when this checkpoint was written."""
    staged_bytes: int = 0
    """Bytes staged in host memory on rank 0."""
    stall_s: float = 0.0
    """Longest time any rank's training was blocked by this save."""
    interval_decision: dict[str, Any] | None = None
    """CPR's interval decision, once ``interval_steps: auto`` made it."""

    @staticmethod
    def signature(
        shards: list[ShardSpec], dense: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, TableShape], dict[str, DenseInfo]]:
        """Table shapes and dense tensor infos of a model, as an entry records them."""
        return (
            {s.table: TableShape.of(s) for s in shards},
            {k: DenseInfo.of(v) for k, v in dense.items()},
        )

    def checksums_by_path(self) -> dict[str, int]:
        """Logical tensor path -> CRC32, for every tensor this checkpoint stores."""
        sums = {
            rows_path(rec.spec.rank, name): crc
            for rec in self.shards
            for name, crc in rec.checksums.items()
        }
        sums.update({dense_path(name): crc for name, crc in self.dense_checksums.items()})
        sums.update({app_path(rank): crc for rank, crc in enumerate(self.app_checksums)})
        return sums

    def to_json(self) -> dict[str, Any]:
        raw = dict(self.__dict__)
        raw["tables"] = {k: dict(v.__dict__) for k, v in self.tables.items()}
        raw["dense"] = {
            k: {"shape": list(v.shape), "dtype": v.dtype} for k, v in self.dense.items()
        }
        raw["shards"] = [s.to_json() for s in self.shards]
        return raw

    @classmethod
    def from_json(cls, raw: dict[str, Any], version: int = FORMAT_VERSION) -> Entry:
        shards = raw["shards"] if version > 1 else [_upgrade_v1(s) for s in raw["shards"]]
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(
            **known
            | {
                "tables": {k: TableShape(**v) for k, v in raw["tables"].items()},
                "dense": {
                    k: DenseInfo(tuple(v["shape"]), v["dtype"]) for k, v in raw["dense"].items()
                },
                "shards": [ShardRecord.from_json(s) for s in shards],
            }
        )


@dataclass
class Manifest:
    """The parsed manifest of a checkpoint root."""

    checkpoints: list[Entry] = field(default_factory=list)
    """Committed checkpoints, oldest first."""
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
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"cannot read checkpoint manifest {path}: {e}") from e
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if version not in (1, FORMAT_VERSION):
            raise ManifestError(
                f"{path} has format_version {version!r}; this torchrec_cnr reads 1 to {FORMAT_VERSION}"
            )
        try:
            checkpoints = [Entry.from_json(e, version) for e in raw.get("checkpoints", [])]
            return cls(checkpoints=checkpoints, restores=int(raw.get("restores", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"checkpoint manifest {path} is malformed: {e!r}") from e

    def save(self, root: str | os.PathLike[str]) -> None:
        """Atomically replaces the manifest on disk."""
        path = self.path(root)
        tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}.tmp")
        payload = {
            "format_version": FORMAT_VERSION,
            "restores": self.restores,
            "checkpoints": [e.to_json() for e in self.checkpoints],
        }
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)

    def latest(self) -> Entry | None:
        return self.checkpoints[-1] if self.checkpoints else None

    def find(self, step: int | None) -> Entry | None:
        """The newest committed checkpoint of ``step`` (the latest one if ``None``)."""
        if step is None:
            return self.latest()
        for entry in reversed(self.checkpoints):
            if entry.step == step:
                return entry
        return None

    def by_id(self, ckpt_id: str) -> Entry:
        for entry in self.checkpoints:
            if entry.id == ckpt_id:
                return entry
        raise ManifestError(f"checkpoint {ckpt_id!r} is named in a chain but not in the manifest")

    def steps(self) -> list[int]:
        return [e.step for e in self.checkpoints]

    def next_seq(self) -> int:
        return max((e.seq for e in self.checkpoints), default=-1) + 1

    def chain_bytes(self, entry: Entry) -> int:
        """Bytes a restore of ``entry`` reads: its chain's checkpoints."""
        return sum(self.by_id(i).bytes for i in entry.chain)

    def needed_ids(self, last: int | None) -> set[str]:
        """Ids the chains of the last ``last`` checkpoints need (all if ``None``)."""
        entries = self.checkpoints if last is None else self.checkpoints[-last:]
        return {i for e in entries for i in e.chain}
