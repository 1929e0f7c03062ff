"""Buffers a reader reads into again and again: handed out again only once nothing views
them, at the asked phase past a page boundary, and trimmed to what one round took."""

from __future__ import annotations

import gc
import mmap
import os
from typing import Any

import pytest
import torch

from tests import vm_flags
from torchrec_cnr.snapshot import buffers
from torchrec_cnr.snapshot.buffers import Buffers
from torchrec_cnr.snapshot.reader import page_aligned
from torchrec_cnr.storage import DIRECT_ALIGN


def test_a_buffer_is_reused_once_nothing_views_it_and_never_while_a_view_lives() -> None:
    buffers = Buffers()
    first = buffers.take(1000, torch.float32)
    one = buffers.nbytes
    first.fill_(1.0)
    kept = first[10:20].view(2, 5)  # a view alone keeps the buffer in use
    address = first.data_ptr()
    del first
    buffers.trim()  # a new round: the viewed buffer is not free
    second = buffers.take(1000, torch.float32)
    assert second.data_ptr() != address
    second.fill_(2.0)
    assert torch.equal(kept, torch.ones(2, 5)), "a viewed buffer was handed out again"
    del kept
    gc.collect()
    buffers.trim()  # the next round: the first buffer is free now
    third = buffers.take(900, torch.float32)  # fits the first buffer
    assert third.data_ptr() == address
    assert buffers.nbytes == 2 * one  # no third buffer


def test_a_buffer_starts_at_the_asked_phase_past_a_page_and_holds_what_was_asked() -> None:
    buffers = Buffers()
    for phase in (0, 256, DIRECT_ALIGN - 8, DIRECT_ALIGN + 8):
        t = buffers.take(3000, torch.int64, phase)
        assert t.numel() == 3000 and t.dtype == torch.int64
        assert t.data_ptr() % DIRECT_ALIGN == phase % DIRECT_ALIGN
        t.fill_(7)  # every element writable
        assert int(t.sum()) == 7 * 3000


def test_trim_keeps_of_the_free_buffers_about_what_was_taken_since_the_last_trim() -> None:
    buffers = Buffers()
    big = [buffers.take(1 << 20, torch.uint8) for _ in range(4)]  # a large round
    del big
    buffers.trim()  # all four kept: the last round took as much
    small = buffers.take(1 << 18, torch.uint8)  # a small round reuses one of them
    assert buffers.nbytes == 4 * (5 << 20) // 4  # no new buffer
    buffers.trim()  # keeps about the small round's bytes: the buffer in use and one free
    assert buffers.nbytes <= 2 * (5 << 20) // 4
    assert small.numel() == 1 << 18
    del small
    buffers.trim()  # nothing taken since the last trim: nothing free kept
    assert buffers.nbytes == 0


def test_only_reads_of_a_mebibyte_or_more_go_into_the_buffers() -> None:
    buffers = Buffers()
    assert buffers.holds(1 << 20) and not buffers.holds((1 << 20) - 1)


def test_a_round_checks_each_buffer_once_at_its_trim_not_at_each_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A follower of thousands of tables takes thousands of buffers an update: finding
    # each one must not pass over every buffer held (a round of 5,000 took seconds so).
    checks = 0
    counted = buffers._references

    def counting(held: list[Any], i: int) -> int:
        nonlocal checks
        checks += 1
        return counted(held, i)

    monkeypatch.setattr(buffers, "_references", counting)
    pool, n = Buffers(), 2000
    for _ in range(3):
        pool.trim()
        held = [pool.take(4096, torch.uint8) for _ in range(n)]
        del held
    # 8 KiB each (4 KiB and SLACK): no round after the first made any.
    assert pool.nbytes == n * 2 * 4096
    assert checks <= 3 * n


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
    reason="a kernel without transparent huge pages",
)
@pytest.mark.parametrize("phase", [0, 256])
def test_read_memory_of_a_huge_page_or_more_is_a_mapping_of_its_own_advised_for_huge_pages(
    phase: int,
) -> None:
    big = page_aligned(buffers.HUGE_PAGE, torch.uint8, phase=phase)
    assert big.data_ptr() % DIRECT_ALIGN == phase and big.numel() == buffers.HUGE_PAGE
    assert "hg" in vm_flags(big.data_ptr())  # MADV_HUGEPAGE
    big.fill_(7)
    view = big[-10:]
    del big
    gc.collect()
    assert torch.equal(view, torch.full((10,), 7, dtype=torch.uint8)), "its mapping outlives a view"
    small = page_aligned(buffers.HUGE_PAGE // 2, torch.uint8)
    assert small.data_ptr() % DIRECT_ALIGN == 0
    assert "hg" not in vm_flags(small.data_ptr())
    taken = Buffers().take(buffers.HUGE_PAGE, torch.uint8)
    assert "hg" in vm_flags(taken.data_ptr())


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
    reason="a kernel without transparent huge pages",
)
def test_memory_of_another_allocator_is_advised_for_the_huge_pages_inside_it() -> None:
    # Another allocator's mapping, never advised: torch's own memory may come from a heap
    # that an earlier test in this process advised (advice outlives the tensor it was for).
    other = mmap.mmap(-1, 3 * buffers.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    table = torch.frombuffer(other, dtype=torch.uint8)
    first = -(-table.data_ptr() // buffers.HUGE_PAGE) * buffers.HUGE_PAGE
    assert "hg" not in vm_flags(first)
    buffers.advise_huge_pages(table[1:])  # a view: its storage is advised
    assert "hg" in vm_flags(first)
    buffers.advise_huge_pages(torch.empty(1000))  # no huge page inside: nothing, no error
