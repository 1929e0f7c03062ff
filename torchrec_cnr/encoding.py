"""Encoding: staged rows -> the tensors a checkpoint stores, and back.

Runs on the background writer. Embedding rows are quantized per row according
to :class:`~torchrec_cnr.config.QuantizeConfig`; optimizer state stays fp32
unless configured; every stored tensor gets a checksum.

Stored names of one shard ``key``:

- ``<key>.w``: fp32 rows, when the table is not quantized;
- ``<key>.w.<part>``: quantized rows, parts as ``QuantizedRows.to_tensors()`` names them;
- ``<key>.ids``: global row ids, absent when all rows are stored;
- ``<key>.<state>``: per-row optimizer state.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from torchrec_cnr.config import QuantizeConfig, parse_table_override
from torchrec_cnr.integrity import crc32
from torchrec_cnr.quantization import QuantizedRows, quantize, select_bits
from torchrec_cnr.staging import StagedShard

_STATE_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
# Only moments may be cast: prev_iter and row_counter are step counts kept in fp32,
# which fp16 would round beyond 2048.
_CASTABLE_STATES = ("momentum1", "momentum2")


@dataclass(frozen=True)
class Format:
    """How one table's rows are stored."""

    method: str
    bits: int

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "bits": self.bits}


FP32 = Format("none", 32)


class FormatResolver:
    """Chooses each table's storage format from the config and the restores so far.

    Args:
        config: the quantization settings.
        restores: restores recorded in the manifest; once they exceed
            ``expected_restores``, ``bits="auto"`` falls back to 8 bits.
    """

    def __init__(self, config: QuantizeConfig, restores: int) -> None:
        self.config = config
        self.restores = restores
        self._warned = False

    def _auto_bits(self) -> int:
        if self.restores > self.config.expected_restores:
            if not self._warned:
                warnings.warn(
                    f"{self.restores} restores exceed quantize.expected_restores="
                    f"{self.config.expected_restores}; checkpoints now use 8 bits",
                    stacklevel=3,
                )
                self._warned = True
            return 8
        pairs = [(p[0], p[1]) for p in self.config.thresholds]
        return select_bits(self.config.expected_restores, pairs)

    def resolve(self, table: str, num_rows: int) -> Format:
        """The format of ``table`` (qualified name), which has ``num_rows`` rows in all."""
        short = table.rsplit(".", 1)[-1]
        override = self.config.tables.get(table, self.config.tables.get(short))
        if override is not None:
            method, bits = parse_table_override(override)
        elif num_rows < self.config.min_rows:
            return FP32
        else:
            method, bits = self.config.method, self.config.bits
        if method == "none":
            return FP32
        if method in ("fp16", "bf16"):
            return Format(method, 16)
        return Format(method, self._auto_bits() if bits == "auto" else int(bits))


@dataclass
class EncodedShard:
    """The stored tensors of one shard and what the manifest records about them."""

    tensors: dict[str, torch.Tensor]
    record: dict[str, Any]


def encode_shard(staged: StagedShard, fmt: Format, config: QuantizeConfig) -> EncodedShard:
    """Quantizes and checksums one staged shard.

    Raises:
        ValueError: a row holds NaN or Inf (the message names table and row).
    """
    key, spec = staged.key, staged.shard.spec
    tensors: dict[str, torch.Tensor] = {}
    parts: list[str] = []
    if fmt == FP32:
        tensors[f"{key}.w"] = staged.weight
    else:
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
    cast = _STATE_DTYPES[config.optimizer_state]
    states = {}
    for name, value in staged.states.items():
        if cast is not None and name in _CASTABLE_STATES:
            value = value.to(cast)
        tensors[f"{key}.{name}"] = value
        states[name] = {
            "tensor": f"{key}.{name}",
            "layout": "row" if value.dim() == 1 else "element",
            "dtype": str(value.dtype).removeprefix("torch."),
        }
    record = {
        "spec": spec.to_json(),
        "key": key,
        "saved_rows": int(staged.weight.shape[0]),
        "all_rows": staged.ids is None,
        "states": states,
        "scalars": staged.scalars,
        "optimizer": staged.shard.optimizer,
        "format": fmt.to_json() | {"parts": parts},
        "nbytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "checksums": {name: crc32(t) for name, t in tensors.items()},
    }
    return EncodedShard(tensors, record)


def decode_weight(read: Any, rec: dict[str, Any]) -> torch.Tensor:
    """The ``(saved_rows, cols)`` fp32 rows of a shard record; ``read(name)`` fetches a tensor."""
    key, fmt = rec["key"], rec["format"]
    if fmt["method"] == "none":
        return read(f"{key}.w")
    parts = {p: read(f"{key}.w.{p}") for p in fmt["parts"]}
    shape = (rec["saved_rows"], rec["spec"]["cols"])
    return QuantizedRows.from_tensors(parts, fmt["method"], fmt["bits"], shape).dequantize()
