"""A read-only view of a root's committed checkpoints: steps, kinds, chains, bytes, tables.

This is the public way to look into a root without a model or a process group; the
manifest it is read from (:mod:`torchrec_cnr.manifest`) stays internal, so its
format can change without breaking callers.

Example::

    for ckpt in torchrec_cnr.list_checkpoints("/ckpt/run1"):
        print(ckpt.step, ckpt.kind, ckpt.chain, ckpt.bytes, ckpt.saved_fraction)
    latest = torchrec_cnr.checkpoint_info("s3://bucket/run1")
    print(latest.tables["sparse.ebc.t_user"].bits)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from torchrec_cnr.manifest import Manifest, Summary, saved_fraction
from torchrec_cnr.schema import ShardRecord
from torchrec_cnr.storage import as_storage
from torchrec_cnr.storage.root import Root

__all__ = [
    "CheckpointInfo",
    "RootInfo",
    "TableInfo",
    "changed_rows",
    "checkpoint_info",
    "list_checkpoints",
    "root_info",
    "saved_rows",
]


@dataclass(frozen=True)
class TableInfo:
    """One table as a checkpoint stores it."""

    name: str
    """Qualified name, e.g. ``sparse.ebc.t_user``."""
    num_embeddings: int
    embedding_dim: int
    state_dict_key: str
    """Its key in the unsharded module's ``state_dict()`` ("" before format 3)."""
    rows_saved: int
    """Rows of the table this checkpoint stores (a row split over column shards counts
    once)."""
    shards: int
    nbytes: int
    """Bytes of its stored tensors: values, ids and optimizer state."""
    method: str
    """``none`` (fp32), ``fp16``, ``bf16`` or a quantizer such as ``adaptive``."""
    bits: int
    """Stored bits per value: 32 for fp32, 16 for casts, 2/3/4/8 for quantizers."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint of a root."""

    id: str
    """Its directory under the root."""
    step: int
    kind: str
    """``full`` or ``delta``."""
    policy: str
    chain: tuple[int, ...]
    """Steps of the checkpoints a restore of this one reads, baseline first."""
    world_size: int
    bytes: int
    """Bytes it takes on storage."""
    restore_bytes: int
    """Bytes a restore of it reads: its whole chain."""
    staged_bytes: int
    """Bytes staged in host memory on rank 0 while training was blocked."""
    stall_s: float
    """Longest time any rank's training was blocked by this save."""
    committed_at: float
    """When it was committed (seconds since the epoch)."""
    saved_at: float | None
    """When ``save()`` staged it; ``None`` in checkpoints written before this was recorded."""
    saved_fraction: float
    """Elements stored, as a fraction of every table's elements (Check-N-Run's S_i)."""
    rows_saved: int
    """Table rows this checkpoint stores, over every table (a row split over column shards
    counts once)."""
    rows_changed: int | None
    """Table rows changed since the checkpoint before it (``since``): what a serving follower
    reads to catch up by one checkpoint; ``None`` when not recorded (format 3 and older)."""
    since: str | None
    """The id of the checkpoint ``rows_changed`` counts from (``None``: the job's first)."""
    compacted_from: str | None
    """For a compacted checkpoint, the checkpoint whose chain it merges."""
    tables: dict[str, TableInfo]
    dense: dict[str, tuple[int, ...]]
    """The shape of each dense tensor (parameters, buffers, data-parallel tables)."""


def _table_rows(rec: ShardRecord, shard_rows: int) -> float:
    # A column-wise shard holds a part of each of its rows: a row split over shards
    # counts once, as the table's.
    return shard_rows * rec.spec.cols / rec.spec.embedding_dim


def saved_rows(shards: list[ShardRecord]) -> int:
    """Table rows these shard records store (a row split over column shards counts once)."""
    return round(sum(_table_rows(rec, rec.saved_rows) for rec in shards))


def changed_rows(shards: list[ShardRecord]) -> int | None:
    """Table rows of a checkpoint's ``shards`` that changed since the checkpoint it
    records as ``since`` (a row split over column shards counts once); ``None`` if not
    recorded."""
    total = 0.0
    for rec in shards:
        if rec.recent == "unknown":
            return None
        total += _table_rows(rec, rec.saved_rows if rec.recent == "stored" else rec.recent_rows)
    return round(total)


def _info(manifest: Manifest, summary: Summary) -> CheckpointInfo:
    entry, shards = manifest.record(summary), manifest.shards(summary)
    by_table = defaultdict(list)
    for rec in shards:
        by_table[rec.spec.table].append(rec)
    tables = {}
    for name, shape in entry.tables.items():
        recs = by_table.get(name, [])
        fmt = recs[0].format if recs else None
        tables[name] = TableInfo(
            name=name,
            num_embeddings=shape.num_embeddings,
            embedding_dim=shape.embedding_dim,
            state_dict_key=shape.state_dict_key,
            rows_saved=saved_rows(recs),
            shards=len(recs),
            nbytes=sum(r.nbytes for r in recs),
            method=fmt.method if fmt else "none",
            bits=fmt.bits if fmt else 32,
        )
    return CheckpointInfo(
        id=entry.id,
        step=entry.step,
        kind=entry.kind,
        policy=entry.policy,
        chain=tuple(link.step for link in manifest.links(entry)),
        world_size=entry.world_size,
        bytes=entry.bytes,
        restore_bytes=manifest.chain_bytes(entry),
        staged_bytes=entry.staged_bytes,
        stall_s=entry.stall_s,
        committed_at=entry.committed_at,
        saved_at=entry.saved_at,
        saved_fraction=saved_fraction(shards),
        rows_saved=saved_rows(shards),
        rows_changed=changed_rows(shards),
        since=entry.since,
        compacted_from=entry.compacted_from,
        tables=tables,
        dense={name: info.shape for name, info in entry.dense.items()},
    )


@dataclass(frozen=True)
class RootInfo:
    """A root's committed checkpoints and what the root records besides."""

    checkpoints: list[CheckpointInfo]
    """Oldest first."""
    restores: int
    """Restores performed from this root (they compound quantization error)."""
    writer_generation: int
    """The generation of the job that may commit to it (see the docs on one writer per root)."""

    @property
    def latest(self) -> CheckpointInfo | None:
        return self.checkpoints[-1] if self.checkpoints else None


def root_info(root: Root) -> RootInfo:
    """What ``root`` holds; no checkpoint for a fresh root.

    Args:
        root: a path, an ``s3://bucket/prefix`` URL or a ``Storage``.

    Raises:
        ManifestError: the manifest is damaged.
    """
    manifest = Manifest.load(as_storage(root))
    return RootInfo(
        [_info(manifest, e) for e in manifest.checkpoints],
        manifest.restores,
        manifest.writer_generation,
    )


def list_checkpoints(root: Root) -> list[CheckpointInfo]:
    """Every committed checkpoint of ``root``, oldest first; ``[]`` for a fresh root.

    Raises:
        ManifestError: the manifest is damaged.
    """
    return root_info(root).checkpoints


def checkpoint_info(root: Root, step: int | None = None) -> CheckpointInfo:
    """The committed checkpoint of ``step`` (the latest if ``None``).

    Raises:
        ValueError: no committed checkpoint has ``step``, or the root has none.
        ManifestError: the manifest is damaged.
    """
    manifest = Manifest.load(as_storage(root))
    entry = manifest.find(step)
    if entry is None:
        raise ValueError(
            f"no committed checkpoint of step {step} in {as_storage(root).url}; "
            f"committed steps: {manifest.steps()}"
        )
    return _info(manifest, entry)
