"""The on-disk contract, in one place: every type a root persists and every name in it.

A root holds the manifest (``manifest.json``: the root's index, and the previous
committed one), sealed history segments, the writer's lease (``lease.json``) and one
torchsnapshot snapshot per checkpoint, with that checkpoint's record::

    ROOT/manifest.json
    ROOT/manifest.json.prev
    ROOT/history-000000-000011-<digest>.json
    ROOT/lease.json
    ROOT/000000-step0000000500-g0001/
        checkpoint.json       the checkpoint's record (format 6)
        shards.json           every rank's shard records (format 7)
        shards-<rank>.json    a rank's shard records, written by that rank (format 7)
        <rank>/rows/<name>    a shard's stored tensors (names: stored_weight, ...)
        dense/<name>          replicated tensors, written once (read as 0/dense/<name>)
        <rank>/app/blob       the rank's app_state, serialized

Each committed checkpoint is an ``Entry`` (:mod:`torchrec_cnr.manifest.records`): its
summary (step, kind, chain, sizes, bytes, CPR's interval decision:
:class:`IntervalDecision`) and its detail: the sharding of each table (:class:`ShardSpec`),
what each stored shard holds (:class:`ShardRecord`: format, optimizer states, checksums)
and the checksums of its dense tensors and ``app_state``. Since format 6 the detail lives
in the checkpoint's own record, and the manifest holds the summaries of the latest
checkpoints and names the newest sealed history segment, which holds older summaries and
names the segment before it: a commit reads and writes a bounded number of bytes whatever
the history. Formats 1-5 kept every entry, whole, in the manifest. Each checkpoint
directory also has torchsnapshot's index (:mod:`torchrec_cnr.snapshot.index`).

Each type is a dataclass with ``to_json``/``from_json`` (or bytes for the lease); the
manifest's own records are :mod:`torchrec_cnr.manifest.records`', in the sealed JSON of
:func:`sealed_bytes`. Nothing outside these two modules reads or writes the JSON. Reading
and writing the files themselves is :mod:`torchrec_cnr.manifest.store`'s (the manifest,
records, segments), :mod:`torchrec_cnr.commit`'s (the lease) and
:mod:`torchrec_cnr.snapshot`'s (the tensors). The manifest carries ``format_version``;
every older version still reads.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from torchrec_cnr.errors import ManifestError, brief

__all__ = [
    "FORMAT_VERSION",
    "FP32",
    "LEASE_NAME",
    "MANIFEST_NAME",
    "PREVIOUS_MANIFEST_NAME",
    "RECORD_NAME",
    "SNAPSHOT_MARKER",
    "CheckpointName",
    "Format",
    "LeaseHolder",
    "IntervalDecision",
    "Kind",
    "Recent",
    "ShardRecord",
    "ShardSpec",
    "StateInfo",
    "app_path",
    "checkpoint_id",
    "dense_path",
    "dtype_name",
    "open_sealed",
    "sealed_bytes",
    "without_gc",
    "parse_checkpoint_id",
    "parse_part",
    "part_bytes",
    "part_path",
    "record_path",
    "segment_name",
    "rows_path",
    "shard_key",
    "stored_ids",
    "stored_part",
    "stored_recent",
    "stored_state",
    "stored_weight",
]

Kind = Literal["full", "delta"]
"""A checkpoint holds every row (``full``) or some (``delta``)."""

# -- names in a root ----------------------------------------------------------------

MANIFEST_NAME = "manifest.json"
PREVIOUS_MANIFEST_NAME = "manifest.json.prev"
LEASE_NAME = "lease.json"
RECORD_NAME = "checkpoint.json"
"""A checkpoint's record, in its directory (format 6)."""
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


def record_path(ckpt_id: str) -> str:
    """Name of checkpoint ``ckpt_id``'s record."""
    return f"{ckpt_id}/{RECORD_NAME}"


def part_path(ckpt_id: str, rank: int | None) -> str:
    """Name of the shard records of storage rank ``rank`` of checkpoint ``ckpt_id``, or of
    every rank if ``None`` (format 7)."""
    return f"{ckpt_id}/shards.json" if rank is None else f"{ckpt_id}/shards-{rank}.json"


def segment_name(first_seq: int, last_seq: int, digest: str) -> str:
    """Name of a sealed history segment holding checkpoints ``first_seq..last_seq``; a
    rewritten one (retention) differs in ``digest``, so a name is never written twice."""
    return f"history-{first_seq:06d}-{last_seq:06d}-{digest.removeprefix('sha256:')[:16]}.json"


def shard_key(i: int) -> str:
    """The name of a rank's ``i``-th shard inside its checkpoint (and of its buffers)."""
    return f"s{i}"


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


# -- one stored shard ----------------------------------------------------------------


@dataclass(frozen=True)
class ShardSpec:
    """Where one table shard lives; the unit the manifest describes."""

    table: str
    """Fully qualified table name, e.g. ``sparse_arch.ebc.t_user``."""
    rank: int
    """Rank holding the shard."""
    sharding: str
    """TorchRec sharding type, e.g. ``table_wise``."""
    row_offset: int
    """First global row of the shard."""
    col_offset: int
    """First global column of the shard."""
    rows: int
    """Rows in the shard."""
    cols: int
    """Columns in the shard."""
    num_embeddings: int
    """Rows of the whole table."""
    embedding_dim: int
    """Columns of the whole table."""
    state_dict_key: str = ""
    """The table's key in the *unsharded* module's ``state_dict()``, e.g.
    ``sparse.ebc.embedding_bags.t0.weight`` ("" in checkpoints older than format 3)."""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ShardSpec:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


@dataclass(frozen=True)
class Format:
    """How one table's rows are stored."""

    method: str
    bits: int


FP32 = Format("none", 32)


Recent = Literal["stored", "ids", "tail", "unknown"]


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class StateInfo:
    """One stored optimizer state of a shard."""

    tensor: str
    """Its stored name."""
    layout: Literal["row", "element"] | None
    """``row``: ``(rows,)``; ``element``: ``(rows, cols)``; ``None`` when not recorded (format 1)."""
    dtype: str
    """Stored dtype, e.g. ``float32``; ``unknown`` when not recorded (format 1)."""


@dataclass
class ShardRecord:
    """What the manifest records about one stored shard."""

    spec: ShardSpec
    key: str
    """Prefix of the shard's stored tensor names."""
    saved_rows: int
    all_rows: bool
    """True when every row is stored (no ids tensor)."""
    optimizer: str
    """The fused optimizer, or ``dense`` for a kernel the user's dense optimizer trains."""
    states: dict[str, StateInfo]
    scalars: dict[str, float]
    """The kernel's step counters at the checkpoint's step."""
    format: Format
    parts: list[str]
    """Names of the quantized parts (empty for fp32)."""
    nbytes: int
    checksums: dict[str, int] = field(default_factory=dict)
    """Stored name -> CRC32."""
    recent: Recent = "unknown"
    """Which stored rows changed since the previous checkpoint (the entry's ``since``):
    ``stored`` every one; ``ids`` those the ``<key>.recent`` tensor lists (ascending),
    stored anywhere among the others; ``tail`` likewise, stored last: the last
    ``recent_rows`` stored rows, ascending, after the others, ascending (format 5, a
    cumulative delta); ``unknown`` not recorded (format 3 and older): any row may have."""
    recent_rows: int = 0
    """How many ids the ``<key>.recent`` tensor holds (``ids`` and ``tail``)."""
    block_checksums: dict[str, list[int]] = field(default_factory=dict)
    """Stored name -> ``[rows per block, CRC32 of each block...]`` for a tensor stored in
    several blocks of rows (each data object's rows cut in blocks of that many from its
    first, see ``snapshot.writer.BLOCK_BYTES``), in row order; empty in roots written
    before they were recorded. A restore onto another sharding reads and checks only the
    blocks its rows lie in."""

    weight_name = staticmethod(stored_weight)
    part_name = staticmethod(stored_part)
    ids_name = staticmethod(stored_ids)

    @property
    def recent_name(self) -> str:
        return stored_recent(self.key)

    @property
    def value_names(self) -> list[str]:
        """The stored tensors that hold the rows' values: one, or one per quantized part."""
        if self.format == FP32:
            return [self.weight_name(self.key)]
        return [self.part_name(self.key, p) for p in self.parts]

    @property
    def row_names(self) -> list[str]:
        """Every stored tensor with one entry per saved row: values, then states (not ids)."""
        return self.value_names + [info.tensor for info in self.states.values()]

    def take_checksums(
        self, checksums: dict[str, int], blocks: dict[str, list[int]] | None = None
    ) -> None:
        """Keeps the CRC32s of this record's tensors out of a writer's ``logical path ->
        CRC32`` (the record's tensors are under its storage rank's ``rows`` folder), and
        of their blocks out of ``blocks`` (see :attr:`block_checksums`)."""
        prefix = rows_path(self.spec.rank, "")
        own = f"{prefix}{self.key}."

        def mine(by_path: Mapping[str, Any]) -> dict[str, Any]:
            return {p.removeprefix(prefix): v for p, v in by_path.items() if p.startswith(own)}

        self.checksums = mine(checksums)
        self.block_checksums = mine(blocks or {})

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_json(),
            "key": self.key,
            "saved_rows": self.saved_rows,
            "all_rows": self.all_rows,
            "optimizer": self.optimizer,
            "states": {n: dict(s.__dict__) for n, s in self.states.items()},
            "scalars": self.scalars,
            "format": {"method": self.format.method, "bits": self.format.bits, "parts": self.parts},
            "nbytes": self.nbytes,
            "checksums": self.checksums,
            "recent": self.recent,
            "recent_rows": self.recent_rows,
            **({"block_checksums": self.block_checksums} if self.block_checksums else {}),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ShardRecord:
        fmt = raw["format"]
        return cls(
            spec=ShardSpec.from_json(raw["spec"]),
            key=raw["key"],
            saved_rows=int(raw["saved_rows"]),
            all_rows=bool(raw["all_rows"]),
            optimizer=raw["optimizer"],
            states={n: StateInfo(**s) for n, s in raw["states"].items()},
            scalars=dict(raw.get("scalars", {})),
            format=Format(fmt["method"], int(fmt["bits"])),
            parts=list(fmt.get("parts", [])),
            nbytes=int(raw["nbytes"]),
            checksums={k: int(v) for k, v in raw["checksums"].items()},
            recent=raw.get("recent", "unknown"),
            recent_rows=int(raw.get("recent_rows", 0)),
            block_checksums={
                k: [int(c) for c in v] for k, v in raw.get("block_checksums", {}).items()
            },
        )


# -- CPR's interval decision -------------------------------------------------------------


@dataclass(frozen=True)
class IntervalDecision:
    """The recovery mode and interval chosen, with the numbers behind the choice."""

    mode: str
    """``partial`` or ``full``."""
    interval_s: float
    """Seconds between checkpoints in the chosen mode."""
    partial_interval_s: float
    full_interval_s: float
    partial_overhead: float
    """Expected fraction of training time lost with partial recovery."""
    full_overhead: float
    """Expected fraction of training time lost with full recovery at Young's interval."""
    pls: float
    """Expected PLS of the partial interval (equals the target)."""
    step_s: float = 0.0
    """Measured seconds per training step."""
    interval_steps: int = 0
    """``interval_s`` in steps: the interval a job applies."""

    def to_json(self) -> dict[str, float | str]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> IntervalDecision:
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})


# -- the sealed JSON of the manifest, records, parts and segments ----------------------

FORMAT_VERSION = 7
"""2: optimizer states by FBGEMM name with layout and dtype, and the kernels' step counters.
3: a checksum of the manifest itself, the writer generation that may commit, each table's key
in the unsharded module's state dict, and compacted checkpoints (``compacted_from``).
4: which rows changed since the previous checkpoint (``Entry.since``, ``ShardRecord.recent``
and a ``<key>.recent`` tensor), so that a serving follower reads only those.
5: a cumulative delta stores those rows last (``ShardRecord.recent == "tail"``), so that a
follower one checkpoint behind reads them in one run, whatever their ids.
6: each checkpoint's detail in its own record (``<id>/checkpoint.json``); the manifest holds
the latest checkpoints' summaries and names the newest sealed history segment.
7: a chain longer than two (consecutive deltas) is stored as its last link's predecessor
and its length (``parent``, ``depth``), not listed whole; ``sizes`` only where the policy
decides from them (intermittent). The shard records leave the record: every rank's in
``shards.json`` (rank 0, with the record), and each rank's in ``shards-<rank>.json``,
written by that rank, which is all a restore onto the same sharding reads."""


def _checksum(payload: dict[str, Any]) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def sealed_bytes(payload: dict[str, Any]) -> tuple[bytes, str]:
    """``payload`` as JSON with its checksum added (``checksum``: the SHA-256 of the
    canonical JSON of the rest), serialized once; and that checksum."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    digest = "sha256:" + hashlib.sha256(canonical).hexdigest()
    return canonical[:-1] + b',"checksum":"' + digest.encode() + b'"}', digest


def open_sealed(data: bytes, where: str, expect: str | None = None) -> dict[str, Any]:
    """The JSON object of :func:`sealed_bytes`' bytes, its checksum checked (and, with
    ``expect``, that it is that one) and removed.

    Raises:
        ManifestError: not JSON, not of a format version this library reads, or damaged.
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
        if expect is not None and recorded != expect:
            raise ManifestError(f"{where} is not the file its checkpoint's record names")
    return raw


@contextlib.contextmanager
def without_gc() -> Iterator[None]:
    """Builds or parses many small objects (a checkpoint's shard records) without Python's
    cyclic garbage collector (left off if it was): each full collection walks every live
    object, and making many long-lived objects triggers them, so with it a commit's cost
    per shard grows with its shards (``benchmarks.shards``). Shard records hold no cycles
    to collect."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def part_bytes(ckpt_id: str, rank: int | None, shards: list[ShardRecord]) -> tuple[bytes, str]:
    """The part of storage rank ``rank`` of a checkpoint (its shard records; every rank's
    if ``None``), and its checksum (which the checkpoint's record names)."""
    return sealed_bytes({
        "format_version": FORMAT_VERSION,
        "checkpoint": ckpt_id,
        "rank": rank,
        "shards": [s.to_json() for s in shards],
    })  # fmt: skip


def parse_part(data: bytes, where: str, checksum: str) -> list[ShardRecord]:
    """The shard records of a part whose checksum the record names ``checksum``.

    Raises:
        ManifestError: the part is damaged, or another than the one the record names.
    """
    raw = open_sealed(data, where, expect=checksum)
    try:
        with without_gc():
            return [ShardRecord.from_json(s) for s in raw["shards"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{where} is malformed: {brief(e)}") from e


# -- the writer's lease -----------------------------------------------------------------


@dataclass
class LeaseHolder:
    """The job that holds (or held) a root, as ``lease.json`` records it (whether it still
    counts is the lease's rule: :func:`torchrec_cnr.commit.lease.holder_gone`)."""

    generation: int
    run_id: str
    """torchrun's ``TORCHELASTIC_RUN_ID``, shared by the restarts of one job ("" without torchrun)."""
    host: str
    pid: int
    """Rank 0's process id."""
    started_at: float
    heartbeat_at: float
    released: bool = False

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at))
        return f"generation {self.generation} (host {self.host}, pid {self.pid}, started {started})"

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LeaseHolder:
        return cls(**json.loads(data))
