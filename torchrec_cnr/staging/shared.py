"""Staging buffers another process maps: with ``CheckpointConfig.background = "process"``,
the writer process encodes and writes rows where training staged them, without a copy.

Each buffer is an anonymous memory file (``memfd_create``) mapped shared, here and, once
its descriptor is sent (:meth:`SharedBuffers.unsent`), in the writer process
(:class:`MappedBuffers`). Its memory goes back when both have unmapped it, whichever dies
first: nothing is left in ``/dev/shm``. A tensor staged into one travels as a
:class:`View` (which buffer, what shape), never as its bytes.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

__all__ = ["MappedBuffers", "SharedBuffers", "View"]


class View(NamedTuple):
    """A tensor that starts a shared buffer, as staging takes them (a tuple: it pickles
    small and fast)."""

    buffer: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _map(fd: int, nbytes: int) -> torch.Tensor:
    """The whole memory file ``fd`` as a shared uint8 tensor (page-aligned, as ``mmap`` is)."""
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)


class SharedBuffers:
    """The training process's side: allocates the buffers and describes tensors in them."""

    def __init__(self) -> None:
        if not hasattr(os, "memfd_create"):
            raise ValueError("background='process' needs Linux (memfd_create) for its buffers")
        self._by_ptr: dict[int, tuple[int, torch.Tensor]] = {}
        self._unsent: dict[int, tuple[int, int]] = {}
        self._freed: list[int] = []
        self._next = 0

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized 1-d ``dtype`` tensor of ``numel`` elements in a buffer of its own."""
        nbytes = max(numel, 1) * dtype.itemsize
        fd = os.memfd_create("torchrec-cnr-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            raw = _map(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        ident, self._next = self._next, self._next + 1
        self._by_ptr[raw.data_ptr()] = (ident, raw)
        self._unsent[ident] = (fd, nbytes)
        return raw.view(dtype)[:numel]

    def free(self, tensor: torch.Tensor) -> None:
        """Forgets the buffer of ``tensor`` (its memory goes once every view of it is gone)."""
        found = self._by_ptr.pop(tensor.untyped_storage().data_ptr(), None)
        if found is None:
            return
        unsent = self._unsent.pop(found[0], None)
        if unsent is not None:
            os.close(unsent[0])
        else:
            self._freed.append(found[0])

    def view(self, tensor: torch.Tensor) -> View | None:
        """Where ``tensor`` lies, or ``None`` unless it starts one of these buffers (the
        pool's tensors do; any other travels as its bytes)."""
        found = self._by_ptr.get(tensor.data_ptr()) if tensor.device.type == "cpu" else None
        if found is None:
            return None
        return View(found[0], tuple(tensor.shape), tensor.stride(), tensor.dtype)

    def unsent(self) -> list[tuple[int, int, int]]:
        """``(buffer, fd, bytes)`` of the buffers not yet sent; the caller sends each
        descriptor, then closes it."""
        out = [(ident, fd, nbytes) for ident, (fd, nbytes) in self._unsent.items()]
        self._unsent.clear()
        return out

    def freed(self) -> list[int]:
        """The buffers freed since the last call, which the other side may unmap."""
        out, self._freed = self._freed, []
        return out

    def close(self) -> None:
        for fd, _ in self._unsent.values():
            os.close(fd)
        self._unsent.clear()
        self._by_ptr.clear()


class MappedBuffers:
    """The writer process's side: the buffers it was sent, and the tensors views name."""

    def __init__(self) -> None:
        self._raw: dict[int, torch.Tensor] = {}

    def attach(self, ident: int, fd: int, nbytes: int) -> None:
        try:
            self._raw[ident] = _map(fd, nbytes)
        finally:
            os.close(fd)

    def forget(self, idents: list[int]) -> None:
        for ident in idents:
            self._raw.pop(ident, None)

    def tensor(self, view: View) -> torch.Tensor:
        raw = self._raw[view.buffer].view(view.dtype)
        return raw.as_strided(view.shape, view.stride)
