"""Records which embedding rows each rank's shards modify.

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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchrec_cnr.tracking import bitmap

__all__ = [
    "SCALAR_STATES",
    "TRACKER_ATTR",
    "TRACKING_MODES",
    "LocalShard",
    "RowTracker",
    "ShardSpec",
    "optimizer_state_names",
]

TRACKER_ATTR = "_cnr_tracker"
TRACKING_MODES = ("bitmap", "mfu", "ssu")

SCALAR_STATES = ("iter", "max_counter")
"""One-element buffers of an FBGEMM TBE that its optimizers read besides the per-row states:
the step counter (Adam's and LAMB's bias correction, counter and global weight decay) and
the largest row counter (counter weight decay)."""

# Optimizers whose TBE keeps a second moment (``momentum2``).
_SECOND_MOMENT = {
    "ADAM",
    "PARTIAL_ROWWISE_ADAM",
    "LAMB",
    "PARTIAL_ROWWISE_LAMB",
    "ENSEMBLE_ROWWISE_ADAGRAD",
}


def optimizer_state_names(emb: Any) -> list[str]:
    """Names of the per-table states ``emb.split_optimizer_states()`` returns, in its order.

    FBGEMM returns, for each table, ``momentum1`` (every optimizer but EXACT_SGD), then
    ``momentum2`` (Adam and LAMB variants), ``prev_iter`` (row-wise Adagrad with counter or
    global weight decay) and ``row_counter`` (counter weight decay, Adam with row-wise bias
    correction). The names are FBGEMM's own buffer prefixes.
    """
    optimizer = emb.optimizer.name
    counter = bool(getattr(emb, "_used_rowwise_adagrad_with_counter", False))
    global_decay = bool(getattr(emb, "_used_rowwise_adagrad_with_global_weight_decay", False))
    names = []
    if optimizer != "EXACT_SGD":
        names.append("momentum1")
    if optimizer in _SECOND_MOMENT:
        names.append("momentum2")
    if counter or global_decay:
        names.append("prev_iter")
    if counter or (optimizer == "ADAM" and getattr(emb, "use_rowwise_bias_correction", False)):
        names.append("row_counter")
    return names


@dataclass(frozen=True)
class ShardSpec:
    """Where one table shard lives; the unit the manifest describes."""

    table: str
    """Fully qualified table name, e.g. ``sparse_arch.ebc.t_user``."""
    rank: int
    """Rank holding the shard."""
    sharding: str
    """TorchRec sharding type, e.g. ``table_wise``."""
    row_offset: int
    """First global row of the shard."""
    col_offset: int
    """First global column of the shard."""
    rows: int
    """Rows in the shard."""
    cols: int
    """Columns in the shard."""
    num_embeddings: int
    """Rows of the whole table."""
    embedding_dim: int
    """Columns of the whole table."""

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, raw: dict[str, object]) -> ShardSpec:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__})  # type: ignore[arg-type]


@dataclass
class LocalShard:
    """A shard held by this rank, with live views into its kernel's memory."""

    spec: ShardSpec
    weight: torch.Tensor
    """``(rows, cols)`` view of the kernel's weights."""
    states: dict[str, torch.Tensor]
    """Fused optimizer states by FBGEMM name: per row ``(rows,)`` (row-wise Adagrad's
    ``momentum1``, ``prev_iter``, ``row_counter``) or per element ``(rows, cols)`` (Adagrad's and
    Adam's moments)."""
    optimizer: str
    """Name of the fused optimizer, or ``"dense"`` when the kernel is not fused."""
    words: torch.Tensor | None
    """``(ceil(rows / 64),)`` int64 modified-row bitmap; ``None`` means every row counts as modified."""
    kernel: Any = field(repr=False)
    """The TBE kernel module; staging flushes it."""
    priority: torch.Tensor | None = None
    """CPR priority: ``(rows,)`` int32 access counts (MFU) or an int64 bitmap of sampled rows (SSU)."""
    drain: Callable[[], None] = field(repr=False, default=lambda: None)
    """Waits until pending lookups are in ``words``; call before reading or writing them."""

    def scalar_states(self) -> dict[str, float]:
        """The kernel's one-element optimizer buffers (:data:`SCALAR_STATES`) that it has."""
        if self.words is None:
            return {}
        emb = self.kernel.emb_module
        found = {}
        for name in SCALAR_STATES:
            value = getattr(emb, name, None)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                found[name] = value.item()
        return found

    def load_scalar_states(self, values: dict[str, float]) -> None:
        """Writes :meth:`scalar_states` back into the kernel."""
        emb = self.kernel.emb_module
        for name, value in values.items():
            buffer = getattr(emb, name, None)
            if isinstance(buffer, torch.Tensor) and buffer.numel() == 1:
                buffer.fill_(value)
        if "iter" in values and isinstance(getattr(emb, "iter_cpu", None), torch.Tensor):
            # The TBE copies iter into iter_cpu only while iter_cpu is 0, i.e. in a fresh
            # kernel; a live one would go on counting from its own value.
            emb.iter_cpu.fill_(int(values["iter"]))

    def modified_mask(self) -> torch.Tensor:
        """``(rows,)`` bool mask of rows modified since the bits were last cleared."""
        self.drain()
        if self.words is None:
            return torch.ones(self.spec.rows, dtype=torch.bool, device=self.weight.device)
        return bitmap.to_mask(self.words, self.spec.rows)


def _unwrap(module: Any) -> Any:
    # Data-parallel lookups are wrapped in DistributedDataParallel.
    return module.module if hasattr(module, "module") else module


class _Marker:
    """Sets bits on a worker thread, off the training thread's critical path.

    Torch ops release the GIL, so the sort behind :func:`bitmap.set_bits` runs
    while the training thread waits in collectives or runs Python. Readers
    call :meth:`drain` first; the queue is bounded so memory cannot grow.
    """

    def __init__(self, max_pending: int = 16) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._pending = 0
        self._max_pending = max_pending
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="cnr-tracker", daemon=True).start()

    def submit(self, work: Callable[[], None]) -> None:
        with self._cv:
            if self._pending >= self._max_pending:
                self._cv.wait_for(lambda: self._pending < self._max_pending)
            self._pending += 1
        self._queue.put(work)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
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


class _KernelHook:
    """Forward pre-hook of one TBE kernel module: sets the bits of looked-up rows.

    With ``mode="mfu"`` it also counts every access per row; with ``"ssu"`` it
    sets a second bitmap from a random subsample of the ids (rate ``ssu_rate``).
    """

    def __init__(
        self,
        words: torch.Tensor,
        key_base: torch.Tensor,
        marker: _Marker | None,
        priority: torch.Tensor | None = None,
        mode: str = "bitmap",
        ssu_rate: float = 0.0,
    ) -> None:
        self.words = words
        self.key_base = key_base
        self.marker = marker
        self.priority = priority
        self.mode = mode
        self.ssu_rate = ssu_rate
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
        if self.marker is None:
            self._record(rows)
        else:
            # The KJT's values may be reused by TorchRec; hand the worker its own tensor.
            mine = rows if rows is not values else rows.clone()
            self.marker.submit(lambda: self._record(mine))

    def _record(self, rows: torch.Tensor) -> None:
        bitmap.set_bits(self.words, rows)
        if self.mode == "mfu":
            assert self.priority is not None
            self.priority.index_add_(0, rows, torch.ones_like(rows, dtype=self.priority.dtype))
        elif self.mode == "ssu":
            assert self.priority is not None
            sampled = rows[torch.rand(rows.numel(), device=rows.device) < self.ssu_rate]
            bitmap.set_bits(self.priority, sampled)


class RowTracker:
    """Modified-row bitmaps of every local shard of one sharded embedding module.

    Args:
        sharded: a ``ShardedEmbeddingBagCollection`` or ``ShardedEmbeddingCollection``.
        sharding_types: table name -> sharding type, from the module's plan.
        rank: this rank.

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
        mode: str = "bitmap",
        ssu_rate: float = 0.1,
    ) -> None:
        if mode not in TRACKING_MODES:
            raise ValueError(f"tracking mode must be one of {TRACKING_MODES}, got {mode!r}")
        if mode == "ssu" and not 0 < ssu_rate <= 1:
            raise ValueError(f"ssu_rate must be in (0, 1], got {ssu_rate}")
        self.mode = mode
        self._ssu_rate = ssu_rate
        self._priority: dict[tuple[int, int], torch.Tensor] = {}
        self._rank = rank
        self._sharding_types = dict(sharding_types)
        self._entries: list[tuple[Any, int, Any, torch.Tensor | None]] = []
        self._handles: list[Any] = []
        self._hooks: list[tuple[Any, _KernelHook]] = []
        self._marker: _Marker | None = None
        self._words: list[torch.Tensor] = []
        for lookup in getattr(sharded, "_lookups", []):
            for kernel in getattr(_unwrap(lookup), "_emb_modules", []):
                self._track_kernel(kernel)

    def _track_kernel(self, kernel: Any) -> None:
        config = kernel.config
        tables = list(config.embedding_tables)
        if any(t.local_metadata is None for t in tables):
            return  # data parallel: replicated, saved with the dense state
        emb = kernel.emb_module
        fused = hasattr(emb, "split_optimizer_states") and hasattr(kernel, "fused_optimizer")
        if not fused:
            for i in range(len(tables)):
                self._entries.append((tables[i], i, kernel, None))
            return
        # One flat bitmap per kernel; each table starts on a word boundary so
        # that its bits are a plain slice of the flat tensor.
        word_starts, total = [], 0
        for t in tables:
            word_starts.append(total)
            total += bitmap.num_words(t.local_rows)
        device = next(iter(emb.split_embedding_weights()), torch.empty(0)).device
        words = torch.zeros(total, dtype=torch.int64, device=device)
        self._words.append(words)
        key_base = torch.tensor(
            [word_starts[i] * 64 for i, t in enumerate(tables) for _ in range(t.num_features())],
            dtype=torch.int64,
            device=device,
        )
        if device.type == "cpu" and self._marker is None:
            self._marker = _Marker()
        priority = None
        if self.mode == "mfu":
            priority = torch.zeros(total * 64, dtype=torch.int32, device=device)
        elif self.mode == "ssu":
            priority = torch.zeros(total, dtype=torch.int64, device=device)
        marker = self._marker if device.type == "cpu" else None
        hook = _KernelHook(words, key_base, marker, priority, self.mode, self._ssu_rate)
        self._hooks.append((kernel, hook))
        self._handles.append(kernel.register_forward_pre_hook(hook, with_kwargs=True))
        for i, t in enumerate(tables):
            view = words[word_starts[i] : word_starts[i] + bitmap.num_words(t.local_rows)]
            self._entries.append((t, i, kernel, view))
            if priority is not None and self.mode == "mfu":
                start = word_starts[i] * 64
                self._priority[(id(kernel), i)] = priority[start : start + t.local_rows]
            elif priority is not None:
                self._priority[(id(kernel), i)] = priority[
                    word_starts[i] : word_starts[i] + bitmap.num_words(t.local_rows)
                ]

    def drain(self) -> None:
        """Waits until every looked-up row so far is in the bitmaps."""
        if self._marker is not None:
            self._marker.drain()

    def shards(self, prefix: str = "") -> list[LocalShard]:
        """The local shards with live views into weights, optimizer states and bitmaps.

        Args:
            prefix: module path of the sharded module inside the user's model;
                table names are qualified with it.
        """
        out = []
        weights_cache: dict[int, list[torch.Tensor]] = {}
        states_cache: dict[int, list[list[torch.Tensor]]] = {}
        for table, index, kernel, words in self._entries:
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
            priority = self._priority.get((id(kernel), index))
            out.append(
                LocalShard(spec, weight, states, optimizer, words, kernel, priority, self.drain)
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
        """
        for handle in self._handles:
            handle.remove()
        self._handles = (
            [
                kernel.register_forward_pre_hook(hook, with_kwargs=True)
                for kernel, hook in self._hooks
            ]
            if enabled
            else []
        )
