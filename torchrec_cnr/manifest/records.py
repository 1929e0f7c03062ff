"""The manifest's records, as plain data that does no I/O: a committed checkpoint's
summary (:class:`Summary`, what the manifest holds) and whole record (:class:`Entry`), the
shapes it records (:class:`TableShape`, :class:`DenseInfo`), the manifest itself
(:class:`ManifestRecord`) and the history segments it names (:class:`SegmentRef`), each
with its JSON, and the sealed bytes of a checkpoint's record and of a segment.

The other types a root persists, the names in it and the sealed-JSON format are
:mod:`torchrec_cnr.schema`'s; reading and committing the manifest against a root is
:mod:`.store`'s.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Self, TypeVar

import torch

from torchrec_cnr.errors import ManifestError, brief
from torchrec_cnr.schema import (
    FORMAT_VERSION,
    IntervalDecision,
    Kind,
    ShardRecord,
    ShardSpec,
    open_sealed,
    parse_checkpoint_id,
    sealed_bytes,
    without_gc,
)

__all__ = [
    "DenseInfo",
    "Entry",
    "ManifestRecord",
    "SegmentRef",
    "Summary",
    "TableShape",
    "describe",
    "parse_record",
    "parse_segment",
    "record_bytes",
    "saved_fraction",
    "segment_bytes",
]

_M = TypeVar("_M", bound="ManifestRecord")

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


def describe(manifest: ManifestRecord) -> str:
    """How many checkpoints a manifest names, and its latest step, for messages."""
    latest = manifest.latest()
    if latest is None:
        return "no checkpoint"
    return f"{manifest.count()} checkpoint(s), latest step {latest.step}"


def saved_fraction(shards: list[ShardRecord]) -> float:
    """Elements stored by these shard records, as a fraction of the whole shards (Check-N-Run's S_i)."""
    total = sum(s.spec.rows * s.spec.cols for s in shards)
    saved = sum(s.saved_rows * s.spec.cols for s in shards)
    return saved / total if total else 0.0


@dataclass(frozen=True, kw_only=True)
class Summary:
    """One committed checkpoint, as the manifest and its history segments name it: plain
    data. Its detail (shapes, shard records, checksums) is its record, an :class:`Entry`,
    which :meth:`torchrec_cnr.manifest.Manifest.record` reads."""

    id: str
    """Its directory name (see :func:`torchrec_cnr.schema.checkpoint_id`)."""
    seq: int
    step: int
    kind: Kind
    policy: str
    chain: list[str] | None
    """Ids a restore of this checkpoint applies, baseline first; ``None`` where the
    checkpoint before it stores it (format 7, a chain longer than two: stored as
    :attr:`parent` and :attr:`depth`): :meth:`Manifest.chain` walks it."""
    parent: str | None = None
    """The link before this one in its chain (set from :attr:`chain` when stored)."""
    depth: int = 0
    """How many checkpoints its chain has (set from :attr:`chain` when stored)."""
    sizes: list[float]
    """S_1..S_i of the deltas since the baseline, for the policy that decides baselines
    from them (``intermittent``); empty for the others since format 7."""
    world_size: int
    bytes: int
    """Bytes on disk."""
    committed_at: float = field(default_factory=time.time)
    saved_at: float | None = None
    """When ``save()`` staged it (rank 0's clock, seconds since the epoch); its rows were
    trained before, a later checkpoint's after. ``None`` in checkpoints written before."""
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

    def __post_init__(self) -> None:
        if self.chain is not None:  # the stored chain names both
            object.__setattr__(self, "parent", self.chain[-2] if len(self.chain) > 1 else None)
            object.__setattr__(self, "depth", len(self.chain))

    def _summary_fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Summary)}

    def summary(self) -> Summary:
        """This checkpoint's summary alone (itself, for a summary)."""
        return Summary(**self._summary_fields()) if type(self) is not Summary else self

    def rechained(self, chain: list[str]) -> Self:
        """This checkpoint with another stored chain (a compaction landed before it)."""
        return dataclasses.replace(self, chain=chain)

    def summary_json(self) -> dict[str, Any]:
        """The JSON of the summary alone, as the manifest and history segments hold it."""
        raw = self._summary_fields()
        if self.depth > 2:  # a chain of consecutive deltas: named by its parent
            del raw["chain"]
        else:
            del raw["parent"], raw["depth"]
        if self.interval_decision is not None:
            raw["interval_decision"] = self.interval_decision.to_json()
        return raw

    @classmethod
    def _known(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """The fields of ``cls`` in the JSON ``raw``, those of a summary typed."""
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        decision = raw.get("interval_decision")
        return known | {
            "chain": raw.get("chain"),
            "interval_decision": None if decision is None else IntervalDecision.from_json(decision),
        }

    @classmethod
    def from_summary(cls, raw: dict[str, Any]) -> Summary:
        """A summary from :meth:`summary_json`."""
        return Summary(**Summary._known(raw))


@dataclass(frozen=True, kw_only=True)
class Entry(Summary):
    """One committed checkpoint, whole: its summary and the detail its record holds."""

    tables: dict[str, TableShape]
    dense: dict[str, DenseInfo]
    shards: list[ShardRecord] | None
    """Its shard records; ``None`` where the files of :attr:`shard_parts` hold them
    (format 7, read by :meth:`Manifest.shards`)."""
    dense_checksums: dict[str, int]
    app_checksums: list[int]
    """One per rank."""
    shard_parts: dict[str, str] = field(default_factory=dict)
    """Format 7: the checksums of the files of its shard records (:func:`part_path`), by
    storage rank (the part that rank wrote itself) and ``"all"`` (every rank's, written
    with the record); empty where the record holds ``shards`` (formats 1-6)."""

    @staticmethod
    def signature(
        shards: list[ShardSpec], dense: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, TableShape], dict[str, DenseInfo]]:
        """Table shapes and dense tensor infos of a model, as an entry records them."""
        return (
            {s.table: TableShape.of(s) for s in shards},
            {k: DenseInfo.of(v) for k, v in dense.items()},
        )

    def to_json(self) -> dict[str, Any]:
        raw = self.summary_json()
        raw["shard_parts"] = self.shard_parts
        raw["dense_checksums"] = self.dense_checksums
        raw["app_checksums"] = self.app_checksums
        raw["tables"] = {k: dict(v.__dict__) for k, v in self.tables.items()}
        raw["dense"] = {
            k: {"shape": list(v.shape), "dtype": v.dtype} for k, v in self.dense.items()
        }
        if not self.shard_parts:  # else each storage rank's part holds them
            raw["shards"] = [s.to_json() for s in self.shards or []]
        return raw

    @classmethod
    def from_json(cls, raw: dict[str, Any], version: int = FORMAT_VERSION) -> Entry:
        shards = raw.get("shards") if version > 1 else [_upgrade_v1(s) for s in raw["shards"]]
        parts = bool(raw.get("shard_parts")) and "shards" not in raw
        return cls(
            **cls._known(raw)
            | {
                "tables": {k: TableShape(**v) for k, v in raw["tables"].items()},
                "dense": {
                    k: DenseInfo(tuple(v["shape"]), v["dtype"]) for k, v in raw["dense"].items()
                },
                "shards": None if parts else [ShardRecord.from_json(s) for s in shards or []],
            }
        )


def record_bytes(entry: Entry) -> bytes:
    """A checkpoint's record (format 6): its whole entry."""
    return sealed_bytes({"format_version": FORMAT_VERSION, "entry": entry.to_json()})[0]


def parse_record(data: bytes, where: str, ckpt_id: str) -> Entry:
    """The entry of checkpoint ``ckpt_id``'s record.

    Raises:
        ManifestError: the record is damaged, or is another checkpoint's.
    """
    raw = open_sealed(data, where)
    try:
        with without_gc():
            entry = Entry.from_json(raw["entry"], raw["format_version"])
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{where} is malformed: {brief(e)}") from e
    if entry.id != ckpt_id:
        raise ManifestError(f"{where} is the record of {entry.id}, not of {ckpt_id}")
    return entry


@dataclass(frozen=True)
class SegmentRef:
    """A sealed history segment, as the manifest (or the next segment) names it."""

    name: str
    first_seq: int
    last_seq: int
    count: int
    """Checkpoints in it and in every segment before it."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> SegmentRef | None:
        return None if raw is None else cls(**raw)


def segment_bytes(entries: list[Summary], previous: SegmentRef | None) -> tuple[bytes, str]:
    """A history segment of ``entries``' summaries, naming the segment before it; and its
    checksum."""
    return sealed_bytes({
        "format_version": FORMAT_VERSION,
        "checkpoints": [e.summary_json() for e in entries],
        "previous": None if previous is None else previous.to_json(),
    })  # fmt: skip


def parse_segment(data: bytes, where: str) -> tuple[list[Summary], SegmentRef | None]:
    """The summaries of a history segment, and the segment before it.

    Raises:
        ManifestError: the segment is damaged.
    """
    raw = open_sealed(data, where)
    try:
        entries = [Summary.from_summary(e) for e in raw["checkpoints"]]
        return entries, SegmentRef.from_json(raw["previous"])
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{where} is malformed: {brief(e)}") from e


class ManifestRecord:
    """The parsed manifest of a checkpoint root (reading and writing it, and the parts it
    names: :class:`torchrec_cnr.manifest.store.Manifest`).

    It holds the latest checkpoints (:attr:`tail`) and names the newest sealed history
    segment (:attr:`history`), which holds the ones before; :attr:`checkpoints` is all of
    them, read from the segments on first use. A format-1-5 manifest holds them all.
    """

    def __init__(
        self,
        checkpoints: list[Summary] | None = None,
        restores: int = 0,
        writer_generation: int = 0,
        version: str | None = None,
        history: SegmentRef | None = None,
    ) -> None:
        self.tail: list[Summary] = list(checkpoints or [])
        """The latest committed checkpoints, oldest first (every one, without a history)."""
        self.history = history
        """The newest sealed history segment; ``None`` if every checkpoint is in :attr:`tail`."""
        self.restores = restores
        """Restores performed from this root."""
        self.writer_generation = writer_generation
        """The generation of the job that may commit to this root (see ``commit.lease``)."""
        self.version = version
        """The storage version it was read at; a save replaces exactly that version."""
        self._older: list[Summary] | None = None if history is not None else []
        self._index: tuple[list[Summary] | None, dict[str, Summary]] = (None, {})
        """:attr:`_older` by id, and the list it was built from."""
        self._segments: list[str] = []
        """The names of the history segments read (newest first)."""
        self._stale_segments: list[str] = []
        """Segments a replaced history named: deleted once this manifest is saved."""
        self.read_format = FORMAT_VERSION
        """The format version it was read in."""

    @property
    def checkpoints(self) -> list[Summary]:
        """Every committed checkpoint, oldest first (reads the history segments once)."""
        if self._older is None:
            self._older = self.read_history()
        return self._older + self.tail

    @checkpoints.setter
    def checkpoints(self, entries: list[Summary]) -> None:
        """Replaces every checkpoint (retention); the history is sealed again when saved."""
        if self.history is not None:
            self.checkpoints  # noqa: B018 - the names of the segments it replaces
        self._stale_segments += self._segments
        self.tail, self.history, self._older, self._segments = list(entries), None, [], []

    def read_history(self) -> list[Summary]:
        """The checkpoints of the sealed history segments, oldest first."""
        if self.history is not None:
            raise ManifestError("this manifest names history segments but was read without a root")
        return []

    def count(self) -> int:
        """How many checkpoints are committed (without reading the history)."""
        return len(self.tail) + (0 if self.history is None else self.history.count)

    @classmethod
    def parse(cls: type[_M], data: bytes, where: str) -> _M:
        """Parses manifest bytes, checking their checksum.

        Raises:
            ManifestError: the bytes are not a manifest this library reads, or are damaged.
        """
        raw = open_sealed(data, where)
        version = raw["format_version"]
        try:
            if version >= 6:
                entries: list[Summary] = [
                    Summary.from_summary(e) for e in raw.get("checkpoints", [])
                ]
            else:
                entries = [Entry.from_json(e, version) for e in raw.get("checkpoints", [])]
            manifest = cls(
                checkpoints=entries,
                restores=int(raw.get("restores", 0)),
                writer_generation=int(raw.get("writer_generation", 0)),
                history=SegmentRef.from_json(raw.get("history")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where} is malformed: {brief(e)}") from e
        manifest.read_format = version
        return manifest

    def to_bytes(self) -> bytes:
        """The manifest's bytes: the summaries of :attr:`tail` (their records are written
        by the commit, see :func:`record_bytes`)."""
        return sealed_bytes({
            "format_version": FORMAT_VERSION,
            "writer_generation": self.writer_generation,
            "restores": self.restores,
            "checkpoints": [e.summary_json() for e in self.tail],
            "history": None if self.history is None else self.history.to_json(),
        })[0]  # fmt: skip

    def latest(self) -> Summary | None:
        return self.tail[-1] if self.tail else None

    def find(self, step: int | None) -> Summary | None:
        """The newest committed checkpoint of ``step`` (the latest one if ``None``)."""
        if step is None:
            return self.latest()
        found = next((e for e in reversed(self.tail) if e.step == step), None)
        if found is None and self.history is not None:
            found = next((e for e in reversed(self.checkpoints) if e.step == step), None)
        return found

    def find_id(self, ckpt_id: str) -> Summary | None:
        """The committed checkpoint of directory ``ckpt_id``, if the manifest names it."""
        found = next((e for e in self.tail if e.id == ckpt_id), None)
        name = parse_checkpoint_id(ckpt_id)
        if found is not None or self.history is None or name is None:
            return found
        if name.seq > self.history.last_seq:
            return None  # newer than every sealed one: the tail would hold it
        self.checkpoints  # noqa: B018 - reads the history once
        if self._index[0] is not self._older:
            self._index = (self._older, {e.id: e for e in self._older or []})
        return self._index[1].get(ckpt_id)

    def by_id(self, ckpt_id: str) -> Summary:
        entry = self.find_id(ckpt_id)
        if entry is None:
            raise ManifestError(
                f"checkpoint {ckpt_id!r} is named in a chain but not in the manifest"
            )
        return entry

    def steps(self) -> list[int]:
        return [e.step for e in self.checkpoints]

    def next_seq(self) -> int:
        last = -1 if self.history is None else self.history.last_seq
        return max((e.seq for e in self.tail), default=last) + 1

    def links(self, entry: Summary) -> list[Summary]:
        """The checkpoints of ``entry``'s chain, baseline first; a chain stored by its
        parent is walked back link by link (see :attr:`Summary.chain`)."""
        walked = []
        while entry.chain is None:
            walked.append(entry)
            assert entry.parent is not None  # a stored chain of more than two
            entry = self.by_id(entry.parent)
        return [self.by_id(i) for i in entry.chain[:-1]] + [entry] + walked[::-1]

    def chain(self, entry: Summary) -> list[str]:
        """The ids of ``entry``'s chain, baseline first (see :meth:`links`)."""
        return entry.chain if entry.chain is not None else [e.id for e in self.links(entry)]

    def chain_bytes(self, entry: Summary) -> int:
        """Bytes a restore of ``entry`` reads: its chain's checkpoints."""
        return sum(e.bytes for e in self.links(entry))

    def needed_ids(self, last: int | None) -> set[str]:
        """Ids the chains of the last ``last`` checkpoints need (all if ``None``)."""
        if last is not None and last <= len(self.tail):
            entries = self.tail[-last:]
        else:
            entries = self.checkpoints if last is None else self.checkpoints[-last:]
        return {i for e in entries for i in self.chain(e)}
