"""The accept gate: what a follower shows it before serving an update, and what it says.

An update is read whole (or, over the memory budget, piece by piece) before anything of
it is served: :class:`PendingUpdate` holds it, read and ready. The gate, a function of
it, returns ``None`` to accept it or a string saying why it refuses it; a refused update
is recorded as a :class:`RefusedUpdate` and the last accepted step stays served.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from torchrec_cnr.read import MemoryBudget
from torchrec_cnr.serving.plan import UpdatePlan
from torchrec_cnr.serving.rows import StoredRows
from torchrec_cnr.serving.spill import Spill

__all__ = ["AcceptGate", "PendingUpdate", "RefusedUpdate", "finite_rows"]


@dataclass(frozen=True)
class RefusedUpdate:
    """An update the accept gate refused: the step served stayed."""

    step: int
    """The step it would have served."""
    checkpoint: str
    reason: str
    """What the gate said."""
    at: float = field(default_factory=time.time)


@dataclass
class PendingUpdate:
    """Everything read for one update, ready to apply: what an accept gate sees."""

    plan: UpdatePlan
    rows: list[tuple[str, torch.Tensor, StoredRows]] = field(default_factory=list)
    """(state-dict key, ``(k,)`` ascending global ids, their rows as stored)."""
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    """Dense tensors that change, by state-dict key."""
    spill: Spill | None = None
    """An update over the follower's memory budget: its rows, in serving form, in mapped
    files instead of :attr:`rows` (the gate saw them piece by piece, each as an update of
    its own with the same plan)."""
    refused: str | None = None
    """Why the gate refused one of its pieces, if it did."""
    memory: MemoryBudget | None = field(default=None, compare=False, repr=False)
    """What it holds, in the process's ledger of reads until it is dropped."""

    @property
    def step(self) -> int:
        """The step it serves."""
        return self.plan.target.step

    @property
    def count(self) -> int:
        pieces = [] if self.spill is None else self.spill.pieces
        return sum(int(ids.numel()) for _, ids, _ in [*self.rows, *pieces])


AcceptGate = Callable[[PendingUpdate], str | None]
"""Sees each update before it is served: ``None`` accepts it, a string refuses it (why)."""


def finite_rows(update: PendingUpdate) -> str | None:
    """The default gate: refuses an update holding a NaN or an infinity in a row (as
    stored, dequantized) or a dense tensor; names the first five rows of each table."""
    bad: list[str] = []
    for key, ids, rows in update.rows:
        finite = rows.finite()
        if not bool(finite.all()):
            bad.append(f"{key} rows {ids[~finite][:5].tolist()}")
    bad += [name for name, t in update.dense.items() if not bool(torch.isfinite(t).all())]
    return None if not bad else "non-finite values in " + ", ".join(bad)
