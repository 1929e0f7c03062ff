"""Staged rows -> the tensors a checkpoint stores, and back.

Runs on the background writer. Embedding rows are quantized per row (Check-N-Run,
NSDI'22, Sec. 4.4) according to :class:`~torchrec_cnr.QuantizeConfig`; optimizer
state stays fp32 unless configured. The writer checksums every stored tensor.

Stored names of one shard ``key`` (:mod:`torchrec_cnr.snapshot.layout` spells them;
:class:`ShardRecord` knows which of them a shard has):

- ``<key>.w``: fp32 rows, when the table is not quantized;
- ``<key>.w.<part>``: quantized rows, parts as ``QuantizedRows.to_tensors()`` names them;
- ``<key>.ids``: global row ids, absent when all rows are stored;
- ``<key>.<state>``: an optimizer state, by FBGEMM name;
- ``<key>.recent``: global ids of the stored rows modified since the previous checkpoint,
  absent when every stored row was (format 4).

:class:`ShardRecord` is what the manifest records about one stored shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from torchrec_cnr.config import QuantizeConfig
from torchrec_cnr.encoding.formats import FP32, Format
from torchrec_cnr.quantization import CAST_DTYPES, QuantizedRows, quantize
from torchrec_cnr.snapshot.layout import (
    rows_path,
    stored_ids,
    stored_part,
    stored_recent,
    stored_state,
    stored_weight,
)
from torchrec_cnr.staging import StagedShard
from torchrec_cnr.tracking.shard import ShardSpec

Recent = Literal["stored", "ids", "unknown"]

__all__ = [
    "EncodedShard",
    "Recent",
    "ShardRecord",
    "StateInfo",
    "decode_weight",
    "dtype_name",
    "encode_shard",
]

# Only moments may be cast: prev_iter and row_counter are step counts kept in fp32,
# which fp16 would round beyond 2048.
_CASTABLE_STATES = ("momentum1", "momentum2")


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
    ``stored`` every one, ``ids`` those the ``<key>.recent`` tensor lists, ``unknown`` not
    recorded (format 3 and older): any row may have."""
    recent_rows: int = 0
    """How many ids the ``<key>.recent`` tensor holds (``ids`` only)."""

    @classmethod
    def build(
        cls,
        spec: ShardSpec,
        key: str,
        *,
        values: dict[str, torch.Tensor],
        states: dict[str, torch.Tensor],
        ids: torch.Tensor | None,
        optimizer: str,
        scalars: dict[str, float],
        fmt: Format,
        recent: torch.Tensor | None | Literal["unknown"] = None,
    ) -> tuple[ShardRecord, dict[str, torch.Tensor]]:
        """The record of a shard stored under ``key`` and its tensors by stored name.

        Args:
            values: ``{"": rows}`` for fp32 or a cast, else the quantized parts by name.
            states: optimizer states by FBGEMM name, each ``(n,)`` or ``(n, cols)``.
            ids: ``(n,)`` global row ids; ``None`` when every row of the shard is stored.
            recent: ``(k,)`` global ids of the stored rows that changed since the previous
                checkpoint; ``None`` when every stored row did; ``"unknown"``.
        """
        parts = [] if fmt == FP32 else list(values)
        tensors = {
            (cls.weight_name(key) if fmt == FP32 else cls.part_name(key, p)): t
            for p, t in values.items()
        }
        if ids is not None:
            tensors[cls.ids_name(key)] = ids
        if isinstance(recent, torch.Tensor):
            tensors[stored_recent(key)] = recent
        infos = {}
        for name, value in states.items():
            stored = stored_state(key, name)
            tensors[stored] = value
            layout: Literal["row", "element"] = "row" if value.dim() == 1 else "element"
            infos[name] = StateInfo(stored, layout, dtype_name(value))
        record = cls(
            spec=spec,
            key=key,
            saved_rows=int(next(iter(values.values())).shape[0]) if values else 0,
            all_rows=ids is None,
            optimizer=optimizer,
            states=infos,
            scalars=dict(scalars),
            format=fmt,
            parts=parts,
            nbytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            recent="unknown" if isinstance(recent, str) else "stored" if recent is None else "ids",
            recent_rows=int(recent.numel()) if isinstance(recent, torch.Tensor) else 0,
        )
        return record, tensors

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

    def take_checksums(self, checksums: dict[str, int]) -> None:
        """Keeps the CRC32s of this record's tensors out of a writer's ``logical path ->
        CRC32`` (the record's tensors are under its storage rank's ``rows`` folder)."""
        prefix = rows_path(self.spec.rank, "")
        own = f"{prefix}{self.key}."
        self.checksums = {
            logical.removeprefix(prefix): crc
            for logical, crc in checksums.items()
            if logical.startswith(own)
        }

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
        )


@dataclass
class EncodedShard:
    """The stored tensors of one shard and what the manifest records about them."""

    tensors: dict[str, torch.Tensor]
    record: ShardRecord


def encode_shard(
    staged: StagedShard, fmt: Format, config: QuantizeConfig, compiled: bool = True
) -> EncodedShard:
    """Quantizes one staged shard (or a chunk of its rows); the writer checksums the
    stored tensors as it writes them. ``compiled``: ``IOOptions.compiled_search``.

    Raises:
        ValueError: a row holds NaN or Inf (the message names table and row).
    """
    key, spec = staged.key, staged.shard.spec
    if fmt == FP32:
        values = {"": staged.weight}
    else:
        q = quantize(
            staged.weight,
            fmt.method,
            fmt.bits,
            n_bins=config.n_bins,
            ratio=config.ratio,
            name=spec.table,
            row_ids=staged.global_rows(),
            compiled=compiled,
        )
        values = q.to_tensors()
    cast = None if config.optimizer_state == "none" else CAST_DTYPES[config.optimizer_state]
    states = {
        name: value.to(cast) if cast is not None and name in _CASTABLE_STATES else value
        for name, value in staged.states.items()
    }
    record, tensors = ShardRecord.build(
        spec,
        key,
        values=values,
        states=states,
        ids=staged.ids,
        optimizer=staged.shard.optimizer,
        scalars=staged.scalars,
        fmt=fmt,
        recent=staged.recent,
    )
    return EncodedShard(tensors, record)


def decode_weight(read: Callable[[str], torch.Tensor], rec: ShardRecord) -> torch.Tensor:
    """The ``(n, cols)`` fp32 rows of a shard record; ``read(name)`` fetches a stored tensor
    (all ``saved_rows`` rows, or any subset of them: every part is one row per row)."""
    if rec.format == FP32:
        return read(rec.weight_name(rec.key))
    parts = {p: read(rec.part_name(rec.key, p)) for p in rec.parts}
    shape = (next(iter(parts.values())).shape[0], rec.spec.cols)
    return QuantizedRows.from_tensors(parts, rec.format.method, rec.format.bits, shape).dequantize()
