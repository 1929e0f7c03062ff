"""Records which embedding rows each rank's shards modify (Check-N-Run, NSDI'22, Sec. 4.2).

A :class:`RowTracker` hangs on one sharded embedding module
(``ShardedEmbeddingBagCollection`` or ``ShardedEmbeddingCollection``). It
registers a forward pre-hook on every TBE kernel module inside the module's
lookups. The hook receives the ``KeyedJaggedTensor`` of ids *after* input
distribution, so the ids are already shard-local row offsets for every sharding
type (row-wise sharding bucketizes them; table- and column-wise shards hold all
rows). With a fused sparse optimizer a row changes exactly when it is looked
up, so setting its bit is enough.

Kernels that are not fused (their optimizer is the user's dense one, which may
touch every row) are reported as fully modified. Data-parallel tables are
replicated plain tensors and travel with the dense state instead.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from torchrec_cnr import shutdown
from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.lookups import KernelLookups
from torchrec_cnr.tracking.priority import KernelPriority, check_ssu_rate
from torchrec_cnr.tracking.shard import LocalShard, ShardSpec, optimizer_state_names

__all__ = ["TRACKER_ATTR", "TRACKING_MODES", "DeltaFeed", "RowTracker", "TrackingMode"]

TRACKER_ATTR = "_cnr_tracker"
TrackingMode = Literal["bitmap", "mfu", "ssu"]
TRACKING_MODES: tuple[TrackingMode, ...] = ("bitmap", "mfu", "ssu")
"""``bitmap``: modified rows only; ``mfu``/``ssu``: also CPR's priority of each row."""


def _unwrap(module: Any) -> Any:
    # Data-parallel lookups are wrapped in DistributedDataParallel.
    return module.module if hasattr(module, "module") else module


class _Marker:
    """Sets bits on a worker thread, off the training thread's critical path.

    Torch ops release the GIL, so the sort behind :func:`bitmap.set_bits` runs
    while the training thread waits in collectives or runs Python. Readers
    call :meth:`drain` first; the queue is bounded so memory cannot grow. The
    thread starts with the first batch and stops in :meth:`close`; a later batch
    starts it again.
    """

    _STOP = object()

    def __init__(self, max_pending: int = 16) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0
        self._max_pending = max_pending
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, work: Callable[[], None]) -> None:
        with self._cv:
            if self._pending >= self._max_pending:
                self._cv.wait_for(lambda: self._pending < self._max_pending)
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cnr-tracker", daemon=True)
                self._thread.start()
                shutdown.register(self)
        self._queue.put(work)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is self._STOP:
                return
            try:
                work()
            except BaseException as e:  # surfaced by drain(), never swallowed
                self._error = e
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()

    def drain(self) -> None:
        """Blocks until every submitted batch is in the bitmaps."""
        with self._cv:
            self._cv.wait_for(lambda: self._pending == 0)
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("row tracking failed") from error

    def close(self) -> None:
        """Drains, then stops the thread."""
        self.drain()
        self.stop_thread()

    def stop_thread(self) -> None:
        """Stops the thread once its queued batches are marked (see :mod:`torchrec_cnr.shutdown`)."""
        with self._cv:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(self._STOP)
            thread.join()
        shutdown.unregister(self)


class _KernelHook:
    """Forward pre-hook of one TBE kernel module: sets the bits of looked-up rows, and
    records their priority when the kernel keeps one."""

    def __init__(
        self,
        words: torch.Tensor,
        recent: torch.Tensor,
        key_base: torch.Tensor,
        marker: _Marker | None,
        priority: KernelPriority | None,
        fed: bool = False,
    ) -> None:
        self.lookups = KernelLookups()
        self.fed = fed
        self.words = words
        self.recent = recent
        self.key_base = key_base
        self.marker = marker
        self.priority = priority
        # A kernel holding one table needs no per-key offset into its bitmap.
        self.single_table = bool((key_base == 0).all())

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        features = args[0] if args else kwargs["features"]
        values = features.values()
        if values.numel() == 0:
            return
        rows = values.to(torch.int64)
        if not self.single_table:
            lengths = features.lengths().to(torch.int64)
            if features.variable_stride_per_key():
                strides = torch.tensor(features.stride_per_key(), device=lengths.device)
                per_sample = self.key_base.repeat_interleave(strides)
                rows = rows + per_sample.repeat_interleave(lengths, output_size=rows.numel())
            else:
                # Values of one key are contiguous: offsets repeat per key, not per sample.
                per_key = lengths.view(len(self.key_base), -1).sum(1)
                rows = rows + self.key_base.repeat_interleave(per_key, output_size=rows.numel())
        self.lookups.before(rows)
        if self.fed:
            return  # TorchRec's delta tracker records the rows (:class:`DeltaFeed`)
        if self.marker is None:
            self._record(rows)
        else:
            # The KJT's values may be reused by TorchRec; hand the worker its own tensor.
            mine = rows if rows is not values else rows.clone()
            self.marker.submit(lambda: self._record(mine))

    def after(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """Forward hook: counts lookups whose backward (and update) is still to come."""
        self.lookups.after(output)

    def _record(self, rows: torch.Tensor) -> None:
        bitmap.set_bits_in_both(self.words, self.recent, rows)
        if self.priority is not None:
            self.priority.record(rows)


@dataclass
class _TableEntry:
    """One table of one kernel, as this rank holds it."""

    table: Any
    """TorchRec's ``ShardedEmbeddingTable`` config."""
    index: int
    """Its position among the kernel's tables."""
    kernel: Any
    words: torch.Tensor | None
    """Its view into the kernel's bitmap; ``None`` when every row counts as modified."""
    recent: torch.Tensor | None
    """Its view into the kernel's bitmap of rows modified since the last checkpoint."""
    first_word: int
    """Where that view starts in the kernel's bitmap (and priority)."""
    lookups: KernelLookups | None = None
    """The kernel's lookups, for lazy staging (``None`` for a kernel without bitmap)."""


class DeltaFeed:
    """Modified rows from TorchRec's own ``ModelDeltaTracker`` (``TrackingMode.ID_ONLY``),
    read as one consumer of it, :data:`CONSUMER`, into the bitmaps of every shard.

    The tracker records the ids each sharded module looked up after input distribution,
    shard-local rows for every sharding type, per table (``sparse.ebc.embedding_bags.t0``),
    and ``DistributedModelParallel.forward`` steps it. :meth:`drain` reads the ids this
    consumer has not read yet and sets their bits; it reads on the thread that built the
    feed only (the tracker's store is appended to by that thread's forward), elsewhere it
    leaves them for the next drain there.

    Raises:
        ValueError: the tracker does not track ids only, or has no :data:`CONSUMER`.
    """

    CONSUMER = "torchrec_cnr"

    def __init__(self, tracker: Any) -> None:
        consumers = getattr(tracker, "per_consumer_batch_idx", {})
        if self.CONSUMER not in consumers:
            raise ValueError(
                f"TorchRec's delta tracker has the consumers {sorted(consumers)}: the "
                f"checkpoint manager reads it as a consumer of its own; add "
                f"{self.CONSUMER!r} to DeltaTrackerConfig(consumers=[...])"
            )
        mode = getattr(getattr(tracker, "_mode", None), "name", "ID_ONLY")
        if mode != "ID_ONLY":
            raise ValueError(f"TorchRec's delta tracker tracks {mode}: use TrackingMode.ID_ONLY")
        self.tracker = tracker
        self._owner = threading.get_ident()
        self._targets: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def add(self, fqn: str, words: torch.Tensor, recent: torch.Tensor) -> None:
        """The bitmaps of one shard of table ``fqn``."""
        self._targets.setdefault(fqn, []).append((words, recent))

    def drain(self) -> None:
        if threading.get_ident() != self._owner:
            return
        since = self.tracker.per_consumer_batch_idx[self.CONSUMER]
        if self.tracker.curr_batch_idx < since:
            return  # no batch since the last read
        # TorchRec's store cannot read a table that has no lookup since the last read (its
        # hooks were off, say): such a table gets an empty one.
        store = self.tracker.store
        for fqn, lookups in list(store.per_fqn_lookups.items()):
            if not any(lookup.batch_idx >= since for lookup in lookups):
                targets = self._targets.get(fqn)  # the lookups ran where the shard is
                device = (lookups[-1].ids.device if lookups
                          else targets[0][0].device if targets else torch.device("cpu"))  # fmt: skip
                none = torch.empty(0, dtype=torch.int64, device=device)
                store.append(batch_idx=self.tracker.curr_batch_idx, fqn=fqn, ids=none)
        for fqn, ids in self.tracker.get_unique_ids(self.CONSUMER).items():
            for words, recent in self._targets.get(fqn, ()):
                bitmap.set_bits_in_both(words, recent, ids.to(words.device, torch.int64))


class RowTracker:
    """Modified-row bitmaps of every local shard of one sharded embedding module.

    Args:
        sharded: a ``ShardedEmbeddingBagCollection`` or ``ShardedEmbeddingCollection``.
        sharding_types: table name -> sharding type, from the module's plan.
        rank: this rank.
        mode: ``bitmap``, or ``mfu``/``ssu`` to also keep CPR's row priorities.
        ssu_rate: the sampled share of lookups for ``ssu``.
        feed: take the modified rows from TorchRec's ``ModelDeltaTracker`` (the kernels'
            hooks then only serve copy-on-write), under the module's path ``feed_prefix``.

    Example::

        tracker = RowTracker(sharded_ebc, {"t0": "table_wise"}, rank=0)
        model(batch).backward()
        for shard in tracker.shards("sparse.ebc"):
            print(shard.spec.table, shard.modified_mask().sum())
    """

    def __init__(
        self,
        sharded: nn.Module,
        sharding_types: dict[str, str],
        rank: int,
        mode: TrackingMode = "bitmap",
        ssu_rate: float = 0.1,
        feed: DeltaFeed | None = None,
        feed_prefix: str = "",
    ) -> None:
        if feed is not None and mode != "bitmap":
            raise ValueError(f"TorchRec's delta tracker gives modified rows only: mode {mode!r}")
        if mode not in TRACKING_MODES:
            raise ValueError(f"tracking mode must be one of {TRACKING_MODES}, got {mode!r}")
        if mode == "ssu":
            check_ssu_rate(ssu_rate)
        self.mode = mode
        self._ssu_rate = ssu_rate
        self._rank = rank
        # Where the unsharded module keeps its tables: EmbeddingBagCollection.embedding_bags
        # or EmbeddingCollection.embeddings.
        self._container = "embedding_bags" if hasattr(sharded, "embedding_bags") else "embeddings"
        self._sharding_types = dict(sharding_types)
        # (table config, its index in the kernel, kernel, bitmap view or None, first word)
        self._entries: list[_TableEntry] = []
        self._priorities: dict[int, KernelPriority] = {}
        self._handles: list[Any] = []
        self._hooks: list[tuple[Any, _KernelHook]] = []
        self._marker: _Marker | None = None
        self._words: list[torch.Tensor] = []
        self._feed, self._feed_prefix = feed, feed_prefix
        for lookup in getattr(sharded, "_lookups", []):
            for kernel in getattr(_unwrap(lookup), "_emb_modules", []):
                self._track_kernel(kernel)

    def sharded_tables(self, prefix: str = "") -> set[str]:
        """Fully qualified names of the module's row-tracked tables, on every rank (data
        parallel ones are dense state)."""
        return {
            f"{prefix}.{name}" if prefix else name
            for name, kind in self._sharding_types.items()
            if kind != "data_parallel"
        }

    def _track_kernel(self, kernel: Any) -> None:
        config = kernel.config
        tables = list(config.embedding_tables)
        if any(t.local_metadata is None for t in tables):
            return  # data parallel: replicated, saved with the dense state
        emb = kernel.emb_module
        fused = hasattr(emb, "split_optimizer_states") and hasattr(kernel, "fused_optimizer")
        if not fused:
            for i in range(len(tables)):
                self._entries.append(_TableEntry(tables[i], i, kernel, None, None, 0))
            return
        # One flat bitmap per kernel; each table starts on a word boundary so
        # that its bits are a plain slice of the flat tensor.
        word_starts, total = [], 0
        for t in tables:
            word_starts.append(total)
            total += bitmap.num_words(t.local_rows)
        device = next(iter(emb.split_embedding_weights()), torch.empty(0)).device
        words = torch.zeros(total, dtype=torch.int64, device=device)
        # Rows modified since the last checkpoint, whatever the policy: what a serving
        # follower must read to catch up by one checkpoint.
        recent = torch.zeros(total, dtype=torch.int64, device=device)
        self._words += [words, recent]
        key_base = torch.tensor(
            [word_starts[i] * 64 for i, t in enumerate(tables) for _ in range(t.num_features())],
            dtype=torch.int64,
            device=device,
        )
        if device.type == "cpu" and self._marker is None and self._feed is None:
            self._marker = _Marker()
        priority = None
        if self.mode != "bitmap":
            priority = KernelPriority(self.mode, total, device, self._ssu_rate)
            self._priorities[id(kernel)] = priority
        marker = self._marker if device.type == "cpu" else None
        hook = _KernelHook(words, recent, key_base, marker, priority, fed=self._feed is not None)
        self._hooks.append((kernel, hook))
        self._handles += _install(kernel, hook)
        for i, t in enumerate(tables):
            span = slice(word_starts[i], word_starts[i] + bitmap.num_words(t.local_rows))
            self._entries.append(
                _TableEntry(t, i, kernel, words[span], recent[span], word_starts[i], hook.lookups)
            )
            if self._feed is not None:
                fqn = ".".join(p for p in (self._feed_prefix, self._container, t.name) if p)
                self._feed.add(fqn, words[span], recent[span])

    def drain(self) -> None:
        """Waits until every looked-up row so far is in the bitmaps."""
        if self._marker is not None:
            self._marker.drain()
        if self._feed is not None:
            self._feed.drain()

    def close(self) -> None:
        """Stops the thread that sets bits, once every looked-up row is in the bitmaps;
        tracking goes on, and the thread starts again with the next batch."""
        if self._marker is not None:
            self._marker.close()

    def shards(self, prefix: str = "") -> list[LocalShard]:
        """The local shards with live views into weights, optimizer states and bitmaps.

        Args:
            prefix: module path of the sharded module inside the user's model;
                table names are qualified with it.
        """
        out = []
        weights_cache: dict[int, list[torch.Tensor]] = {}
        states_cache: dict[int, list[list[torch.Tensor]]] = {}
        for entry in self._entries:
            table, index, kernel, words = entry.table, entry.index, entry.kernel, entry.words
            emb = kernel.emb_module
            key = id(kernel)
            if key not in weights_cache:
                weights_cache[key] = list(kernel.split_embedding_weights())
                # EXACT_SGD keeps no state: FBGEMM returns [] rather than one [] per table.
                per_table = emb.split_optimizer_states() if words is not None else []
                states_cache[key] = per_table or [[] for _ in weights_cache[key]]
            meta = table.local_metadata
            rows, cols = int(meta.shard_sizes[0]), int(meta.shard_sizes[1])
            spec = ShardSpec(
                table=f"{prefix}.{table.name}" if prefix else table.name,
                rank=self._rank,
                sharding=self._sharding_types.get(table.name, "unknown"),
                row_offset=int(meta.shard_offsets[0]),
                col_offset=int(meta.shard_offsets[1]),
                rows=rows,
                cols=cols,
                num_embeddings=int(table.num_embeddings),
                embedding_dim=int(table.embedding_dim),
                state_dict_key=".".join(
                    p for p in (prefix, self._container, table.name, "weight") if p
                ),
            )
            states = {}
            if words is not None:
                found = states_cache[key][index]
                names = optimizer_state_names(emb)
                if len(names) != len(found):  # an FBGEMM whose order we do not know
                    names = [f"state{j}" for j in range(len(found))]
                for name, state in zip(names, found):
                    assert state.shape[0] == rows, (name, state.shape, rows)
                    states[name] = state
            optimizer = emb.optimizer.name if words is not None else "dense"
            weight = weights_cache[key][index]
            assert weight.shape == (rows, cols), (weight.shape, rows, cols)
            kernel_priority = self._priorities.get(key)
            priority = (
                None if kernel_priority is None else kernel_priority.table(entry.first_word, rows)
            )
            out.append(
                LocalShard(
                    spec,
                    weight,
                    states,
                    optimizer,
                    words,
                    kernel,
                    priority,
                    self.drain,
                    entry.recent,
                    entry.lookups,
                    entry.first_word * 64,
                )
            )
        return out

    def clear(self) -> None:
        """Clears every bit."""
        self.drain()
        for words in self._words:
            words.zero_()

    def memory_bytes(self) -> int:
        """Bytes held by the bitmaps."""
        return sum(w.numel() * w.element_size() for w in self._words)

    def set_enabled(self, enabled: bool) -> None:
        """Removes (``False``) or re-installs (``True``) the hooks; while removed, bits stop changing.

        A checkpoint taken while tracking is off misses the rows modified meanwhile.

        Raises:
            RuntimeError: disabling while a checkpoint's rows are still being copied lazily.
        """
        if not enabled and any(hook.lookups.listened for _, hook in self._hooks):
            raise RuntimeError(
                "a checkpoint's rows are still being copied (lazy staging), which needs the "
                "lookup hooks: call CheckpointManager.wait() before disabling tracking"
            )
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for kernel, hook in self._hooks:
            hook.lookups.enabled = enabled
            if enabled:
                self._handles += _install(kernel, hook)


def _install(kernel: nn.Module, hook: _KernelHook) -> list[Any]:
    return [
        kernel.register_forward_pre_hook(hook, with_kwargs=True),
        kernel.register_forward_hook(hook.after, with_kwargs=True),
    ]
