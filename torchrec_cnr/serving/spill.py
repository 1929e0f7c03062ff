"""An update larger than a follower's memory budget, prepared piece by piece into local
files.

Copy mode writes an update's rows into the served tables under the exclusive hold, so the
rows must be ready, all of them, before the hold: read, checked by the accept gate and in
serving form. Held in memory, they grow the serving process by the update's size. With
``FollowerOptions(memory_budget_mb=...)`` an update whose rows would take more is read in
pieces of at most the budget; each piece is checked and prepared, then copied into a file
mapped from ``spill_dir`` and dropped. The files are unlinked as soon as they are mapped: their
pages are the page cache's, which the kernel writes back and evicts under pressure, not
the process's heap, and nothing is left behind if the process dies. Under the hold the
rows are copied from the mapped files, as they would be from memory (pages evicted since
are read back first).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from torchrec_cnr.read.items import MemoryBudget
from torchrec_cnr.serving.rows import PreparedRows, StoredRows, memory_bytes
from torchrec_cnr.serving.targets import ServingTarget

__all__ = ["Spill", "piece_bytes", "piece_rows"]

PieceRows = tuple[str, torch.Tensor, PreparedRows]
"""(state-dict key, ascending ids, rows in serving form)."""


def piece_bytes(dim: int) -> int:
    """What one row of width ``dim`` may take while an update is prepared: read as fp32
    (the widest stored form), its int64 id, and its serving form beside it (at most fp32
    again)."""
    return 2 * 4 * dim + 8


def piece_rows(budget: int, dim: int) -> int:
    """Rows of width ``dim`` in one piece of at most ``budget`` bytes; at least one."""
    return MemoryBudget(budget).rows(piece_bytes(dim))


class Spill:
    """An update's rows in serving form, in files mapped from ``folder``.

    Args:
        target: the serving target that prepares the rows.
        folder: a local folder on a disk (not a tmpfs: there the files would be memory);
            ``None``: the system's temporary folder.
    """

    def __init__(self, target: ServingTarget, folder: str | None = None) -> None:
        self.target = target
        self.folder = Path(folder or tempfile.gettempdir())
        self.pieces: list[PieceRows] = []
        self.held_bytes = 0
        """The most memory one piece took, as read and in serving form."""
        self.bytes = 0
        """Bytes of the mapped files."""

    def add(self, piece: list[tuple[str, torch.Tensor, StoredRows]]) -> None:
        """Prepares one piece, ``(key, ids, rows)`` read together, and moves it into
        mapped files."""
        held = [t for _, ids, rows in piece for t in (ids, *rows.tensors())]
        for key, ids, rows in piece:
            prepared = self.target.prepare(key, rows, ids)
            held += prepared.tensors
            mapped = tuple(self._mapped(t) for t in prepared.tensors)
            self.pieces.append(
                (key, self._mapped(ids), PreparedRows(prepared.key, prepared.count, mapped))
            )
        self.held_bytes = max(self.held_bytes, memory_bytes(held))

    def _mapped(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` in a file mapped shared and already unlinked."""
        t = t.contiguous()
        n = t.numel() * t.element_size()
        if n == 0:
            return t.clone()
        fd, path = tempfile.mkstemp(prefix="cnr-spill-", dir=self.folder)
        try:
            os.ftruncate(fd, n)
            raw = torch.from_file(path, shared=True, size=n, dtype=torch.uint8)
        finally:
            os.close(fd)
            os.unlink(path)
        out = raw.view(t.dtype).view(t.shape)
        out.copy_(t)
        self.bytes += n
        return out
