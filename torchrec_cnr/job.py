"""The training job behind ``scripts/train.py``: a config-driven DLRM run with
checkpoints, failure injection, automatic resume and evaluation."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from torchrec_cnr import criteo, model_state
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.integrity import crc32
from torchrec_cnr.manager import CheckpointManager
from torchrec_cnr.manifest import Manifest, saved_fraction
from torchrec_cnr.workload import (
    CRITEO_NUM_DENSE,
    LAYOUTS,
    BatchStream,
    TableSpec,
    ZipfBatches,
    build_model,
    criteo_tables,
    dense_optimizer,
    train_step,
)


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
    checkpoint root remembers it across restarts).
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

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


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

    def __post_init__(self) -> None:
        if self.data.path is not None and self.model.tables != "criteo":
            raise ValueError(
                f"data.path needs model.tables: criteo (26 tables), got {self.model.tables!r}"
            )


def _say(*args: Any) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def job_tables(config: JobConfig) -> list[TableSpec]:
    m, types = config.model, config.sharding.types
    if m.tables == "criteo":
        return criteo_tables(m.max_rows, m.dim, types)
    return [
        TableSpec(f"t{i}", m.max_rows, m.dim, types[i % len(types)] if types else None)
        for i in range(m.num_tables)
    ]


def num_dense(config: JobConfig) -> int:
    return CRITEO_NUM_DENSE if config.model.tables == "criteo" else 4


@dataclass
class Trainer:
    """One rank's model, optimizers, data and checkpoint manager."""

    model: nn.Module
    opt: torch.optim.Optimizer
    data: BatchStream
    ckpt: CheckpointManager

    @classmethod
    def build(
        cls, config: JobConfig, seed: int, checkpoint: CheckpointConfig | None = None
    ) -> Trainer:
        tables = job_tables(config)
        nd = num_dense(config)
        model = build_model(tables, nd, learning_rate=config.optimizer.sparse_lr, seed=seed)
        opt = dense_optimizer(model, config.optimizer.dense_lr)
        data = make_data(config, tables)
        ckpt = CheckpointManager(
            model, checkpoint or config.checkpoint, {"reader": data, "dense_opt": opt}
        )
        return cls(model, opt, data, ckpt)


def make_data(config: JobConfig, tables: list[TableSpec]) -> BatchStream:
    """The job's batches: Criteo files when ``data.path`` is set, else synthetic."""
    d = config.data
    if d.path is None:
        return ZipfBatches(tables, d.batch_size, num_dense(config), d.alpha, d.pooling, d.seed)
    # One converter per node; the other ranks wait for its completion markers.
    converter = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    world = dist.get_world_size()
    train = criteo.convert(d.path, d.cache_dir, converter, progress=dist.get_rank() == 0)
    heldout = criteo.convert(d.eval_path, d.cache_dir, converter) if d.eval_path else None
    return criteo.CriteoBatches(
        train, tables, d.batch_size, world, heldout, config.eval.batches * world * d.batch_size
    )


def evaluate(model: nn.Module, data: BatchStream, batches: int) -> dict[str, float]:
    """AUC and log loss on held-out batches, gathered over every rank."""
    from torchmetrics.functional.classification import binary_auroc

    rank = dist.get_rank()
    preds, labels = [], []
    with torch.no_grad():
        for i in range(batches):
            b = data.heldout(rank, i)
            preds.append(torch.sigmoid(model(b.dense, b.sparse).squeeze(-1)))
            labels.append(b.labels)
    local = torch.stack([torch.cat(preds), torch.cat(labels)])
    everything = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(everything, local)
    p, y = torch.cat(everything, dim=1)
    auc = float(binary_auroc(p, y.long()))
    logloss = float(nn.functional.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y))
    return {"auc": auc, "logloss": logloss}


def state_digest(model: nn.Module, data: BatchStream) -> str:
    """CRC32 over every rank's shards, optimizer state, dense state and reader position."""
    crc = 0
    for s in model_state.local_shards(model):
        for t in (s.weight, *s.states.values()):
            crc = zlib.crc32(crc.to_bytes(4, "little") + crc32(t).to_bytes(4, "little"))
        crc = zlib.crc32(repr(sorted(s.scalar_states().items())).encode(), crc)
    for key, t in sorted(model_state.dense_state(model).items()):
        crc = zlib.crc32(key.encode() + crc32(t).to_bytes(4, "little"), crc)
    crc = zlib.crc32(data.position.to_bytes(8, "little"), crc)
    crcs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(crcs, crc)
    return "-".join(f"{c:08x}" for c in crcs)


def _states_equal(a: nn.Module, b: nn.Module) -> bool:
    for x, y in zip(model_state.local_shards(a), model_state.local_shards(b), strict=True):
        if x.spec != y.spec or not torch.equal(x.weight, y.weight):
            return False
        if any(not torch.equal(v, y.states[k]) for k, v in x.states.items()):
            return False
        if x.scalar_states() != y.scalar_states():
            return False
    da, db = model_state.dense_state(a), model_state.dense_state(b)
    return da.keys() == db.keys() and all(torch.equal(v, db[k]) for k, v in da.items())


def _maybe_fail(config: JobConfig, step: int) -> None:
    """Kills this rank after ``step`` if a failure is configured there and has not fired yet."""
    f = config.failure
    if step not in f.steps:
        return
    marker = Path(config.checkpoint.path) / ".failures" / f"step-{step}"
    dist.barrier()  # every rank checks the marker before the victim writes it
    fired = marker.exists()
    dist.barrier()
    if fired or dist.get_rank() != f.rank:
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(time.time()))
    print(f"[rank {f.rank}] injected failure after step {step}: SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def report(root: Path) -> dict[str, float]:
    """Prints the checkpoints written and returns byte totals."""
    manifest = Manifest.load(root)
    if not manifest.checkpoints:
        return {}
    fulls = [e["bytes"] for e in manifest.checkpoints if e["kind"] == "full"]
    full = max(fulls) if fulls else 0
    _say(f"\n{'step':>6} {'kind':>6} {'rows saved':>10} {'MB':>8}  chain")
    for e in manifest.checkpoints:
        _say(
            f"{e['step']:>6} {e['kind']:>6} {100 * saved_fraction(e['shards']):>9.1f}% "
            f"{e['bytes'] / 1e6:>8.2f}  {len(e['chain'])} checkpoint(s)"
        )
    written = sum(e["bytes"] for e in manifest.checkpoints)
    n = len(manifest.checkpoints)
    _say(
        f"\nwritten: {written / 1e6:.2f} MB in {n} checkpoints; a full checkpoint every time: "
        f"{n * full / 1e6:.2f} MB ({n * full / max(written, 1):.2f}x more)"
    )
    latest = manifest.checkpoints[-1]
    _say(
        f"latest restore reads {manifest.chain_bytes(latest) / 1e6:.2f} MB ({len(latest['chain'])} checkpoint(s))"
    )
    return {
        "bytes_written": written,
        "full_bytes_each": full,
        "checkpoints": n,
        "restores": manifest.restores,
    }


def run(config: JobConfig) -> dict[str, Any]:
    """Trains, checkpoints, injects failures, evaluates; checks the last checkpoint restores exactly."""
    rank = dist.get_rank()
    root = Path(config.checkpoint.path)
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if config.train.clean_start and first_attempt and rank == 0 and root.exists():
        shutil.rmtree(root)
    dist.barrier()
    t = Trainer.build(config, config.train.seed)
    if isinstance(t.data, criteo.CriteoBatches):
        steps = config.train.steps
        _say(
            f"criteo: {t.data.samples} training samples from {config.data.path}; "
            f"{steps} steps make {t.data.epochs(steps):.2f} epoch(s)"
        )
    start = (t.ckpt.restore() or 0) if config.train.resume else 0
    if start:
        _say(
            f"resumed from step {start} (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})"
        )
    bar = tqdm(
        total=config.train.steps,
        initial=start,
        disable=rank != 0,
        desc="train",
        unit="step",
        mininterval=1,
    )
    began, loss = time.perf_counter(), float("nan")
    for step in range(start + 1, config.train.steps + 1):
        loss = train_step(t.model, t.opt, t.data.next(rank))
        if t.ckpt.maybe_save(step):
            bar.set_postfix(loss=f"{loss:.4f}", ckpt=step)
        bar.update(1)
        _maybe_fail(config, step)
    bar.close()
    t.ckpt.wait()
    result: dict[str, Any] = {
        "loss": loss,
        "seconds": time.perf_counter() - began,
        "resumed_from": start,
    }
    # Before evaluating: FBGEMM counts every forward, evaluation's too, in the kernels'
    # step counters, which the last checkpoint holds as they were at its step.
    if config.train.verify_restore and Manifest.load(root).latest() is not None:
        fresh = Trainer.build(config, config.train.seed + 1000)
        restored = fresh.ckpt.restore()
        saved_last = restored == config.train.steps
        ok = torch.tensor([int(_states_equal(t.model, fresh.model)) if saved_last else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not saved_last:
            verdict = (
                f"skipped (step {config.train.steps} was not checkpointed; latest is {restored})"
            )
        else:
            verdict = "bit-exact" if ok.item() else "MISMATCH"
        _say(f"restore check: step {restored} into a fresh model: {verdict}")
        result["restore_exact"] = bool(ok.item())
        fresh.ckpt.close()
        if not ok.item():
            raise SystemExit("restore check failed")
    result.update(evaluate(t.model, t.data, config.eval.batches))
    _say(
        f"eval: AUC {result['auc']:.4f}, log loss {result['logloss']:.4f} ({config.eval.batches} batches/rank)"
    )
    result.update(report(root))
    result["digest"] = state_digest(t.model, t.data)
    t.ckpt.close()
    if config.train.metrics_path and rank == 0:
        path = Path(config.train.metrics_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    return result
