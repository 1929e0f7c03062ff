"""The training job's configuration: one frozen dataclass per section of ``configs/*.yaml``.

Every key is a field with a one-line docstring; ``cnr_train.config_file`` maps YAML and
``section.key=value`` overrides onto these, one to one. The ``checkpoint`` section is the
library's own :class:`torchrec_cnr.CheckpointConfig`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from cnr_train.workload import LAYOUTS
from torchrec_cnr import CheckpointConfig, FollowerOptions

__all__ = [
    "DataConfig",
    "EvalConfig",
    "FailureConfig",
    "JobConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ServeConfig",
    "ShardingConfig",
    "TrainConfig",
]


@dataclass(frozen=True)
class ModelConfig:
    """The DLRM: embedding tables and MLP sizes."""

    tables: str = "criteo"
    """``criteo``: the 26 Criteo Kaggle tables capped at ``max_rows``; ``uniform``: ``num_tables`` x ``max_rows``."""
    max_rows: int = 20_000
    """Rows per table (cap for ``criteo``)."""
    num_tables: int = 8
    """Tables when ``tables: uniform``."""
    dim: int = 16
    """Embedding dim of every table."""

    def __post_init__(self) -> None:
        if self.tables not in ("criteo", "uniform"):
            raise ValueError(f"tables must be 'criteo' or 'uniform', got {self.tables!r}")
        for name, value in (
            ("max_rows", self.max_rows),
            ("num_tables", self.num_tables),
            ("dim", self.dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class ShardingConfig:
    """How tables are sharded."""

    types: list[str] = field(default_factory=list)
    """Sharding type per table, cycled; empty lets the planner choose."""

    def __post_init__(self) -> None:
        bad = [s for s in self.types if s not in LAYOUTS]
        if bad:
            raise ValueError(f"types entries must be in {LAYOUTS}, got {bad}")


@dataclass(frozen=True)
class DataConfig:
    """Real Criteo files, or synthetic Criteo-like batches with Zipf ids and teacher labels."""

    batch_size: int = 256
    """Samples per rank per step."""
    path: str | list[str] | None = None
    """Criteo Kaggle or Terabyte TSV file(s) or globs (``train.txt``, ``day_*``); ``None``: synthetic."""
    eval_path: str | list[str] | None = None
    """Held-out Criteo file(s) with labels; ``None`` holds out the last samples of ``path``."""
    cache_dir: str = "runs/criteo_npy"
    """Where ``path`` is converted to ``.npy`` once; shared by the ranks."""
    alpha: float = 1.05
    """Synthetic: Zipf exponent of the ids."""
    pooling: int = 1
    """Synthetic: ids per feature per sample (Criteo has one)."""
    seed: int = 0
    """Synthetic: seed of the data; batches depend only on (seed, rank, step)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.pooling < 1:
            raise ValueError("batch_size and pooling must be >= 1")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if self.path is not None and self.pooling != 1:
            raise ValueError("pooling must be 1 with a path: Criteo has one id per feature")
        if self.eval_path is not None and self.path is None:
            raise ValueError("eval_path needs path (the synthetic stream holds out its own)")


@dataclass(frozen=True)
class OptimizerConfig:
    """Fused row-wise Adagrad for the tables, Adagrad for the dense part."""

    sparse_lr: float = 0.05
    """Learning rate of the fused embedding optimizer."""
    dense_lr: float = 0.05
    """Learning rate of the dense optimizer."""

    def __post_init__(self) -> None:
        if self.sparse_lr <= 0 or self.dense_lr <= 0:
            raise ValueError("sparse_lr and dense_lr must be > 0")


@dataclass(frozen=True)
class FailureConfig:
    """Injected failures: a rank kills itself with SIGKILL after the given steps.

    Run under ``torchrun --max-restarts=N``: the restarted job resumes from the
    latest committed checkpoint. Each failure fires once (a marker in the
    checkpoint root remembers it across restarts). At a step that saves, the rank dies
    right after ``save()`` returns, while that checkpoint commits in the background.
    """

    steps: list[int] = field(default_factory=list)
    """Steps after which ``rank`` dies."""
    rank: int = 1
    """The rank that dies."""

    def __post_init__(self) -> None:
        if any(s < 1 for s in self.steps):
            raise ValueError(f"steps must be >= 1, got {self.steps}")


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: AUC and log loss."""

    batches: int = 20
    """Held-out batches per rank (a stream disjoint from training)."""


@dataclass(frozen=True)
class TrainConfig:
    """The loop."""

    steps: int = 400
    """Training steps."""
    seed: int = 0
    """Seed of the model initialisation."""
    resume: bool = True
    """Restore the latest committed checkpoint before training."""
    clean_start: bool = False
    """Delete checkpoint.path before the first attempt (not on torchrun restarts)."""
    verify_restore: bool = True
    """After training, restore the last checkpoint into a fresh model and compare bit for bit."""
    metrics_path: str | None = None
    """JSON file for the final metrics; ``None`` writes none."""
    figure_path: str | None = None
    """PNG of the bytes each checkpoint wrote against a full fp32 one; ``None`` draws none."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


ServeDtype = Literal["fp32", "int8", "int4", "int2"]
"""Row types of the served tables: fp32 as trained, or TorchRec's ``qint8``, ``quint4x2``
and ``quint2x4``."""
SERVE_DTYPES: tuple[ServeDtype, ...] = typing.get_args(ServeDtype)


@dataclass(frozen=True)
class ServeConfig:
    """The serving process beside the job (``cnr-train serve``): a DLRM, its tables
    quantized or not, that follows the checkpoint root and answers requests from held-out
    batches."""

    dtype: ServeDtype = "int4"
    """Served row type: ``fp32``, or ``int8``, ``int4``, ``int2`` (``quantize_embeddings``'
    dtype)."""
    interval_s: float = 0.5
    """Seconds between the follower's polls of the root."""
    requests_per_s: float = 5.0
    """Requests (one held-out batch each) answered per second while the job trains."""
    io_threads: int = 2
    """Threads the follower reads with; its other I/O options are the job's
    ``checkpoint.io``."""
    timeout_s: float = 900.0
    """Longest wait for the job to finish (its done marker) before giving up."""
    metrics_path: str | None = None
    """JSON file for the serving metrics; ``None`` writes none."""
    follower: FollowerOptions = field(default_factory=FollowerOptions)
    """The follower's options (swap mode, the memory budget in MB, where spilled rows go):
    the library's :class:`torchrec_cnr.FollowerOptions`, one key a field, validated there.
    Its ``io`` stays null (the follower reads with ``checkpoint.io`` and ``io_threads``)."""
    step_rows: bool = False
    """A consistency probe, for benchmarks and tests: the job writes each step into the last
    row of every table (:func:`torchrec_cnr.write_rows`; those rows no longer train), and
    every request checks, under the same hold as its forward, that the served model's last
    rows all hold the step the follower names. A request that sees anything else counts
    as a torn snapshot (``torn_requests`` in the metrics)."""

    MOVED: ClassVar[dict[str, str]] = {
        "swap": "follower.swap",
        "memory_budget_mb": "follower.memory_budget_mb",
    }
    """Keys that moved, and where (read with a ``DeprecationWarning`` for one release)."""

    def __post_init__(self) -> None:
        if self.dtype not in SERVE_DTYPES:
            raise ValueError(f"dtype must be one of {SERVE_DTYPES}, got {self.dtype!r}")
        for name, value in (
            ("interval_s", self.interval_s),
            ("requests_per_s", self.requests_per_s),
            ("timeout_s", self.timeout_s),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")
        if self.follower.io is not None:
            # One way in: a second set of I/O options here would leave io_threads unused.
            raise ValueError(
                "follower.io must be null: the follower reads with checkpoint.io and io_threads"
            )


@dataclass(frozen=True)
class JobConfig:
    """A training job: model, data, sharding, optimizer, checkpointing, failures, evaluation."""

    checkpoint: CheckpointConfig
    """Where and how to checkpoint."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    """The sharding."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizers."""
    failure: FailureConfig = field(default_factory=FailureConfig)
    """Injected failures."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The loop."""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """The serving process that follows the job's checkpoints."""

    def __post_init__(self) -> None:
        if self.data.path is not None and self.model.tables != "criteo":
            raise ValueError(
                f"data.path needs model.tables: criteo (26 tables), got {self.model.tables!r}"
            )
