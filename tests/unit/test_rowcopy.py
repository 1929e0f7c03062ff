"""``put_rows`` writes exactly what ``index_copy_`` writes, on every layout it meets,
with its compiled loop (non-temporal stores into a large table, the cached loop into a
small one) and with numpy's assignment (where the loop was not built)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from torchrec_cnr import rowcopy
from torchrec_cnr.rowcopy import put_rows


@pytest.fixture(autouse=True, params=["streamed", "cached", "numpy"])
def _writer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if request.param == "numpy":
        monkeypatch.setattr(rowcopy, "_library", lambda: None)
    else:
        assert rowcopy._library() is not None, "_rowcopy_lib is not built"
        # Every table of these tests is small: streamed, each counts as past the caches.
        monkeypatch.setattr(rowcopy, "STREAM_BYTES", 0 if request.param == "streamed" else 2**62)
    yield


def _expected(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return dst.clone().index_copy_(0, index, src.to(dst.dtype))


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((1000, 64), torch.float32), ((1000, 7), torch.bfloat16), ((1000, 36), torch.uint8),
     ((1000,), torch.float32), ((1000, 4, 3), torch.float16), ((1000, 8), torch.float16)],
)  # fmt: skip
def test_put_rows_matches_index_copy(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    dst = (torch.rand(shape, generator=g) * 200).to(dtype)
    index = torch.randperm(shape[0], generator=g)[:300]  # unsorted, distinct
    src = (torch.rand((300, *shape[1:]), generator=g) * 200).to(dtype)
    expected = _expected(dst, index, src)
    put_rows(dst, index, src)
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


def test_put_rows_keeps_nan_payloads_and_converts_dtype() -> None:
    dst = torch.zeros(10, 4)
    src = torch.full((2, 4), float("nan"), dtype=torch.float64)
    put_rows(dst, torch.tensor([7, 2]), src)
    assert dst[[2, 7]].isnan().all() and not dst[[0, 1, 3, 4, 5, 6, 8, 9]].isnan().any()
    bits = torch.tensor([0x7FC00123] * 4, dtype=torch.int32).view(torch.float32)[None]
    put_rows(dst, torch.tensor([5]), bits)
    assert torch.equal(dst[5].view(torch.int32), bits[0].view(torch.int32))


def test_put_rows_on_a_column_slice_writes_only_those_columns() -> None:
    table = torch.arange(60.0).view(10, 6)
    before = table.clone()
    put_rows(table[:, 2:4], torch.tensor([1, 8]), torch.full((2, 2), -1.0))
    before[[1, 8], 2:4] = -1.0
    assert torch.equal(table, before)


def test_put_rows_on_an_aligned_column_slice_writes_only_those_columns() -> None:
    # 16-byte rows at a 16-byte offset and a 48-byte stride: streamed where the table
    # counts as large.
    table = torch.arange(12_000.0).view(1000, 12)
    before = table.clone()
    put_rows(table[:, 4:8], torch.tensor([999, 3, 500]), torch.full((3, 4), -1.0))
    before[[999, 3, 500], 4:8] = -1.0
    assert torch.equal(table, before)


def test_put_rows_refuses_a_count_mismatch_and_an_index_out_of_range() -> None:
    dst = torch.zeros(10, 4)
    with pytest.raises(ValueError, match="3 rows indexed, 2 given"):
        put_rows(dst, torch.tensor([1, 2, 3]), torch.ones(2, 4))
    for bad in ([10], [-1], [3, 10], [3, -2, 5]):  # none written, even rows before
        with pytest.raises(IndexError):
            put_rows(dst, torch.tensor(bad), torch.ones(len(bad), 4))
    put_rows(dst, torch.tensor([], dtype=torch.int64), torch.ones(0, 4))
    assert not dst.any()


def test_put_rows_writes_a_run_of_consecutive_rows_as_one_block() -> None:
    table = torch.zeros(10, 3)
    put_rows(table, torch.arange(4, 7), torch.ones(3, 3))
    assert torch.equal(table.sum(1), torch.tensor([0.0] * 4 + [3.0] * 3 + [0.0] * 3))
    with pytest.raises(IndexError):
        put_rows(table, torch.arange(8, 11), torch.ones(3, 3))
