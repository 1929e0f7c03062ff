"""Packed row bitmaps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_cnr.tracking import bitmap


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.lists(st.integers(0, 10_000), max_size=200))
def test_set_bits_marks_exactly_the_rows_given(num_rows: int, raw: list[int]) -> None:
    rows = torch.tensor([r % num_rows for r in raw], dtype=torch.int64)
    words = torch.zeros(bitmap.num_words(num_rows), dtype=torch.int64)
    half = len(rows) // 2
    bitmap.set_bits(words, rows[:half])
    bitmap.set_bits(words, rows[half:])  # a second batch ORs into the first
    want = torch.zeros(num_rows, dtype=torch.bool)
    want[rows] = True
    assert torch.equal(bitmap.to_mask(words, num_rows), want)
    assert bitmap.count(words) == int(want.sum())
    assert torch.equal(bitmap.from_mask(want), words)


def test_bit_63_of_a_word_round_trips() -> None:
    words = torch.zeros(2, dtype=torch.int64)
    bitmap.set_bits(words, torch.tensor([63, 64, 127, 63]))
    assert bitmap.to_mask(words, 128).nonzero().flatten().tolist() == [63, 64, 127]


def test_bitmap_costs_one_bit_per_row() -> None:
    assert bitmap.num_words(1_000_000) * 8 == 125_000


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 500), st.lists(st.integers(0, 10_000), max_size=300))
def test_to_indices_lists_exactly_the_set_rows_in_order(num_rows: int, raw: list[int]) -> None:
    rows = sorted({r % num_rows for r in raw})
    words = torch.zeros(bitmap.num_words(num_rows), dtype=torch.int64)
    bitmap.set_bits(words, torch.tensor(rows, dtype=torch.int64))
    assert bitmap.to_indices(words, num_rows).tolist() == rows


@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_ranks_place_each_set_row_at_its_position_among_the_set_rows(density: float) -> None:
    g = torch.Generator().manual_seed(7)
    rows = 64 * 9 + 13
    mask = torch.rand(rows, generator=g) < density
    words = bitmap.from_mask(mask)
    counts = bitmap.popcounts(words)
    assert counts.tolist() == [int(mask[i : i + 64].sum()) for i in range(0, rows, 64)]
    asked = torch.randint(0, rows, (500,), generator=g)
    is_set, position = bitmap.ranks(words, torch.cumsum(counts, 0) - counts, asked)
    assert torch.equal(is_set, mask[asked])
    indices = bitmap.to_indices(words, rows)
    assert torch.equal(indices[position[is_set]], asked[is_set])
