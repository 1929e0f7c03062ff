"""The chain manifest: the versioned contract between save and restore.

One JSON file, ``<root>/manifest.json``, lists every committed checkpoint. It is
replaced atomically (write a temporary file, fsync, rename, fsync the directory) and
only after every rank's data is durable, so its rename is the commit: a checkpoint
directory the manifest does not name does not exist for a restore.

Each entry type is a dataclass with ``to_json``/``from_json``; nothing outside this
module reads the JSON.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrec_cnr.encoding import ShardRecord
from torchrec_cnr.errors import ManifestError
from torchrec_cnr.recovery.interval import IntervalDecision
from torchrec_cnr.selection.policy import Kind
from torchrec_cnr.snapshot.layout import (
    MANIFEST_NAME,
    PREVIOUS_MANIFEST_NAME,
    app_path,
    dense_path,
    rows_path,
)
from torchrec_cnr.storage import PreconditionFailed, Root, Storage, as_storage
from torchrec_cnr.tracking.shard import ShardSpec

__all__ = [
    "FORMAT_VERSION",
    "DenseInfo",
    "Entry",
    "Manifest",
    "TableShape",
    "saved_fraction",
]

FORMAT_VERSION = 4
"""2: optimizer states by FBGEMM name with layout and dtype, and the kernels' step counters.
3: a checksum of the manifest itself, the writer generation that may commit, each table's key
in the unsharded module's state dict, and compacted checkpoints (``compacted_from``).
4: which rows changed since the previous checkpoint (``Entry.since``, ``ShardRecord.recent``
and a ``<key>.recent`` tensor), so that a serving follower reads only those."""

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
    """A whole table's shape, as the model defines it, and its unsharded state-dict key."""

    num_embeddings: int
    embedding_dim: int
    state_dict_key: str = field(default="", compare=False)

    @classmethod
    def of(cls, spec: ShardSpec) -> TableShape:
        return cls(spec.num_embeddings, spec.embedding_dim, spec.state_dict_key)


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


def _describe(manifest: Manifest) -> str:
    latest = manifest.latest()
    if latest is None:
        return "no checkpoint"
    return f"{len(manifest.checkpoints)} checkpoint(s), latest step {latest.step}"


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
    interval_decision: IntervalDecision | None = None
    """CPR's interval decision, once ``interval_steps: auto`` made it."""
    compacted_from: str | None = None
    """The checkpoint whose chain this full checkpoint merges (see :mod:`torchrec_cnr.compaction`)."""
    since: str | None = None
    """The checkpoint its shards' ``recent`` rows changed since: the one this job committed
    (or restored) before it; ``None`` for a job's first, or before format 4."""

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
        if self.interval_decision is not None:
            raw["interval_decision"] = self.interval_decision.to_json()
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
                "interval_decision": None
                if raw.get("interval_decision") is None
                else IntervalDecision.from_json(raw["interval_decision"]),
            }
        )


def _checksum(payload: dict[str, Any]) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


@dataclass
class Manifest:
    """The parsed manifest of a checkpoint root."""

    checkpoints: list[Entry] = field(default_factory=list)
    """Committed checkpoints, oldest first."""
    restores: int = 0
    """Restores performed from this root."""
    writer_generation: int = 0
    """The generation of the job that may commit to this root (see ``commit.lease``)."""
    version: str | None = field(default=None, compare=False)
    """The storage version it was read at; a save replaces exactly that version."""

    @classmethod
    def parse(cls, data: bytes, where: str) -> Manifest:
        """Parses manifest bytes, checking their checksum.

        Raises:
            ManifestError: the bytes are not a manifest this library reads, or are damaged.
        """
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"{where} is not valid JSON ({e})") from e
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if not isinstance(version, int) or version not in range(1, FORMAT_VERSION + 1):
            raise ManifestError(
                f"{where} has format_version {version!r}; this torchrec_cnr reads 1 to {FORMAT_VERSION}"
            )
        if version >= 3:
            recorded = raw.pop("checksum", None)
            if recorded != _checksum(raw):
                raise ManifestError(f"{where} is damaged: its checksum does not match its content")
        try:
            return cls(
                checkpoints=[Entry.from_json(e, version) for e in raw.get("checkpoints", [])],
                restores=int(raw.get("restores", 0)),
                writer_generation=int(raw.get("writer_generation", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where} is malformed: {e!r}") from e

    def to_bytes(self) -> bytes:
        payload: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "writer_generation": self.writer_generation,
            "restores": self.restores,
            "checkpoints": [e.to_json() for e in self.checkpoints],
        }
        payload["checksum"] = _checksum(payload)
        return json.dumps(payload, indent=1).encode()

    @classmethod
    def load(cls, root: Root, *, fallback: bool = False) -> Manifest:
        """Reads the root's manifest; an empty one if the root has none yet.

        Args:
            root: the root: a :class:`Storage`, a path or a URL.
            fallback: if the manifest is damaged or missing while a previous committed
                manifest exists, use that one (with a warning) instead of failing.

        Raises:
            ManifestError: the manifest is damaged, of another format version, or missing
                while the root shows it had one; the message says whether the previous
                committed manifest is intact.
        """
        storage = as_storage(root)
        where = storage.path(MANIFEST_NAME)
        got = storage.read(MANIFEST_NAME)
        if got is None and not storage.exists(PREVIOUS_MANIFEST_NAME):
            return cls()  # a fresh root
        if got is not None:
            try:
                manifest = cls.parse(got[0], where)
                manifest.version = got[1]
                return manifest
            except ManifestError as e:
                problem = str(e)
        else:
            problem = f"{where} is missing, but the root holds a previous committed manifest"
        previous = cls.previous(storage)
        if previous is not None and fallback:
            warnings.warn(
                f"{problem}; using the previous committed manifest ({_describe(previous)})",
                stacklevel=2,
            )
            # The next commit replaces what is there now, damaged or not.
            previous.version = None if got is None else got[1]
            return previous
        hint = (
            f"; the previous committed manifest {PREVIOUS_MANIFEST_NAME} is intact "
            f"({_describe(previous)}): CheckpointConfig(manifest_fallback=True) uses it"
            if previous is not None
            else f"; no intact {PREVIOUS_MANIFEST_NAME} to fall back to"
        )
        raise ManifestError(problem + hint)

    @classmethod
    def previous(cls, root: Root) -> Manifest | None:
        """The previous committed manifest, if it exists and is intact."""
        storage = as_storage(root)
        got = storage.read(PREVIOUS_MANIFEST_NAME)
        if got is None:
            return None
        try:
            return cls.parse(got[0], storage.path(PREVIOUS_MANIFEST_NAME))
        except ManifestError:
            return None

    def save(self, storage: Storage) -> None:
        """Commits this manifest in place of the version it was read at.

        The manifest it replaces stays readable as ``manifest.json.prev``, so one damaged
        manifest never loses the chain. The replacement is one atomic, conditional write:
        if another writer changed the manifest since this one was read, nothing changes.

        Raises:
            PreconditionFailed: the manifest is no longer at :attr:`version`.
        """
        current = storage.read(MANIFEST_NAME)
        found = None if current is None else current[1]
        if found != self.version:
            raise PreconditionFailed(
                f"{storage.path(MANIFEST_NAME)} changed since it was read (another writer?)"
            )
        first = current is None and not storage.exists(PREVIOUS_MANIFEST_NAME)
        if current is not None:
            try:
                Manifest.parse(current[0], MANIFEST_NAME)
                storage.write(PREVIOUS_MANIFEST_NAME, current[0])
            except ManifestError:
                pass  # a damaged manifest never replaces the intact previous one
        self.version = storage.write(MANIFEST_NAME, self.to_bytes(), expect=self.version)
        if first:
            # A first commit leaves an empty previous manifest: from now on a missing
            # manifest means a lost one, not a fresh root. It goes after the manifest, so
            # that a reader (a follower) never finds a previous manifest and no manifest.
            storage.write(PREVIOUS_MANIFEST_NAME, Manifest().to_bytes())

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

    def find_id(self, ckpt_id: str) -> Entry | None:
        """The committed checkpoint of directory ``ckpt_id``, if the manifest names it."""
        return next((e for e in self.checkpoints if e.id == ckpt_id), None)

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
