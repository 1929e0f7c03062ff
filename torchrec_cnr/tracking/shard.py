"""One rank's embedding-table shard: where it lives, and live views into its kernel.

A :class:`LocalShard` is what every later stage works on: selection reads its
modified-row bits, staging copies its rows, restore writes into its weights and
optimizer states. FBGEMM's TBE kernels hold the memory; the views here alias it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from torchrec_cnr.schema import ShardSpec
from torchrec_cnr.tracking import bitmap

if TYPE_CHECKING:
    from torchrec_cnr.tracking.lookups import KernelLookups
    from torchrec_cnr.tracking.priority import TablePriority

__all__ = ["SCALAR_STATES", "LocalShard", "ShardSpec", "optimizer_state_names"]

SCALAR_STATES = ("iter", "max_counter")
"""One-element buffers of an FBGEMM TBE that its optimizers read besides the per-row states:
the step counter (Adam's and LAMB's bias correction, counter and global weight decay) and
the largest row counter (counter weight decay)."""

# Optimizers whose TBE keeps a second moment (``momentum2``).
_SECOND_MOMENT = {
    "ADAM",
    "PARTIAL_ROWWISE_ADAM",
    "LAMB",
    "PARTIAL_ROWWISE_LAMB",
    "ENSEMBLE_ROWWISE_ADAGRAD",
}


def optimizer_state_names(emb: Any) -> list[str]:
    """Names of the per-table states ``emb.split_optimizer_states()`` returns, in its order.

    FBGEMM returns, for each table, ``momentum1`` (every optimizer but EXACT_SGD), then
    ``momentum2`` (Adam and LAMB variants), ``prev_iter`` (row-wise Adagrad with counter or
    global weight decay) and ``row_counter`` (counter weight decay, Adam with row-wise bias
    correction). The names are FBGEMM's own buffer prefixes.
    """
    optimizer = emb.optimizer.name
    counter = bool(getattr(emb, "_used_rowwise_adagrad_with_counter", False))
    global_decay = bool(getattr(emb, "_used_rowwise_adagrad_with_global_weight_decay", False))
    names = []
    if optimizer != "EXACT_SGD":
        names.append("momentum1")
    if optimizer in _SECOND_MOMENT:
        names.append("momentum2")
    if counter or global_decay:
        names.append("prev_iter")
    if counter or (optimizer == "ADAM" and getattr(emb, "use_rowwise_bias_correction", False)):
        names.append("row_counter")
    return names


@dataclass
class LocalShard:
    """A shard held by this rank, with live views into its kernel's memory."""

    spec: ShardSpec
    weight: torch.Tensor
    """``(rows, cols)`` view of the kernel's weights."""
    states: dict[str, torch.Tensor]
    """Fused optimizer states by FBGEMM name: per row ``(rows,)`` (row-wise Adagrad's
    ``momentum1``, ``prev_iter``, ``row_counter``) or per element ``(rows, cols)`` (Adagrad's and
    Adam's moments)."""
    optimizer: str
    """Name of the fused optimizer, or ``"dense"`` when the kernel is not fused."""
    words: torch.Tensor | None
    """``(ceil(rows / 64),)`` int64 modified-row bitmap; ``None`` means every row counts as modified."""
    kernel: Any = field(repr=False)
    """The TBE kernel module; staging flushes it."""
    priority: TablePriority | None = None
    """CPR's MFU or SSU priority of the rows (see :mod:`torchrec_cnr.tracking.priority`)."""
    drain: Callable[[], None] = field(repr=False, default=lambda: None)
    """Waits until pending lookups are in ``words``; call before reading or writing them."""
    recent: torch.Tensor | None = None
    """``(ceil(rows / 64),)`` int64 bitmap of rows modified since the last checkpoint was
    staged, whatever the policy; ``None`` means every row counts as modified."""
    lookups: KernelLookups | None = field(repr=False, default=None)
    """The kernel's lookups (lazy staging listens to them); ``None`` without a bitmap."""
    lookup_base: int = 0
    """Where this shard's rows start in the rows :attr:`lookups` reports."""

    def modified_mask(self) -> torch.Tensor:
        """``(rows,)`` bool mask of rows modified since the bits were last cleared."""
        self.drain()
        if self.words is None:
            return torch.ones(self.spec.rows, dtype=torch.bool, device=self.weight.device)
        return bitmap.to_mask(self.words, self.spec.rows)

    def scalar_states(self) -> dict[str, float]:
        """The kernel's one-element optimizer buffers (:data:`SCALAR_STATES`) that it has."""
        if self.words is None:
            return {}
        emb = self.kernel.emb_module
        found = {}
        for name in SCALAR_STATES:
            value = getattr(emb, name, None)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                found[name] = value.item()
        return found

    def load_scalar_states(self, values: dict[str, float]) -> None:
        """Writes :meth:`scalar_states` back into the kernel."""
        emb = self.kernel.emb_module
        for name, value in values.items():
            buffer = getattr(emb, name, None)
            if isinstance(buffer, torch.Tensor) and buffer.numel() == 1:
                buffer.fill_(value)
        if "iter" in values and isinstance(getattr(emb, "iter_cpu", None), torch.Tensor):
            # The TBE copies iter into iter_cpu only while iter_cpu is 0, i.e. in a fresh
            # kernel; a live one would go on counting from its own value.
            emb.iter_cpu.fill_(int(values["iter"]))

    def row_bytes(self, with_id: bool = True) -> int:
        """Bytes one row of this shard takes in an fp32 checkpoint: values, optimizer
        states, and its id (a delta stores each row's id; a full save stores none)."""
        per_row = self.weight.shape[1] * self.weight.element_size()
        for s in self.states.values():
            per_row += (s.numel() // max(s.shape[0], 1)) * s.element_size()
        id_bytes = 4 if self.spec.num_embeddings <= 2**31 - 1 else 8
        return per_row + (id_bytes if with_id else 0)
