"""One bit per embedding row, packed into ``int64`` words.

A ``bool`` tensor would cost a byte per row, 8x the budget Check-N-Run sets for
tracking (under 0.05% of model memory at dim 64). Bits are packed 64 to a word;
a lookup batch sets its bits with one sort and one scatter.
"""

from __future__ import annotations

import numpy as np
import torch

_WORD = 64
_BYTE_BITS = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)


def num_words(num_rows: int) -> int:
    """Words needed to hold ``num_rows`` bits."""
    return (num_rows + _WORD - 1) // _WORD


def _word_masks(words: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For unique ``rows``: the words they fall in and, per word, the OR of their bits."""
    word_idx = rows >> 6
    bits = torch.bitwise_left_shift(torch.ones_like(rows), rows & (_WORD - 1))
    touched, inverse = torch.unique_consecutive(word_idx, return_inverse=True)
    # Rows are unique, so adding their distinct powers of two within a word is
    # the same as OR-ing them (two's complement wrap-around keeps bit 63 right).
    return touched, torch.zeros_like(touched).scatter_add_(0, inverse, bits)


def set_bits(words: torch.Tensor, rows: torch.Tensor) -> None:
    """Sets the bits of ``rows`` in ``words``.

    Args:
        words: ``(num_words,)`` int64 bitmap, updated in place.
        rows: ``(n,)`` integer row indices into the bitmap, duplicates allowed.
    """
    if rows.numel() == 0:
        return
    rows = rows.to(torch.int64)
    # Skewed (Zipf) traffic mostly repeats rows whose bit is already set; a
    # gather drops them before the sort, which is the costly step.
    known = torch.bitwise_right_shift(words[rows >> 6], rows & (_WORD - 1)) & 1
    rows = rows[known == 0]
    if rows.numel() == 0:
        return
    touched, merged = _word_masks(words, torch.unique(rows))
    words[touched] |= merged


def set_bits_in_both(words: torch.Tensor, recent: torch.Tensor, rows: torch.Tensor) -> None:
    """Sets the bits of ``rows`` in two bitmaps of one shape, where every bit set in
    ``recent`` is also set in ``words`` (``recent`` is cleared at least as often): one
    sort serves both.

    Args:
        words: ``(num_words,)`` int64 bitmap, updated in place.
        recent: ``(num_words,)`` int64 bitmap whose set bits are a subset of ``words``'.
        rows: ``(n,)`` integer row indices, duplicates allowed.
    """
    if rows.numel() == 0:
        return
    rows = rows.to(torch.int64)
    known = torch.bitwise_right_shift(recent[rows >> 6], rows & (_WORD - 1)) & 1
    rows = rows[known == 0]
    if rows.numel() == 0:
        return
    touched, merged = _word_masks(recent, torch.unique(rows))
    recent[touched] |= merged
    words[touched] |= merged


def clear_bits(words: torch.Tensor, rows: torch.Tensor) -> None:
    """Clears the bits of ``rows`` (duplicates allowed) in ``words``."""
    if rows.numel() == 0:
        return
    touched, merged = _word_masks(words, torch.unique(rows.to(torch.int64)))
    words[touched] &= ~merged


def to_mask(words: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Unpacks a bitmap.

    Args:
        words: ``(num_words,)`` int64 bitmap.
        num_rows: number of valid rows.

    Returns:
        ``(num_rows,)`` bool mask.
    """
    shifts = torch.arange(_WORD, device=words.device, dtype=torch.int64)
    bits = torch.bitwise_right_shift(words.unsqueeze(1), shifts) & 1
    return bits.reshape(-1)[:num_rows].bool()


def to_indices(words: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Rows whose bit is set.

    Args:
        words: ``(num_words,)`` int64 bitmap.
        num_rows: number of valid rows.

    Returns:
        ``(n,)`` int64 row indices, ascending, on ``words``' device.
    """
    if words.device.type != "cpu":
        return to_mask(words, num_rows).nonzero().flatten()
    # numpy unpacks 8 bits per byte in C (torch would materialise 64 int64 per word),
    # and its nonzero of a bool array is ~1.4x faster than torch's.
    bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[:num_rows]
    return torch.from_numpy(np.nonzero(bits.view(np.bool_))[0])


def from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Packs a ``(num_rows,)`` bool mask into an int64 bitmap."""
    words = torch.zeros(num_words(mask.numel()), dtype=torch.int64, device=mask.device)
    if mask.device.type != "cpu":
        set_bits(words, mask.nonzero().flatten())
        return words
    # numpy packs 8 rows per byte in C, where a sort of the set rows would cost 10x.
    packed = np.packbits(mask.contiguous().numpy().view(np.uint8), bitorder="little")
    words.numpy().view(np.uint8)[: packed.size] = packed
    return words


def count(words: torch.Tensor) -> int:
    """Number of set bits."""
    return int(popcounts(words).sum())


def popcounts(words: torch.Tensor) -> torch.Tensor:
    """``(n,)`` int64: the number of set bits of each word."""
    if words.device.type == "cpu":  # numpy's popcount instruction, 20x a byte table
        counts = np.bitwise_count(words.contiguous().numpy().view(np.uint64))
        return torch.from_numpy(counts.astype(np.int64))
    table = _BYTE_BITS.to(words.device)
    return table[words.contiguous().view(torch.uint8).long()].view(-1, 8).sum(1)


def ranks(
    words: torch.Tensor, before: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``rows`` fall among the set rows of a bitmap.

    Args:
        words: ``(num_words,)`` int64 bitmap.
        before: ``(num_words,)`` set bits in the words before each (an exclusive cumsum of
            :func:`popcounts`).
        rows: ``(n,)`` int64 row indices, duplicates allowed.

    Returns:
        ``(n,)`` bool: whether each row's bit is set; ``(n,)`` int64: how many set rows
        come before it (its position in :func:`to_indices`, where its bit is set).
    """
    word = words[rows >> 6]
    bit = rows & (_WORD - 1)
    is_set = (torch.bitwise_right_shift(word, bit) & 1).bool()
    # 1 << 63 wraps to INT64_MIN and minus one to INT64_MAX: bits 0..62, as wanted.
    low = word & (torch.bitwise_left_shift(torch.ones_like(bit), bit) - 1)
    return is_set, before[rows >> 6] + popcounts(low)
