"""Host buffers that staging copies into, reused across checkpoints within a byte budget.

Fresh host memory costs a page fault per 4 KiB on first touch, which would double a
save's copy: the pool keeps its buffers between checkpoints and faults a full
checkpoint's in when the manager is built (:meth:`StagingPool.prefault`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from torchrec_cnr.schema import shard_key, stored_state, stored_weight
from torchrec_cnr.snapshot import page_aligned
from torchrec_cnr.staging import cow
from torchrec_cnr.staging.shared import SharedBuffers
from torchrec_cnr.tracking.shard import LocalShard


class StagingPool:
    """Host buffers keyed by role, reused across checkpoints within a byte budget.

    Args:
        budget_bytes: most bytes the pool holds; ``None`` for no limit.
        pin: allocate page-locked memory (CUDA sources only), so device-to-host
            copies run asynchronously at full bandwidth.
        compiled: lazy staging claims CPU rows with the compiled copier where it is
            built (``IOOptions.compiled_staging``), whose claim words the pool holds.
        shared: host buffers come from there, for the writer process to map
            (``background="process"``); they are not page-locked.
    """

    def __init__(
        self,
        budget_bytes: int | None = None,
        pin: bool = False,
        compiled: bool = True,
        shared: SharedBuffers | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.pin = pin
        self.shared = shared
        self.copier = cow.library(compiled)
        """The compiled copier lazy staging uses, or ``None`` (torch copies, under a lock)."""
        self._buffers: dict[str, torch.Tensor] = {}
        self._in_use: set[str] = set()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def begin(self) -> None:
        """A new checkpoint: buffers it does not take may be given up for ones it does."""
        self._in_use.clear()

    def take(
        self,
        key: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """A contiguous ``shape`` tensor whose storage may be reused by the next checkpoint;
        on the host unless ``device`` says otherwise (a CUDA shard's bitmaps)."""
        numel = 1
        for d in shape:
            numel *= d
        self._in_use.add(key)
        buf = self._buffers.get(key)
        if buf is not None and buf.dtype == dtype and buf.numel() >= numel:
            if device is None or buf.device == device:
                return buf[:numel].view(shape)
        if device is not None and device.type != "cpu":
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
            return buf.view(shape)
        self._drop(key)
        # Without a budget, grow with headroom: deltas grow from one checkpoint to the
        # next. Within one, take exactly what is asked: the buffers a checkpoint takes
        # after this one need the rest of the budget (stage() sizes chunks to fit it).
        want = numel if self.budget_bytes is not None else int(numel * 1.25)
        if self.budget_bytes is not None:
            for stale in [k for k in self._buffers if k not in self._in_use]:
                if self.nbytes + want * dtype.itemsize <= self.budget_bytes:
                    break
                self._drop(stale)
        if self.shared is not None:
            buf = self.shared.allocate(want, dtype)
        else:
            buf = page_aligned(want, dtype, self.pin)
        self._buffers[key] = buf
        return buf[:numel].view(shape)

    def _drop(self, key: str) -> None:
        buf = self._buffers.pop(key, None)
        if buf is not None and self.shared is not None:
            self.shared.free(buf)

    def release(self) -> None:
        """Gives every buffer back; the next checkpoint allocates afresh."""
        for key in list(self._buffers):
            self._drop(key)
        self._in_use.clear()

    def prefault(
        self, shards: list[LocalShard], dense: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Allocates and touches the buffers a full checkpoint of ``shards`` and ``dense``
        will take."""
        self.begin()
        compiled = self.copier is not None
        for key, shape, dtype in _buffers_of(shards, self.budget_bytes, compiled):
            self.take(key, shape, dtype).zero_()
        for name, tensor in (dense or {}).items():
            self.take(dense_buffer(name), tuple(tensor.shape), tensor.dtype).zero_()
        # The copies of the bitmaps a save takes on the training thread (see BITS).
        for i, shard in enumerate(shards):
            for bits, names in ((shard.words, BITS[:3]), (shard.recent, BITS[3:])):
                if bits is None:
                    continue
                for name in names:
                    dtype = torch.int64 if name.endswith("before") else bits.dtype
                    key = bits_buffer(shard_key(i), name)
                    self.take(key, tuple(bits.shape), dtype, bits.device).zero_()


BITS = ("selected", "selected/before", "cleared", "recent", "recent/before", "recent_cleared")
"""The copies a save takes of a shard's bitmaps, under :func:`bits_buffer`: the rows a
delta selects and the set bits before each word (lazy staging), what ``restart_bits``
clears (put back if the checkpoint fails), and the same of the rows modified since the
previous checkpoint."""


def bits_buffer(key: str, name: str) -> str:
    """The pool key of the copy ``name`` (one of :data:`BITS`) of shard ``key``'s bitmaps."""
    return f"{key}/bits/{name}"


def dense_buffer(name: str) -> str:
    """The pool key of a dense tensor's host copy."""
    return f"dense/{name}"


def staged_flags(key: str) -> str:
    """The pool key of a lazily staged shard's row flags (one bool per row: copied yet?),
    where torch copies its rows."""
    return f"{key}/staged"


def staged_claims(key: str) -> str:
    """The pool key of a lazily staged shard's claims (two bits per row: claimed, copied),
    where the compiled copier copies its rows (see :mod:`~torchrec_cnr.staging.cow`)."""
    return f"{key}/claims"


def staging_bytes(shards: list[LocalShard], counts: list[int | None]) -> int:
    """Bytes of staging buffers a save of ``counts`` rows of each shard takes (every row,
    without ids, where ``None``): the one rule that decides whether it fits the budget."""
    return sum(
        (s.spec.rows if n is None else n) * s.row_bytes(n is not None)
        for s, n in zip(shards, counts)
    )


def chunk_rows(shard: LocalShard, with_ids: bool, budget: int | None) -> int | None:
    """Rows per chunk within ``budget``; ``None`` for no chunking."""
    return None if budget is None else max(1, budget // shard.row_bytes(with_ids))


def _buffers_of(
    shards: list[LocalShard], budget: int | None, compiled: bool
) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """The pool buffers a full checkpoint takes: one set per shard (with the row flags or
    claims of lazy staging), or one chunk set (chunks are staged eagerly)."""
    chunked = budget is not None and staging_bytes(shards, [None] * len(shards)) > budget
    for i, s in enumerate(shards):
        rows = min(s.spec.rows, chunk_rows(s, False, budget) or s.spec.rows)
        key = "chunk" if chunked else shard_key(i)
        yield stored_weight(key), (rows, *s.weight.shape[1:]), s.weight.dtype
        for name, state in s.states.items():
            yield stored_state(key, name), (rows, *state.shape[1:]), state.dtype
        if not chunked and compiled and s.weight.device.type == "cpu":
            yield staged_claims(key), (cow.claim_words(rows),), torch.int64
        elif not chunked:
            yield staged_flags(key), (rows,), torch.bool
