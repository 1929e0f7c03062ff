"""Lazy (copy-on-write) staging: ``save()`` returns before the rows are copied.

At ``save()`` only what is small is copied: each shard's bitmaps (which rows the
checkpoint holds), the kernels' step counters, the dense state and ``app_state``. The
rows are copied afterwards, into the same pooled buffers eager staging uses, by two
parties:

- the background writer (:meth:`LazyStaging.run`), in chunks, before it encodes them;
- the tracker's lookup hook (:class:`~torchrec_cnr.tracking.tracker.KernelLookups`),
  which copies the rows a batch looks up that are not staged yet, before the batch can
  update them: a fused optimizer updates a row only in the backward of a batch that
  looked it up, so every row still holds its value of the saved step until then.

Both claim a row before they copy it, so no row is copied twice or after its update:
on the CPU with atomic bit operations in a small C library (:mod:`.cow`), elsewhere (or
without the library) with torch under the kernel's lock, one chunk at a time. Where the
premise does not hold, a shard is staged eagerly instead (:func:`lazy_fallback` says
why). The checkpoint's bytes are the same either way.

On CUDA the copies gather on the device and land in pinned host memory. The background
copies run on a side stream, in chunks of about :data:`CUDA_CHUNK_BYTES` (each chunk ends
in one host sync), ordered after an event recorded at ``save()`` and after the lookup
hook's last copy, whose flags the chunk reads; the hook orders the training stream after
the side stream's queued copies before a batch can update the rows they read. The
copy-on-write path has run on a GPU (H100 and H200) without TorchRec's kernels (the
``gpu``-marked tests of ``tests/unit/test_staging.py``), and the whole manager over FBGEMM's
CUDA kernels ran once from outside the repository (issue 63); ``scripts/gpu_check.py`` is
the check in the repository, and the ordering of the streams has not run on a GPU since
it was written.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrec_cnr.rowcopy import put_rows
from torchrec_cnr.schema import stored_ids, stored_state, stored_weight
from torchrec_cnr.selection.policy import Decision
from torchrec_cnr.selection.rows import recorded_recent, stored_count
from torchrec_cnr.staging import cow
from torchrec_cnr.staging.plan import ShardPlan
from torchrec_cnr.staging.pool import StagingPool, bits_buffer, staged_claims, staged_flags
from torchrec_cnr.staging.shard import RecentBits, Sink, StagedShard, global_ids, ids_dtype
from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.shard import LocalShard

__all__ = ["LazyStaging", "lazy_fallback"]


CHUNK_ROWS = 16384
"""Rows the background copy takes per hold of a kernel's lock (torch path): a lookup waits
at most for one chunk's copy."""
CUDA_CHUNK_BYTES = 32 << 20
"""Bytes of a chunk of a CUDA shard, if more than :data:`CHUNK_ROWS` rows: each chunk
syncs the host once, so the chunks are larger there (a lookup waits at most a few ms)."""


def lazy_fallback(shard: LocalShard) -> str | None:
    """Why ``shard`` cannot be staged lazily; ``None`` if it can."""
    if shard.words is None or shard.lookups is None:
        return "its kernel has no fused optimizer, so an update may touch any row"
    if not shard.lookups.enabled:
        return "row tracking is disabled (RowTracker.set_enabled(False))"
    cache = getattr(shard.kernel.emb_module, "lxu_cache_weights", None)
    if isinstance(cache, torch.Tensor) and cache.numel() > 0:
        return "its kernel caches rows (UVM): a row may change in the cache, off the lookup"
    if shard.lookups.update_pending():
        return (
            "a batch was looked up and not yet updated (a pipeline that looks up ahead, "
            "such as TorchRec's TrainPipelineSemiSync, or save() between forward and backward)"
        )
    return None


@dataclass
class _Shard:
    """One shard staged lazily."""

    shard: LocalShard
    key: str
    selected: torch.Tensor | None
    """A copy of the bitmap of the rows the checkpoint holds; ``None``: every row."""
    before: torch.Tensor | None
    """Set bits in ``selected`` before each word (places a row in the buffers)."""
    weight: torch.Tensor
    states: dict[str, torch.Tensor]
    ids: torch.Tensor | None
    staged: torch.Tensor
    """Which buffer rows hold their row already: ``(n,)`` bool (torch path), or the
    claims of the compiled copier (see :func:`cow.claim_words`)."""
    scalars: dict[str, float]
    recent: torch.Tensor | None
    """A copy of the bitmap of rows changed since the last checkpoint, where the
    checkpoint records them apart from its rows (see ``select_recent``)."""
    recent_count: int
    """Its set bits: when they are all the rows the checkpoint holds, none are recorded."""
    tail: tuple[torch.Tensor, torch.Tensor, int] | None = None
    """Where a delta stores those rows last (see ``tail_order``): their bitmap, its set
    bits before each word, and the rows stored before them."""
    done: bool = False
    compiled: tuple[cow.Group, int] | None = None
    """The compiled copier's group of this shard's kernel and the shard's place in it."""

    @property
    def n(self) -> int:
        return self.weight.shape[0]

    def copy(self, rows: torch.Tensor, slots: torch.Tensor) -> int:
        """Copies local ``rows`` into buffer rows ``slots`` where not staged yet (under
        the kernel's lock); returns how many it copied."""
        fresh = ~self.staged[slots]
        if not bool(fresh.all()):
            rows, slots = rows[fresh], slots[fresh]
        if slots.numel() == 0:
            return 0
        host = slots.to(self.weight.device)
        for src, dst in self.pairs():
            picked = src.detach().index_select(0, rows)
            put_rows(dst, host, picked)
        self.staged[slots] = True
        return int(slots.numel())

    def copy_block(self, rows: torch.Tensor | None, a: int, b: int) -> None:
        """Copies buffer rows ``a:b`` (their local rows are ``rows[a:b]``, or ``a:b`` for
        a full save) where not staged yet (under the kernel's lock)."""
        block = self.staged[a:b]
        if bool(block.any()):
            slots = torch.arange(a, b, device=block.device)
            self.copy(slots if rows is None else rows[a:b], slots)
            return
        for src, dst in self.pairs():
            src = src.detach()
            if rows is None:
                dst[a:b].copy_(src[a:b])
            elif src.device == dst.device:
                torch.index_select(src, 0, rows[a:b], out=dst[a:b])
            else:
                dst[a:b].copy_(src.index_select(0, rows[a:b]))
        block.fill_(True)

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each live tensor of the shard with the buffer its rows are copied into."""
        live = self.shard
        return [(live.weight.detach(), self.weight)] + [
            (live.states[k].detach(), v) for k, v in self.states.items()
        ]


@dataclass
class LazyStaging:
    """The rows of one checkpoint still to be copied, for the shards staged lazily.

    Built at ``save()`` (:meth:`begin`); :meth:`run` copies what the hooks have not and
    hands each shard to the writer; :meth:`detach` stops the hooks (``run`` does it last).
    """

    shards: list[_Shard]
    hook_rows: int = 0
    """Rows the lookup hooks copied."""
    hook_s: float = 0.0
    """Seconds the lookup hooks spent copying (on the training thread)."""
    background_s: float = 0.0
    """Seconds :meth:`run` spent copying."""
    _rows_buffer: torch.Tensor | None = None
    _listeners: list[tuple[Any, Any]] = field(default_factory=list)
    _saved: Any = None
    """CUDA: an event recorded at ``save()`` on the training stream."""
    _stream: Any = None
    """CUDA: the side stream of the background copy."""
    _hooked: Any = None
    """CUDA: an event recorded after the lookup hook's last copy (and staged flags)."""

    @classmethod
    def begin(cls, plans: list[ShardPlan], decision: Decision, pool: StagingPool) -> LazyStaging:
        """Takes the buffers and copies of the bitmaps of the shards ``plans`` stage
        lazily, and starts the hooks; call with every lookup in the bitmaps
        (``shard.drain()``), before the bits restart."""
        staged = []
        lib = pool.copier
        for plan in plans:
            shard, key = plan.shard, plan.key
            selected = before = None
            n = shard.spec.rows
            if decision.kind != "full":
                assert shard.words is not None
                selected, before, n = _snapshot(pool, lib, key, "selected", shard.words)
                if stored_count(shard, n) is None:
                    selected = before = None
            recent = recorded_recent(shard, decision)
            tail = None
            recent_count = 0
            if selected is not None and recent is not None:
                last, last_before, recent_count = _snapshot(pool, lib, key, "recent", recent,
                                                            selected)  # fmt: skip
                tail = (last, last_before, n - recent_count)
                recent = last
            elif recent is not None:
                recent, _, recent_count = _snapshot(pool, lib, key, "recent", recent)
            weight = _take(pool, stored_weight(key), shard.weight, n)
            states = {k: _take(pool, stored_state(key, k), v, n) for k, v in shard.states.items()}
            ids = None if selected is None else pool.take(stored_ids(key), (n,), ids_dtype(shard))
            s = _Shard(shard, key, selected, before, weight, states, ids, torch.empty(0),
                       shard.scalar_states(), recent, recent_count, tail)  # fmt: skip
            staged.append(s)
        if lib is not None and not all(cow.supports(s.pairs()) for s in staged):
            lib = None  # on CUDA: torch copies them, under each kernel's lock
        for s in staged:  # the pool's flags were faulted in with its buffers
            if lib is not None:
                s.staged = pool.take(staged_claims(s.key), (cow.claim_words(s.n),), torch.int64)
            elif s.shard.weight.device.type == "cpu":
                s.staged = pool.take(staged_flags(s.key), (s.n,), torch.bool)
            else:  # beside the rows and the lookups' indices
                s.staged = torch.empty(s.n, dtype=torch.bool, device=s.shard.weight.device)
            s.staged.zero_()
        self = cls(staged)
        deltas = [s.n for s in staged if s.selected is not None]
        if lib is not None and deltas:  # one buffer, for each shard's copy in turn
            self._rows_buffer = pool.take("lazy/rows", (max(deltas),), torch.int64)
        if any(s.shard.weight.device.type == "cuda" for s in staged):
            self._saved = torch.cuda.Event()
            self._saved.record()
        by_kernel: dict[int, list[_Shard]] = {}
        for s in staged:
            by_kernel.setdefault(id(s.shard.lookups), []).append(s)
        try:  # an interrupt midway leaves no hook behind
            for group in by_kernel.values():
                lookups = group[0].shard.lookups
                assert lookups is not None
                if lib is not None:
                    compiled = cow.Group(lib, [_compiled_args(s) for s in group])
                    for i, s in enumerate(group):
                        s.compiled = (compiled, i)
                listener = self._listener(group)
                self._listeners.append((lookups, listener))
                lookups.subscribe(listener)
        except BaseException:
            self.detach()
            raise
        return self

    def buffers(self, shard: LocalShard) -> list[torch.Tensor]:
        """The buffers ``shard``'s rows, then its states, are copied into (in the order of
        its ``states``); they hold the saved step once :meth:`run` has returned."""
        s = next(s for s in self.shards if s.shard is shard)
        return [s.weight, *(s.states[k] for k in shard.states)]

    @property
    def nbytes(self) -> int:
        """Bytes the staged rows take (their ids included)."""
        total = 0
        for s in self.shards:
            tensors = [s.weight, *s.states.values()] + ([s.ids] if s.ids is not None else [])
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def _listener(self, group: list[_Shard]) -> Any:
        compiled = group[0].compiled

        def before_lookup(rows: torch.Tensor) -> None:
            began = time.perf_counter()
            if compiled is not None:
                self.hook_rows += compiled[0].lookup(rows)
                self.hook_s += time.perf_counter() - began
                return
            device = group[0].shard.weight.device
            if device.type == "cuda" and self._stream is not None:
                # The rows the side stream has queued copies of are read before this batch
                # (which may update them) runs.
                torch.cuda.current_stream(device).wait_stream(self._stream)
            for s in group:
                if s.done:
                    continue
                local = rows.to(s.shard.weight.device) - s.shard.lookup_base
                local = local[(local >= 0) & (local < s.shard.spec.rows)]
                if s.selected is None:
                    self.hook_rows += s.copy(local, local)
                    continue
                assert s.before is not None
                held, slots = bitmap.ranks(s.selected, s.before, local)
                if s.tail is not None:
                    last, last_before, stale = s.tail
                    is_last, t = bitmap.ranks(last, last_before, local)
                    slots = torch.where(is_last, stale + t, slots - t)
                self.hook_rows += s.copy(local[held], slots[held])
            if device.type == "cuda":  # the side stream's next chunk reads these flags
                self._hooked = torch.cuda.Event()
                self._hooked.record(torch.cuda.current_stream(device))
            self.hook_s += time.perf_counter() - began

        return before_lookup

    def run(self, sink: Sink) -> None:
        """Copies every row the hooks have not, shard by shard, handing each to ``sink``
        as soon as it is complete; then stops the hooks. Runs on the background writer."""
        try:
            for s in self.shards:
                began = time.perf_counter()
                if s.compiled is not None:  # rows are claimed one by one: no lock
                    group, i = s.compiled
                    rows = None if s.selected is None else self._rows(s)
                    group.stage(i, rows, s.ids, s.shard.spec.row_offset)
                else:
                    rows = None
                    if s.selected is not None:
                        rows = _stored_order(s).to(s.shard.weight.device)
                        if s.ids is not None:
                            global_ids(s.shard, rows, s.ids)
                    self._copy_chunks(s, rows)
                self.background_s += time.perf_counter() - began
                sink.add(self._staged(s))
                sink.start()
        finally:
            self.detach()

    def _copy_chunks(self, s: _Shard, rows: torch.Tensor | None) -> None:
        lookups = s.shard.lookups
        assert lookups is not None
        step = _chunk_rows(s)
        for a in range(0, s.n, step):
            lookups.yield_to_lookups()
            with lookups.lock, self._side_stream():
                s.copy_block(rows, a, min(a + step, s.n))
        with lookups.lock:
            s.done = True

    def _rows(self, s: _Shard) -> torch.Tensor:
        """A buffer for the local rows a delta of ``s`` stores (the compiled copy fills it)."""
        assert self._rows_buffer is not None
        return self._rows_buffer[: s.n]

    def _staged(self, s: _Shard) -> StagedShard:
        recent = None  # every stored row is recent: none recorded apart
        if s.recent is not None and s.recent_count != s.n:
            recent = RecentBits(s.recent, s.shard.spec.rows)
        tail = s.tail is not None and recent is not None
        return StagedShard(s.shard, s.key, s.ids, s.weight, s.states, s.scalars, 0, recent, tail)

    def _side_stream(self) -> Any:
        if self._saved is None:
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
            self._stream.wait_event(self._saved)  # updates enqueued before save() first
        if self._hooked is not None:  # called under the kernel's lock, as the hook runs
            self._stream.wait_event(self._hooked)
        return torch.cuda.stream(self._stream)

    def detach(self) -> None:
        """Stops the lookup hooks copying rows (idempotent)."""
        listeners, self._listeners = self._listeners, []
        for lookups, listener in listeners:
            lookups.unsubscribe(listener)


def _chunk_rows(s: _Shard) -> int:
    """Rows of one chunk of the background copy of ``s``."""
    if s.shard.weight.device.type != "cuda":
        return CHUNK_ROWS
    row_bytes = sum(dst[:1].numel() * dst.element_size() for _, dst in s.pairs())
    return max(CHUNK_ROWS, CUDA_CHUNK_BYTES // max(row_bytes, 1))


def _stored_order(s: _Shard) -> torch.Tensor:
    """The local rows a delta stores, in the order it stores them (see ``tail_order``)."""
    assert s.selected is not None
    if s.tail is None:
        return bitmap.to_indices(s.selected, s.shard.spec.rows)
    last = s.tail[0]
    stale = bitmap.to_indices(s.selected & ~last, s.shard.spec.rows)
    return torch.cat([stale, bitmap.to_indices(last, s.shard.spec.rows)])


def _compiled_args(s: _Shard) -> cow.Rows:
    selected = None
    if s.selected is not None:
        assert s.before is not None
        selected = (s.selected, s.before)
    rows, base = s.shard.spec.rows, s.shard.lookup_base
    return cow.Rows(s.pairs(), rows, base, selected, s.staged, s.tail)


def _snapshot(
    pool: StagingPool,
    lib: Any,
    key: str,
    name: str,
    words: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A copy of bitmap ``words`` (``& mask``) at the save, the set bits before each of its
    words, and its set bits: one pass into pooled buffers (see :func:`cow.snapshot_bits`)."""
    shape = tuple(words.shape)
    bits = pool.take(bits_buffer(key, name), shape, words.dtype, words.device)
    before = pool.take(bits_buffer(key, f"{name}/before"), shape, torch.int64, words.device)
    return bits, before, cow.snapshot_bits(lib, words, mask, bits, before)


def _take(pool: StagingPool, key: str, like: torch.Tensor, n: int) -> torch.Tensor:
    return pool.take(key, (n, *like.shape[1:]), like.dtype)
