"""CPR's row priorities for prioritized saves: MFU and SSU.

CPR (Maeng et al., MLSys'21, Sec. 4.3) saves the most important modified rows first:

- **MFU** (most frequently used) counts every access of every row, 4 bytes a row;
- **SSU** (sub-sampled used) approximates it cheaply: one bit per row, set by a random
  ``rate`` subsample of the lookups.

A :class:`KernelPriority` records lookups for one TBE kernel, next to its modified-row
bitmap; each table's :class:`TablePriority` is a view into it that row selection
(:mod:`torchrec_cnr.selection.priority`) ranks and clears.
"""

from __future__ import annotations

from typing import Literal

import torch

from torchrec_cnr.tracking import bitmap

__all__ = ["PRIORITY_MODES", "KernelPriority", "TablePriority", "check_ssu_rate"]

PriorityMode = Literal["mfu", "ssu"]
PRIORITY_MODES: tuple[PriorityMode, ...] = ("mfu", "ssu")


def check_ssu_rate(rate: float) -> None:
    """SSU samples this share of lookups: it must lie in (0, 1].

    Raises:
        ValueError: it does not.
    """
    if not 0 < rate <= 1:
        raise ValueError(f"ssu_rate must be in (0, 1], got {rate}")


class TablePriority:
    """The priorities of one table's rows inside its kernel's :class:`KernelPriority`."""

    def __init__(self, mode: PriorityMode, view: torch.Tensor, rows: int) -> None:
        self.mode = mode
        self._view = view
        self._rows = rows

    def scores(self, rows: torch.Tensor) -> torch.Tensor:
        """``(n,)`` float64 priority of the local ``rows``: access counts, or sampled (1) or not (0)."""
        if self.mode == "mfu":
            return self._view[rows].to(torch.float64)
        return bitmap.to_mask(self._view, self._rows)[rows].to(torch.float64)

    def clear(self, rows: torch.Tensor | None = None) -> None:
        """Restarts the priority of ``rows`` (every row if ``None``), as their bits restart."""
        if rows is None:
            self._view.zero_()
        elif self.mode == "mfu":
            self._view[rows] = 0
        else:
            bitmap.clear_bits(self._view, rows)


class KernelPriority:
    """Priorities of every row of one TBE kernel, laid out like its bitmap.

    Args:
        mode: ``mfu`` or ``ssu``.
        num_words: words of the kernel's bitmap; each table starts on a word boundary.
        device: where the kernel's memory lives.
        ssu_rate: the sampled share of lookups, for ``ssu``.
    """

    def __init__(
        self, mode: PriorityMode, num_words: int, device: torch.device, ssu_rate: float
    ) -> None:
        if mode not in PRIORITY_MODES:
            raise ValueError(f"priority mode must be one of {PRIORITY_MODES}, got {mode!r}")
        if mode == "ssu":
            check_ssu_rate(ssu_rate)
        self.mode = mode
        self.ssu_rate = ssu_rate
        if mode == "mfu":
            self._data = torch.zeros(num_words * 64, dtype=torch.int32, device=device)
        else:
            self._data = torch.zeros(num_words, dtype=torch.int64, device=device)

    @property
    def nbytes(self) -> int:
        return self._data.numel() * self._data.element_size()

    def record(self, rows: torch.Tensor) -> None:
        """Counts one lookup of each of ``rows`` (kernel-wide row indices, repeats allowed)."""
        if self.mode == "mfu":
            self._data.index_add_(0, rows, torch.ones_like(rows, dtype=self._data.dtype))
        else:
            sampled = rows[torch.rand(rows.numel(), device=rows.device) < self.ssu_rate]
            bitmap.set_bits(self._data, sampled)

    def table(self, first_word: int, rows: int) -> TablePriority:
        """The view of the table whose bits start at word ``first_word``."""
        if self.mode == "mfu":
            start = first_word * 64
            return TablePriority(self.mode, self._data[start : start + rows], rows)
        return TablePriority(
            self.mode, self._data[first_word : first_word + bitmap.num_words(rows)], rows
        )
