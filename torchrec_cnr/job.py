"""The training job behind ``scripts/train.py``: a config-driven DLRM run with checkpoints."""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from torchrec_cnr import model_state
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.manager import CheckpointManager
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.workload import TableSpec, ZipfBatches, build_model, dense_optimizer, train_step

SHARDINGS = (
    "table_wise",
    "column_wise",
    "table_column_wise",
    "data_parallel",
    "row_wise",
    "table_row_wise",
)


@dataclass(frozen=True)
class ModelConfig:
    """The synthetic DLRM."""

    num_tables: int = 8
    """Embedding tables, one sparse feature each."""
    rows: int = 20_000
    """Rows per table."""
    dim: int = 16
    """Embedding dim of every table."""
    num_dense: int = 4
    """Dense input features."""
    shardings: list[str] = field(default_factory=list)
    """Sharding type per table, cycled; empty lets the planner choose."""

    def __post_init__(self) -> None:
        for name, value in (
            ("num_tables", self.num_tables),
            ("rows", self.rows),
            ("dim", self.dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        bad = [s for s in self.shardings if s not in SHARDINGS]
        if bad:
            raise ValueError(f"shardings entries must be in {SHARDINGS}, got {bad}")

    def tables(self) -> list[TableSpec]:
        return [
            TableSpec(
                f"t{i}",
                self.rows,
                self.dim,
                self.shardings[i % len(self.shardings)] if self.shardings else None,
            )
            for i in range(self.num_tables)
        ]


@dataclass(frozen=True)
class DataConfig:
    """Synthetic Zipf batches."""

    batch_size: int = 256
    """Samples per rank per step."""
    alpha: float = 1.1
    """Zipf exponent of the ids."""
    pooling: int = 2
    """Ids per feature per sample."""
    seed: int = 0
    """Seed of the data; batches depend only on (seed, rank, step)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.pooling < 1:
            raise ValueError("batch_size and pooling must be >= 1")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")


@dataclass(frozen=True)
class TrainConfig:
    """The training loop."""

    steps: int = 400
    """Training steps."""
    learning_rate: float = 0.05
    """Learning rate of the fused (sparse) and dense Adagrad."""
    seed: int = 0
    """Seed of the model initialisation."""
    resume: bool = True
    """Restore the latest committed checkpoint before training."""
    clean_start: bool = False
    """Delete checkpoint.path before training (the demo starts from scratch)."""
    verify_restore: bool = True
    """After training, restore the last checkpoint into a fresh model and compare bit for bit."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.clean_start and self.resume:
            raise ValueError("clean_start and resume exclude each other")


@dataclass(frozen=True)
class JobConfig:
    """A training job: model, data, loop and checkpointing."""

    checkpoint: CheckpointConfig
    """Where and how to checkpoint."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The loop."""


def _say(*args: Any) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def _states_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    for x, y in zip(model_state.local_shards(a), model_state.local_shards(b), strict=True):
        if x.spec != y.spec or not torch.equal(x.weight, y.weight):
            return False
        if any(not torch.equal(v, y.states[k]) for k, v in x.states.items()):
            return False
    da, db = model_state.dense_state(a), model_state.dense_state(b)
    return da.keys() == db.keys() and all(torch.equal(v, db[k]) for k, v in da.items())


def _report(root: Path) -> None:
    manifest = Manifest.load(root)
    if not manifest.checkpoints:
        return
    full = max(e["bytes"] for e in manifest.checkpoints if e["kind"] == "full")
    _say(f"\n{'step':>6} {'kind':>6} {'rows saved':>10} {'MB':>8}  chain")
    for e in manifest.checkpoints:
        saved = sum(s["saved_rows"] * s["spec"]["cols"] for s in e["shards"])
        total = sum(s["spec"]["rows"] * s["spec"]["cols"] for s in e["shards"])
        _say(
            f"{e['step']:>6} {e['kind']:>6} {100 * saved / max(total, 1):>9.1f}% "
            f"{e['bytes'] / 1e6:>8.2f}  {len(e['chain'])} checkpoint(s)"
        )
    written = sum(e["bytes"] for e in manifest.checkpoints)
    n = len(manifest.checkpoints)
    _say(
        f"\nwritten: {written / 1e6:.2f} MB in {n} checkpoints; full checkpoints every time: "
        f"{n * full / 1e6:.2f} MB ({n * full / max(written, 1):.2f}x more)"
    )
    latest = manifest.checkpoints[-1]
    _say(
        f"latest restore reads {manifest.chain_bytes(latest) / 1e6:.2f} MB ({len(latest['chain'])} checkpoint(s))"
    )


def run(config: JobConfig) -> dict[str, Any]:
    """Trains, checkpoints, and (optionally) checks that the last checkpoint restores exactly."""
    rank = dist.get_rank()
    root = Path(config.checkpoint.path)
    if config.train.clean_start and rank == 0 and root.exists():
        shutil.rmtree(root)
    dist.barrier()
    tables = config.model.tables()

    def make(seed: int) -> tuple[Any, Any, ZipfBatches, CheckpointManager]:
        model = build_model(
            tables, config.model.num_dense, learning_rate=config.train.learning_rate, seed=seed
        )
        opt = dense_optimizer(model, config.train.learning_rate)
        d = config.data
        data = ZipfBatches(tables, d.batch_size, config.model.num_dense, d.alpha, d.pooling, d.seed)
        app = {"reader": data, "dense_opt": opt}
        return model, opt, data, CheckpointManager(model, config.checkpoint, app)

    model, opt, data, ckpt = make(config.train.seed)
    start = (ckpt.restore() or 0) if config.train.resume else 0
    if start:
        _say(f"resumed from step {start}")
    bar = tqdm(
        total=config.train.steps, initial=start, disable=rank != 0, desc="train", unit="step"
    )
    began, loss = time.perf_counter(), float("nan")
    for step in range(start + 1, config.train.steps + 1):
        loss = train_step(model, opt, data.next(rank))
        if ckpt.maybe_save(step):
            bar.set_postfix(loss=f"{loss:.4f}", ckpt=step)
        bar.update(1)
    bar.close()
    ckpt.wait()
    elapsed = time.perf_counter() - began
    _report(root)
    result: dict[str, Any] = {"loss": loss, "seconds": elapsed}
    if config.train.verify_restore and Manifest.load(root).latest() is not None:
        fresh, _, _, fresh_ckpt = make(config.train.seed + 1000)
        restored = fresh_ckpt.restore()
        live_is_saved = restored == config.train.steps
        ok = torch.tensor([int(_states_equal(model, fresh)) if live_is_saved else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        verdict = "bit-exact" if ok.item() else "MISMATCH"
        if not live_is_saved:
            verdict = f"skipped (last step {config.train.steps} was not checkpointed; latest is {restored})"
        _say(f"restore check: step {restored} into a fresh model: {verdict}")
        result["restore_exact"] = bool(ok.item())
        if not ok.item():
            raise SystemExit("restore check failed")
    return result


def with_checkpoint(config: JobConfig, **changes: Any) -> JobConfig:
    """A copy of ``config`` with checkpoint fields replaced."""
    return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, **changes))
