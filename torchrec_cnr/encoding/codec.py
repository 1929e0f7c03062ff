"""Staged rows -> the tensors a checkpoint stores, and back.

Runs on the background writer. Embedding rows are quantized per row (Check-N-Run,
NSDI'22, Sec. 4.4) according to :class:`~torchrec_cnr.QuantizeConfig`; optimizer
state stays fp32 unless configured. The writer checksums every stored tensor.

Stored names of one shard ``key``:

- ``<key>.w``: fp32 rows, when the table is not quantized;
- ``<key>.w.<part>``: quantized rows, parts as ``QuantizedRows.to_tensors()`` names them;
- ``<key>.ids``: global row ids, absent when all rows are stored;
- ``<key>.<state>``: an optimizer state, by FBGEMM name.

:class:`ShardRecord` is what the manifest records about one stored shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from torchrec_cnr.config import QuantizeConfig
from torchrec_cnr.encoding.formats import FP32, Format
from torchrec_cnr.quantization import CAST_DTYPES, QuantizedRows, quantize
from torchrec_cnr.staging import StagedShard
from torchrec_cnr.tracking.shard import ShardSpec

__all__ = ["EncodedShard", "ShardRecord", "StateInfo", "decode_weight", "encode_shard"]

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
        )


@dataclass
class EncodedShard:
    """The stored tensors of one shard and what the manifest records about them."""

    tensors: dict[str, torch.Tensor]
    record: ShardRecord


def _check_finite(staged: StagedShard) -> None:
    """Quantized rows must be finite: names the table row of the first that is not."""
    w = staged.weight
    if w.numel() == 0 or math.isfinite(float(w.sum())):
        return  # one sum covers the usual case; NaN and Inf survive it
    bad = (~torch.isfinite(w)).any(dim=1).nonzero()
    if bad.numel():
        row = staged.global_row(int(bad[0, 0]))
        raise ValueError(f"table {staged.shard.spec.table!r} row {row} contains NaN or Inf")


def encode_shard(staged: StagedShard, fmt: Format, config: QuantizeConfig) -> EncodedShard:
    """Quantizes one staged shard (or a chunk of its rows); the writer checksums the
    stored tensors as it writes them.

    Raises:
        ValueError: a row holds NaN or Inf (the message names table and row).
    """
    key, spec = staged.key, staged.shard.spec
    tensors: dict[str, torch.Tensor] = {}
    parts: list[str] = []
    if fmt == FP32:
        tensors[f"{key}.w"] = staged.weight
    else:
        _check_finite(staged)
        q = quantize(
            staged.weight,
            fmt.method,
            fmt.bits,
            n_bins=config.n_bins,
            ratio=config.ratio,
            name=spec.table,
        )
        for part, t in q.to_tensors().items():
            tensors[f"{key}.w.{part}"] = t
            parts.append(part)
    if staged.ids is not None:
        tensors[f"{key}.ids"] = staged.ids
    cast = None if config.optimizer_state == "none" else CAST_DTYPES[config.optimizer_state]
    states = {}
    for name, value in staged.states.items():
        if cast is not None and name in _CASTABLE_STATES:
            value = value.to(cast)
        tensors[f"{key}.{name}"] = value
        layout: Literal["row", "element"] = "row" if value.dim() == 1 else "element"
        states[name] = StateInfo(f"{key}.{name}", layout, dtype_name(value))
    record = ShardRecord(
        spec=spec,
        key=key,
        saved_rows=int(staged.weight.shape[0]),
        all_rows=staged.ids is None,
        optimizer=staged.shard.optimizer,
        states=states,
        scalars=staged.scalars,
        format=fmt,
        parts=parts,
        nbytes=sum(t.numel() * t.element_size() for t in tensors.values()),
    )
    return EncodedShard(tensors, record)


def decode_weight(read: Callable[[str], torch.Tensor], rec: ShardRecord) -> torch.Tensor:
    """The ``(n, cols)`` fp32 rows of a shard record; ``read(name)`` fetches a stored tensor
    (all ``saved_rows`` rows, or any subset of them: every part is one row per row)."""
    if rec.format == FP32:
        return read(f"{rec.key}.w")
    parts = {p: read(f"{rec.key}.w.{p}") for p in rec.parts}
    shape = (next(iter(parts.values())).shape[0], rec.spec.cols)
    return QuantizedRows.from_tensors(parts, rec.format.method, rec.format.bits, shape).dequantize()
