"""Staging: copy what a checkpoint needs out of the live model into host memory.

After :func:`stage` returns, training may modify the model freely; the staged
tensors are the checkpoint.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrec_cnr.manifest import ShardRecord
from torchrec_cnr.tracking.tracker import LocalShard

_INT32_MAX = 2**31 - 1


@dataclass
class StagedShard:
    """Rows of one shard, copied to host memory."""

    shard: LocalShard
    key: str
    ids: torch.Tensor | None
    """``(n,)`` global row ids, or ``None`` when every row is staged."""
    weight: torch.Tensor
    """``(n, cols)`` row values."""
    states: dict[str, torch.Tensor]
    """Per-row optimizer states of the staged rows, each ``(n, ...)``."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor map as stored in the snapshot."""
        out = {f"{self.key}.w": self.weight}
        if self.ids is not None:
            out[f"{self.key}.ids"] = self.ids
        for name, value in self.states.items():
            out[f"{self.key}.{name}"] = value
        return out

    def record(self) -> ShardRecord:
        nbytes = sum(t.numel() * t.element_size() for t in self.tensors().values())
        return ShardRecord(
            spec=self.shard.spec.to_json(),
            key=self.key,
            saved_rows=int(self.weight.shape[0]),
            all_rows=self.ids is None,
            states=sorted(self.states),
            optimizer=self.shard.optimizer,
            nbytes=nbytes,
        )


@dataclass
class StagedCheckpoint:
    """Everything one rank writes for one checkpoint."""

    step: int
    kind: str
    shards: list[StagedShard]
    dense: dict[str, torch.Tensor]
    app_state: bytes
    meta: dict[str, Any] = field(default_factory=dict)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    # A CPU gather already made a private copy; anything else is copied here.
    return t.to("cpu", copy=t.device.type != "cpu")


def stage_shard(shard: LocalShard, key: str, full: bool) -> StagedShard:
    """Copies the rows of ``shard`` that the checkpoint holds.

    Args:
        shard: the live shard.
        key: its name inside the snapshot.
        full: stage every row, not only the modified ones.
    """
    spec = shard.spec
    mask = None if full else shard.modified_mask()
    if mask is None or bool(mask.all()):
        return StagedShard(
            shard,
            key,
            None,
            shard.weight.detach().to("cpu", copy=True),
            {n: s.detach().to("cpu", copy=True) for n, s in shard.states.items()},
        )
    local = mask.nonzero().flatten()
    ids_dtype = torch.int32 if spec.num_embeddings <= _INT32_MAX else torch.int64
    ids = _to_host(local + spec.row_offset).to(ids_dtype)
    weight = _to_host(shard.weight.detach().index_select(0, local))
    states = {n: _to_host(s.detach().index_select(0, local)) for n, s in shard.states.items()}
    return StagedShard(shard, key, ids, weight, states)


def serialize_app_state(app_state: Mapping[str, Any]) -> bytes:
    """``torch.save`` of ``{name: obj.state_dict()}``; stored as one object per rank."""
    buf = io.BytesIO()
    torch.save({name: obj.state_dict() for name, obj in app_state.items()}, buf)
    return buf.getvalue()


def stage(
    step: int,
    kind: str,
    shards: list[LocalShard],
    dense: Mapping[str, torch.Tensor],
    app_state: Mapping[str, Any],
) -> StagedCheckpoint:
    """Stages a checkpoint of ``kind`` (``"full"`` or ``"delta"``) at ``step``."""
    staged = [stage_shard(s, f"s{i}", full=kind == "full") for i, s in enumerate(shards)]
    host_dense = {k: v.detach().to("cpu", copy=True) for k, v in dense.items()}
    return StagedCheckpoint(step, kind, staged, host_dense, serialize_app_state(app_state))
