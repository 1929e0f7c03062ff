"""Configuration of a :class:`~torchrec_cnr.CheckpointManager`.

Each component owns a frozen dataclass, validated on construction: a bad value raises
``ValueError`` naming the field and what it allows. The allowed values come from the
module that owns each concept (policies from :mod:`torchrec_cnr.selection.policy`,
methods, bit widths and thresholds from :mod:`torchrec_cnr.quantization`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import InitVar, dataclass, field
from typing import Any, Literal

from torchrec_cnr.env import env_number
from torchrec_cnr.iocontext import IOOptions
from torchrec_cnr.quantization import (
    BITS,
    CAST_METHODS,
    DEFAULT_THRESHOLDS,
    METHODS,
    check_thresholds,
)
from torchrec_cnr.selection.policy import BaselineRule, PolicyName, check_policy
from torchrec_cnr.storage import Storage, check_root, open_storage

__all__ = [
    "ON_BUSY",
    "ON_DAMAGED",
    "CheckpointConfig",
    "IOOptions",
    "OnBusy",
    "OnDamaged",
    "STAGING",
    "BACKGROUND",
    "Background",
    "Staging",
    "QuantizeConfig",
    "RecoveryConfig",
    "Timeouts",
    "checked_safe_globals",
]


def checked_safe_globals(names: Iterable[str | type]) -> tuple[str | type, ...]:
    """``safe_globals`` (types ``app_state`` may hold beyond the built-in ones) as a tuple,
    each a type or a qualified name like ``"package.module.Name"``.

    Raises:
        ValueError: an entry that is neither, named.
    """
    names = tuple(names)
    for name in names:
        if isinstance(name, str) and "." not in name.strip("."):
            raise ValueError(
                f"safe_globals entries must be qualified names like 'package.module.Name' "
                f"or types, got {name!r}"
            )
        if not isinstance(name, str | type):
            raise ValueError(f"safe_globals entries must be strings or types, got {name!r}")
    return names


OnBusy = Literal["wait", "skip"]
ON_BUSY: tuple[OnBusy, ...] = ("wait", "skip")
Staging = Literal["lazy", "eager"]
STAGING: tuple[Staging, ...] = ("lazy", "eager")
OnDamaged = Literal["raise", "fall_back", "retire"]
ON_DAMAGED: tuple[OnDamaged, ...] = ("raise", "fall_back", "retire")
Background = Literal["thread", "process"]
BACKGROUND: tuple[Background, ...] = ("thread", "process")
StateDtype = Literal["none", "fp16", "bf16"]
STATE_DTYPES: tuple[StateDtype, ...] = ("none", "fp16", "bf16")


def _check_method_bits(where: str, method: str, bits: int | str) -> None:
    if method not in METHODS:
        raise ValueError(f"{where} method must be one of {METHODS}, got {method!r}")
    if bits != "auto" and bits not in BITS:
        raise ValueError(f"{where} bits must be one of {BITS} or 'auto', got {bits!r}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_count(name: str, value: object, what: str = "a positive int or None") -> None:
    """``value`` is ``None`` or an int of at least 1."""
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _parse_override(spec: str) -> tuple[str, int | str]:
    """``"adaptive:4"`` -> ``("adaptive", 4)``; ``"none"`` -> ``("none", "auto")``."""
    method, _, bits = spec.partition(":")
    value: int | str = "auto"
    if bits:
        value = bits if bits == "auto" else int(bits) if bits.isdigit() else bits
    _check_method_bits(f"quantize.tables entry {spec!r}:", method, value)
    return method, value


@dataclass(frozen=True)
class QuantizeConfig:
    """Per-row quantization of the embedding rows a checkpoint stores (training stays fp32)."""

    method: str = "none"
    """``none`` (fp32), ``fp16``, ``bf16``, ``symmetric``, ``asymmetric``, ``kmeans`` or ``adaptive``."""
    bits: int | str = 4
    """2, 3, 4 or 8, or ``"auto"`` to choose from ``expected_restores``."""
    expected_restores: float = 1
    """Restores a checkpoint is expected to serve (Check-N-Run's L), for ``bits="auto"``."""
    thresholds: list[list[int]] = field(
        default_factory=lambda: [list(p) for p in DEFAULT_THRESHOLDS]
    )
    """``[max_restores, bits]`` pairs for ``bits="auto"``; above the last, 8 bits."""
    n_bins: int = 200
    """Step of the adaptive range search: range / n_bins."""
    ratio: float = 0.16
    """How far the adaptive search may shrink the range."""
    min_rows: int = 1024
    """Tables with fewer rows stay fp32 unless named in ``tables``."""
    tables: dict[str, str] = field(default_factory=dict)
    """Per-table override, by table name or qualified name: ``"adaptive:8"``, ``"none"``, ``"fp16"``."""
    optimizer_state: StateDtype = "none"
    """Optimizer state storage: ``none`` keeps fp32; ``fp16`` or ``bf16`` casts it."""

    def __post_init__(self) -> None:
        _check_method_bits("quantize.", self.method, self.bits)
        for spec in self.tables.values():
            _parse_override(spec)
        if self.expected_restores < 0:
            raise ValueError(
                f"quantize.expected_restores must be >= 0, got {self.expected_restores}"
            )
        if self.n_bins < 2 or not 0 < self.ratio < 1:
            raise ValueError(
                f"quantize.n_bins must be >= 2 and ratio in (0, 1), got {self.n_bins}, {self.ratio}"
            )
        if self.min_rows < 0:
            raise ValueError(f"quantize.min_rows must be >= 0, got {self.min_rows}")
        if self.optimizer_state not in STATE_DTYPES:
            raise ValueError(
                f"quantize.optimizer_state must be one of {STATE_DTYPES}, got "
                f"{self.optimizer_state!r}"
            )
        try:
            check_thresholds(self.thresholds)
        except ValueError as e:
            raise ValueError(f"quantize.thresholds: {e}") from None

    def table_format(self, table: str, num_rows: int) -> tuple[str, int | str]:
        """``(method, bits)`` for ``table`` (qualified name) of ``num_rows`` rows in all.

        A per-table override wins; tables under ``min_rows`` stay fp32; casts report
        ``bits="auto"``, which they ignore.
        """
        short = table.rsplit(".", 1)[-1]
        override = self.tables.get(table, self.tables.get(short))
        if override is not None:
            return _parse_override(override)
        if num_rows < self.min_rows:
            return "none", "auto"
        return self.method, "auto" if self.method in CAST_METHODS else self.bits


@dataclass(frozen=True)
class RecoveryConfig:
    """CPR inputs for ``interval_steps: auto``."""

    mtbf_s: float = 8 * 3600.0
    """Mean time between failures of the job, in seconds."""
    pls_target: float = 0.01
    """Largest acceptable portion of lost samples under partial recovery."""
    reschedule_s: float = 0.0
    """Seconds to replace a failed node."""
    load_cost_s: float | None = None
    """Seconds a full restore costs; ``None`` uses the measured commit time of a full checkpoint."""
    probe_step: int = 20
    """Step of the first checkpoint, which measures the save cost and the step time."""

    def __post_init__(self) -> None:
        if (
            self.mtbf_s <= 0
            or not 0 < self.pls_target < 1
            or self.reschedule_s < 0
            or self.probe_step < 2
        ):
            raise ValueError(
                "recovery needs mtbf_s > 0, pls_target in (0, 1), reschedule_s >= 0 and probe_step >= 2, got "
                f"{self.mtbf_s}, {self.pls_target}, {self.reschedule_s}, {self.probe_step}"
            )


@dataclass(frozen=True)
class Timeouts:
    """How long this job waits for its own ranks, and for another job's lease to lapse.

    Behaviour, not performance: too short, and a slow rank fails the job or a live job
    loses its root; too long, and a hung rank or a dead job's lease holds everyone up. Each
    default comes from an environment variable when it is set, read once, when the
    timeouts are built; an argument always wins.

    Example::

        CheckpointConfig(path="/ckpt/run1", timeouts=Timeouts(collective_timeout_s=120))
    """

    collective_timeout_s: float = field(
        default_factory=lambda: env_number("TORCHREC_CNR_COLLECTIVE_TIMEOUT_S", 600)
    )
    """Seconds a rank waits for the others at a checkpoint's collectives
    (``TORCHREC_CNR_COLLECTIVE_TIMEOUT_S``)."""
    lease_ttl_s: float = field(default_factory=lambda: env_number("TORCHREC_CNR_LEASE_TTL_S", 60))
    """Seconds after its last refresh that a root's lease stops counting as held by a live
    job; the holder refreshes it every quarter of this (``TORCHREC_CNR_LEASE_TTL_S``)."""

    def __post_init__(self) -> None:
        for name in ("collective_timeout_s", "lease_ttl_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be > 0 (seconds), got {value!r}")


@dataclass(frozen=True)
class CheckpointConfig:
    """How, where and when to checkpoint.

    Example::

        CheckpointConfig(path="/ckpt/run1", policy="intermittent", interval_steps=500,
                         quantize=QuantizeConfig(method="adaptive", bits="auto"))
    """

    path: str
    """Root of the run's checkpoints and chain manifest: a local or shared file system path,
    ``s3://bucket/prefix`` (any S3-compatible store, see the README), or any URL fsspec
    opens (``gs://``, ``az://``, ``abfs://``, ``hdfs://``, ...; docs/storage.md)."""
    storage_options: dict[str, Any] | None = None
    """Keyword arguments of the fsspec file system of :attr:`path` (credentials, an
    endpoint, a project), as fsspec takes them; given with an ``s3://`` path, the root goes
    through s3fs instead of boto3."""
    single_writer: bool = False
    """Declares that one job at a time writes the root, which allows an fsspec store
    without conditional writes (HDFS, an emulator that ignores them); see docs/storage.md."""
    policy: PolicyName = "intermittent"
    """Row-selection policy: ``full``, ``one_shot``, ``consecutive`` or ``intermittent``."""
    interval_steps: int | str | None = None
    """``maybe_save(step)`` saves at positive multiples of this; ``"auto"`` lets CPR choose; ``None`` never."""
    baseline_rule: str | BaselineRule = "average_write"
    """Rule deciding when ``intermittent`` takes a new baseline: a name in
    ``selection.BASELINE_RULES``, or a function of S_1..S_i returning True for a new baseline."""
    keep_last: int | None = None
    """Keep only what restoring the last N checkpoints needs; ``None`` keeps everything."""
    compact_every: int | None = None
    """Merge a ``consecutive`` chain into one full checkpoint once it holds this many deltas,
    in the background beside later commits (no save waits for it); ``None`` never compacts
    on its own."""
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    """Per-row quantization of stored embedding rows."""
    on_busy: OnBusy = "wait"
    """When a save arrives while the previous one is still writing: ``wait`` for it, or ``skip`` (with a warning)."""
    staging: Staging = "lazy"
    """How a save copies the rows it holds. ``lazy`` (copy-on-write): ``save()`` returns
    after copying the small things (bitmaps, dense state, ``app_state``); the rows are
    copied by the background writer, and by the lookup hook just before training can
    update them. ``eager``: ``save()`` copies every row first, so the stall grows with
    the checkpoint. Shards where copy-on-write cannot hold are staged eagerly, with the
    reason in the log (see ``torchrec_cnr.staging.lazy``). Both write the same bytes."""
    staging_memory_mb: float | None = None
    """Most host memory a save holds for its staged rows (and keeps for reuse between saves);
    ``None`` for no limit. A checkpoint larger than this is staged and written in chunks
    during the stall: the stall grows, memory does not."""
    background: Background = "thread"
    """Where a checkpoint is encoded, written and committed after ``save()`` returns.
    ``thread``: on a thread of the training process, whose Python work then competes with
    training's for the GIL. ``process``: in a writer process per rank, started with the
    manager (Linux): the training process keeps only the copy of lazily staged rows (in
    C) and relays the writer's collectives; staging buffers are shared memory, which the
    writer process maps (see ``torchrec_cnr.writer_process``). Needs ``staging_memory_mb=None``
    (every checkpoint staged whole) and a config that pickles."""
    verify_checksums: bool = True
    """Check every tensor a restore reads against the checksum recorded at save time."""
    safe_globals: tuple[str | type, ...] = ()
    """Types ``app_state`` may hold beyond tensors, numbers, strings and plain containers,
    as ``"package.module.Name"`` (or the type itself). A restore loads ``app_state`` with
    PyTorch's ``weights_only`` unpickler and these allowed: it runs no code a checkpoint
    names, and refuses, before any change, a type not listed."""
    restore_memory_mb: float | None = None
    """Host memory a restore may hold to read and verify the whole chain before it changes
    the model; ``None``: ``io.read_memory_mb`` (the bound of every read), then
    ``staging_memory_mb`` (no limit if those are ``None`` too: the
    baseline is read into the staging buffers a save holds anyway, and nothing more is
    held). Past it, tensors are read only to be verified, a few
    pieces at a time, then read again while applying: a saved shard of the same layout
    straight into the model; of a shard of another sharding, the checksummed blocks this
    rank's rows lie in, through the host's cache, straight into place where they land as
    one run, else a few blocks at a time; others (deltas, quantized shards) one at a time,
    whole. Bytes read: up to twice the chain's; memory: the budget, or the largest such
    other tensor."""
    take_over: bool = False
    """Claim the root even from another live job; that job's later commits are refused."""
    read_only: bool = False
    """Open the root only to restore from it (an evaluation job, a warm start from another
    run's root): the manager claims nothing and writes nothing, not even the restore count,
    and ``save``/``compact`` raise. ``False``: the manager claims the root as it is built,
    and raises there, on every rank, if the root cannot be written or another live job
    holds it."""
    on_damaged: OnDamaged = "raise"
    """What ``restore()`` of the latest checkpoint does when that checkpoint, or a link of
    its chain, is damaged (a missing or corrupt file): ``raise``, changing nothing;
    ``fall_back`` to the newest intact committed checkpoint before it, with a warning naming
    both (the damaged ones stay in the root: ``cnr retire ROOT --damaged`` removes them);
    ``retire``: fall back, then retire the damaged checkpoints and every one that builds on
    them (the manifest first, then their files), so that ``cnr verify`` passes again. A
    restore of a given ``step`` always raises."""
    require_checkpoint: bool = False
    """``restore()`` of the latest raises on every rank, naming the root, where the root
    holds no committed checkpoint (a mistyped path, a root that was never written);
    ``False``: it logs that once (rank 0) and returns ``None``."""
    manifest_fallback: bool = False
    """If the manifest is damaged or missing, use the previous committed one (with a warning)
    instead of failing."""
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    """CPR inputs for ``interval_steps: auto``."""
    priority_budget_mb: float | None = None
    """CPR prioritized saves: deltas hold the highest-priority modified rows up to this many MB per rank.
    Needs ``policy: consecutive`` and ``tracking_sharders(mode="mfu" | "ssu")``."""
    io: IOOptions = field(default_factory=IOOptions)
    """Threads, object size and the other performance knobs of the I/O."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    """How long ranks wait for each other at collectives, and how long a silent lease still
    counts as a live job's."""
    restore_step: int | None = None
    """The step ``restore()`` loads when it is given none; ``None``: the latest."""
    exclude_from_loading: tuple[str, ...] = ()
    """``app_state`` entries ``restore()`` leaves as they are (a data loader that starts
    afresh, a scheduler the job resets); each must be a key of the manager's ``app_state``.
    They are saved all the same."""
    wait_for_commit: bool = False
    """``save()`` returns only once its checkpoint is committed: training waits for the whole
    write (``True``), or only for the staging (``False``)."""
    # torchtitan's names for the same options ([checkpoint] of its TOML; docs/configuration.md).
    interval: InitVar[int | None] = None
    """torchtitan's name for :attr:`interval_steps`."""
    keep_latest_k: InitVar[int | None] = None
    """torchtitan's :attr:`keep_last`: 0 keeps every checkpoint."""
    load_step: InitVar[int | None] = None
    """torchtitan's :attr:`restore_step`: -1 for the latest."""
    async_mode: InitVar[str | None] = None
    """torchtitan's: ``disabled`` (:attr:`wait_for_commit`), ``async`` (``background="thread"``)
    or ``async_with_pinned_mem`` (``background="process"``, a writer process)."""

    def __post_init__(
        self,
        interval: int | None,
        keep_latest_k: int | None,
        load_step: int | None,
        async_mode: str | None,
    ) -> None:
        self._torchtitan_names(interval, keep_latest_k, load_step, async_mode)
        self._check_root_and_parts()
        self._check_schedule()
        self._check_modes()
        self._check_memory_and_restore()

    def _check_root_and_parts(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"path must be a non-empty string, got {self.path!r}")
        check_root(self.path, self.storage_options)
        if not isinstance(self.single_writer, bool):
            raise ValueError(f"single_writer must be a bool, got {self.single_writer!r}")
        for part, kind in (("quantize", QuantizeConfig), ("recovery", RecoveryConfig),
                           ("io", IOOptions), ("timeouts", Timeouts)):  # fmt: skip
            value = getattr(self, part)
            if not isinstance(value, kind):
                raise ValueError(
                    f"{part} must be given as {kind.__name__}(...) (every default: "
                    f"{kind.__name__}()), got {value!r}"
                )
        object.__setattr__(self, "safe_globals", checked_safe_globals(self.safe_globals))

    def _check_schedule(self) -> None:
        """The policy, when checkpoints are taken, and how many are kept."""
        check_policy(self.policy, self.baseline_rule)
        if self.interval_steps != "auto":
            _check_count("interval_steps", self.interval_steps, "a positive int, 'auto' or None")
        _check_count("keep_last", self.keep_last)
        _check_count("compact_every", self.compact_every)
        if self.compact_every is not None and self.policy != "consecutive":
            warnings.warn(
                f"compact_every applies to policy='consecutive' only: a {self.policy!r} chain "
                "holds at most a baseline and one delta, and is never compacted on its own "
                "(CheckpointManager.compact() compacts it)",
                stacklevel=4,
            )
        if self.priority_budget_mb is not None:
            if self.priority_budget_mb <= 0:
                raise ValueError(
                    f"priority_budget_mb must be > 0 or None, got {self.priority_budget_mb}"
                )
            if self.policy != "consecutive":
                raise ValueError(
                    f"priority_budget_mb needs policy 'consecutive', got {self.policy!r}"
                )

    def _check_modes(self) -> None:
        """The named choices, and the pairs of them that exclude each other."""
        _check_choice("staging", self.staging, STAGING)
        _check_choice("background", self.background, BACKGROUND)
        if self.background == "process" and self.staging_memory_mb is not None:
            raise ValueError(
                "background='process' stages every checkpoint whole: staging_memory_mb must "
                f"be None, got {self.staging_memory_mb}"
            )
        _check_choice("on_damaged", self.on_damaged, ON_DAMAGED)
        if self.on_damaged == "retire" and self.read_only:
            raise ValueError("on_damaged='retire' writes the root: read_only must be False")
        _check_choice("on_busy", self.on_busy, ON_BUSY)
        if self.read_only and self.take_over:
            raise ValueError("read_only=True claims nothing: take_over must be False")

    def _check_memory_and_restore(self) -> None:
        if self.restore_memory_mb is not None and self.restore_memory_mb < 0:
            raise ValueError(
                f"restore_memory_mb must be >= 0 or None, got {self.restore_memory_mb}"
            )
        if self.staging_memory_mb is not None and not self.staging_memory_mb > 0:
            raise ValueError(f"staging_memory_mb must be > 0 or None, got {self.staging_memory_mb}")
        if self.restore_step is not None and (
            not isinstance(self.restore_step, int) or self.restore_step < 0
        ):
            raise ValueError(f"restore_step must be an int >= 0 or None, got {self.restore_step!r}")
        if isinstance(self.exclude_from_loading, str) or not all(
            isinstance(n, str) for n in self.exclude_from_loading
        ):
            raise ValueError(
                "exclude_from_loading must be a list of app_state names, got "
                f"{self.exclude_from_loading!r}"
            )
        object.__setattr__(self, "exclude_from_loading", tuple(self.exclude_from_loading))

    def open_root(self, io: IOOptions | None = None) -> Storage:
        """The :class:`~torchrec_cnr.storage.Storage` of :attr:`path`, with the storage
        options, doing its I/O as ``io`` says (default :attr:`io`)."""
        return open_storage(self.path, io or self.io, self.storage_options, self.single_writer)

    def _torchtitan_names(
        self,
        interval: int | None,
        keep_latest_k: int | None,
        load_step: int | None,
        async_mode: str | None,
    ) -> None:
        """Sets the fields torchtitan's names stand for; a field given both ways, with two
        values, is refused naming both."""

        def take(name: str, alias: str, value: object, default: object) -> None:
            given = getattr(self, name)
            if given != default and given != value:
                raise ValueError(
                    f"{alias} (torchtitan's name) and {name} are both set, to {value!r} and "
                    f"{given!r}: keep one"
                )
            object.__setattr__(self, name, value)

        if interval is not None:
            take("interval_steps", "interval", interval, None)
        if keep_latest_k is not None:
            if not isinstance(keep_latest_k, int) or keep_latest_k < 0:
                raise ValueError(f"keep_latest_k must be an int >= 0, got {keep_latest_k!r}")
            take("keep_last", "keep_latest_k", keep_latest_k or None, None)
        if load_step is not None:
            if not isinstance(load_step, int) or load_step < -1:
                raise ValueError(f"load_step must be -1 (the latest) or a step, got {load_step!r}")
            take("restore_step", "load_step", None if load_step == -1 else load_step, None)
        if async_mode is not None:
            modes = {"disabled": ("wait_for_commit", True),
                     "async": ("background", "thread"),
                     "async_with_pinned_mem": ("background", "process")}  # fmt: skip
            if async_mode not in modes:
                raise ValueError(f"async_mode must be one of {tuple(modes)}, got {async_mode!r}")
            name, value = modes[async_mode]
            take(name, "async_mode", value, False if name == "wait_for_commit" else "thread")
