"""Staging buffers shared with a writer process: a tensor staged at a buffer's start is
described, not copied, and maps onto the same memory; any other is left to travel as bytes."""

from __future__ import annotations

import os

import torch

from torchrec_cnr.staging.shared import MappedBuffers, SharedBuffers


def test_a_staged_tensor_maps_onto_the_same_memory_and_others_are_not_described() -> None:
    shared, mapped = SharedBuffers(), MappedBuffers()
    flat = shared.allocate(12, torch.float32)
    staged = flat[:6].view(2, 3)
    staged.copy_(torch.arange(6.0).view(2, 3))
    view = shared.view(staged)
    assert view is not None and view.shape == (2, 3)
    for ident, fd, nbytes in shared.unsent():  # as the writer process receives them
        mapped.attach(ident, os.dup(fd), nbytes)
        os.close(fd)
    there = mapped.tensor(view)
    assert torch.equal(there, staged)
    there[1, 2] = 100.0  # one memory: a write on either side is seen on the other
    assert staged[1, 2] == 100.0
    assert shared.view(flat[1:]) is None, "not at a buffer's start: sent as its bytes"
    assert shared.view(torch.zeros(3)) is None
    shared.free(flat)
    assert shared.freed() == [view.buffer]
    shared.close()
