"""Staged rows -> the tensors a checkpoint stores, and back.

Runs on the background writer. Embedding rows are quantized per row (Check-N-Run,
NSDI'22, Sec. 4.4) according to :class:`~torchrec_cnr.QuantizeConfig`; optimizer
state stays fp32 unless configured. The writer checksums every stored tensor.

Stored names of one shard ``key`` (:mod:`torchrec_cnr.schema` spells them;
:class:`ShardRecord` knows which of them a shard has):

- ``<key>.w``: fp32 rows, when the table is not quantized;
- ``<key>.w.<part>``: quantized rows, parts as ``QuantizedRows.to_tensors()`` names them;
- ``<key>.ids``: global row ids in stored order, absent when all rows are stored; a
  cumulative delta stores the rows modified since the previous checkpoint last (format
  5), so its ids are two ascending runs;
- ``<key>.<state>``: an optimizer state, by FBGEMM name;
- ``<key>.recent``: global ids of the stored rows modified since the previous checkpoint,
  absent when every stored row was (format 4).

:class:`~torchrec_cnr.schema.ShardRecord` is what the manifest records about one stored
shard (:func:`build_record` makes it from a :class:`ShardContent`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from torchrec_cnr.config import QuantizeConfig
from torchrec_cnr.quantization import CAST_DTYPES, QuantizedRows, quantize
from torchrec_cnr.schema import (
    FP32,
    Format,
    ShardRecord,
    ShardSpec,
    StateInfo,
    dtype_name,
    stored_ids,
    stored_part,
    stored_recent,
    stored_state,
    stored_weight,
)
from torchrec_cnr.staging import StagedShard

__all__ = ["EncodedShard", "ShardContent", "build_record", "decode_weight", "encode_shard"]

# Only moments may be cast: prev_iter and row_counter are step counts kept in fp32,
# which fp16 would round beyond 2048.
_CASTABLE_STATES = ("momentum1", "momentum2")


@dataclass(frozen=True)
class ShardContent:
    """What one shard stores, before it has stored names: :func:`build_record` names
    its tensors and records it."""

    values: dict[str, torch.Tensor]
    """``{"": rows}`` for fp32 or a cast, else the quantized parts by name, each one row
    per stored row."""
    fmt: Format
    """The format ``values`` are in."""
    optimizer: str
    """The fused optimizer, or ``dense`` (see :attr:`ShardRecord.optimizer`)."""
    states: dict[str, torch.Tensor]
    """Optimizer states by FBGEMM name, each ``(n,)`` or ``(n, cols)``."""
    scalars: dict[str, float]
    """The kernel's step counters."""
    ids: torch.Tensor | None = None
    """``(n,)`` global row ids; ``None`` when every row of the shard is stored."""
    recent: torch.Tensor | None | Literal["unknown"] = None
    """``(k,)`` global ids of the stored rows that changed since the previous checkpoint;
    ``None`` when every stored row did; ``"unknown"``."""
    tail: bool = False
    """The last ``len(recent)`` stored rows are those (a ``tail`` record)."""


def build_record(
    spec: ShardSpec, key: str, content: ShardContent
) -> tuple[ShardRecord, dict[str, torch.Tensor]]:
    """The manifest record of a shard stored under ``key``, and its tensors by stored name."""
    c = content
    fp32 = c.fmt == FP32
    tensors = {
        (stored_weight(key) if fp32 else stored_part(key, p)): t for p, t in c.values.items()
    }
    if c.ids is not None:
        tensors[stored_ids(key)] = c.ids
    if isinstance(c.recent, torch.Tensor):
        tensors[stored_recent(key)] = c.recent
    infos = {}
    for name, value in c.states.items():
        stored = stored_state(key, name)
        tensors[stored] = value
        layout: Literal["row", "element"] = "row" if value.dim() == 1 else "element"
        infos[name] = StateInfo(stored, layout, dtype_name(value))
    record = ShardRecord(
        spec=spec,
        key=key,
        saved_rows=int(next(iter(c.values.values())).shape[0]) if c.values else 0,
        all_rows=c.ids is None,
        optimizer=c.optimizer,
        states=infos,
        scalars=dict(c.scalars),
        format=c.fmt,
        parts=[] if fp32 else list(c.values),
        nbytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        recent=(
            "unknown"
            if isinstance(c.recent, str)
            else "stored"
            if c.recent is None
            else "tail"
            if c.tail
            else "ids"
        ),
        recent_rows=int(c.recent.numel()) if isinstance(c.recent, torch.Tensor) else 0,
    )
    return record, tensors


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
    content = ShardContent(
        values,
        fmt,
        staged.shard.optimizer,
        states,
        staged.scalars,
        ids=staged.ids,
        recent=staged.recent_ids(),
        tail=staged.tail,
    )
    record, tensors = build_record(spec, key, content)
    return EncodedShard(tensors, record)


def decode_weight(read: Callable[[str], torch.Tensor], rec: ShardRecord) -> torch.Tensor:
    """The ``(n, cols)`` fp32 rows of a shard record; ``read(name)`` fetches a stored tensor
    (all ``saved_rows`` rows, or any subset of them: every part is one row per row)."""
    if rec.format == FP32:
        return read(rec.weight_name(rec.key))
    parts = {p: read(rec.part_name(rec.key, p)) for p in rec.parts}
    shape = (next(iter(parts.values())).shape[0], rec.spec.cols)
    return QuantizedRows.from_tensors(parts, rec.format.method, rec.format.bits, shape).dequantize()
