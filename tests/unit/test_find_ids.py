"""``find_ids``: where each wanted row id lies among a record's stored ids."""

from __future__ import annotations

import pytest
import torch

from torchrec_cnr.read import find_ids


@pytest.mark.parametrize(
    ("ids", "wanted"),
    [([3, 5, 9], [3, 5, 9]), ([3, 5, 9], [1, 5, 10]), ([3, 5, 9], [3, 4, 9]), ([], [2]),
     ([4], [4]), ([3, 5, 9], []), ([3, 4, 5], [1, 4, 5, 6]), ([3, 4, 5], [0, 1, 2]),
     ([3, 4, 5, 8], [4, 6, 8]), ([2, 7], list(range(0, 20))), ([2, 30], list(range(0, 20, 2)))],
)  # fmt: skip
def test_find_ids_says_which_wanted_ids_are_there_and_where(
    ids: list[int], wanted: list[int]
) -> None:
    hit, at = find_ids(
        torch.tensor(ids, dtype=torch.int64), torch.tensor(wanted, dtype=torch.int64)
    )
    assert hit.tolist() == [w in ids for w in wanted]
    assert [int(a) for a, h in zip(at, hit) if h] == [ids.index(w) for w in wanted if w in ids]
