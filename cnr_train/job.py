"""The training job behind ``scripts/train.py``: a config-driven DLRM run with
checkpoints, failure injection, automatic resume and evaluation."""

from __future__ import annotations

import gc
import json
import os
import signal
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from cnr_train import criteo
from cnr_train.config import JobConfig
from cnr_train.report import check_restore, full_fp32_bytes, plot_bytes, say, summarize
from cnr_train.workload import (
    CRITEO_NUM_DENSE,
    BatchStream,
    TableSpec,
    ZipfBatches,
    build_model,
    criteo_tables,
    dense_optimizer,
    train_step,
)
from torchrec_cnr import CheckpointConfig, CheckpointError, CheckpointManager
from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit.lease import live_holder
from torchrec_cnr.offline import CheckpointInfo, root_info
from torchrec_cnr.snapshot import crc32
from torchrec_cnr.tracking import model_state, write_rows
from torchrec_cnr.tracking.tracker import TrackingMode

DONE_MARKER = ".done"
"""Written into the checkpoint root when the job has finished: JSON ``{"step", "finished_at"}``,
the last committed step and when (seconds since the epoch)."""


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

    @property
    def app_state(self) -> dict[str, Any]:
        return {"reader": self.data, "dense_opt": self.opt}

    @classmethod
    def build(
        cls,
        config: JobConfig,
        seed: int,
        checkpoint: CheckpointConfig | None = None,
        tracking_mode: TrackingMode = "bitmap",
    ) -> Trainer:
        """Builds the model (seeded with ``seed``), optimizers, data and manager.

        ``checkpoint`` replaces ``config.checkpoint``; ``tracking_mode`` is CPR's
        ``mfu``/``ssu`` for prioritized saves.
        """
        tables = job_tables(config)
        nd = num_dense(config)
        model = build_model(
            tables,
            nd,
            learning_rate=config.optimizer.sparse_lr,
            seed=seed,
            tracking_mode=tracking_mode,
        )
        opt = dense_optimizer(model, config.optimizer.dense_lr)
        data = make_data(config, tables)
        app_state = {"reader": data, "dense_opt": opt}
        return cls(
            model, opt, data, CheckpointManager(model, checkpoint or config.checkpoint, app_state)
        )


def write_step_rows(model: nn.Module, tables: list[TableSpec], step: int) -> None:
    """``serve.step_rows``: the step into the last row of every table, on every rank."""
    for spec in tables:
        last = torch.tensor([spec.rows - 1])
        write_rows(model, spec.name, last, torch.full((1, spec.dim), float(step)))


def make_data(
    config: JobConfig, tables: list[TableSpec], world_size: int | None = None
) -> BatchStream:
    """The job's batches: Criteo files when ``data.path`` is set, else synthetic.

    ``world_size`` set: a reader outside the job (the serving process) with the job's
    batches; it waits for the job's Criteo conversion instead of converting.
    """
    d = config.data
    if d.path is None:
        return ZipfBatches(tables, d.batch_size, num_dense(config), d.alpha, d.pooling, d.seed)
    inside = world_size is None
    # One converter per node; the other ranks wait for its completion markers.
    converter = inside and int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    world = dist.get_world_size() if world_size is None else world_size
    train = criteo.convert(d.path, d.cache_dir, converter, progress=inside and dist.get_rank() == 0)
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


def _restore_check(config: JobConfig, t: Trainer, latest: CheckpointInfo) -> dict[str, Any]:
    """Restores the last checkpoint into a fresh model and compares it with the live one."""
    fresh = Trainer.build(config, config.train.seed + 1000)
    restored = fresh.ckpt.restore()
    if restored != config.train.steps:
        say(
            f"restore check: skipped (step {config.train.steps} was not checkpointed; latest is {restored})"
        )
        fresh.ckpt.close()
        return {}
    chain = [i for i in root_info(config.checkpoint.path).checkpoints if i.step in latest.chain]
    ok, err = check_restore(t.model, fresh.model, chain, config.checkpoint.quantize)
    fresh.ckpt.close()
    quantized = any(t.method != "none" for i in chain for t in i.tables.values())
    if not quantized:
        verdict = "bit-exact" if ok else "MISMATCH"
    else:
        verdict = (
            "every row as stored (the quantizer's round trip of the live row), state bit-exact"
            if ok
            else "MISMATCH"
        ) + f"; max abs error {err:.3g}"
    say(f"restore check: step {restored} into a fresh model: {verdict}")
    if not ok:
        raise SystemExit("restore check failed")
    return {
        "restore_exact": ok and not quantized,
        "restore_checked": ok,
        "restore_max_abs_err": err,
    }


def _arm_failure(config: JobConfig, step: int) -> bool:
    """Whether this rank dies after ``step``: a failure is configured there, has not fired
    yet (a marker in the root remembers it across restarts), and this is its rank.

    Decided before the step's save, so that the kill follows the save at once: where
    ``step`` saves, the rank dies while that checkpoint commits in the background.
    """
    f = config.failure
    if step not in f.steps:
        return False
    storage = config.checkpoint.open_root()
    marker = f".failures/step-{step}"
    dist.barrier()  # every rank checks the marker before the victim writes it
    fired = storage.exists(marker)
    dist.barrier()
    if fired or dist.get_rank() != f.rank:
        return False
    storage.write(marker, str(time.time()).encode())
    return True


def _fail(step: int, saved: bool) -> None:
    when = ", while its checkpoint commits" if saved else ""
    print(f"[rank {dist.get_rank()}] injected failure after step {step}{when}: SIGKILL",
          flush=True)  # fmt: skip
    os.kill(os.getpid(), signal.SIGKILL)


def _clean(checkpoint: CheckpointConfig) -> None:
    """Deletes the root, unless another live job holds it (its checkpoints stay)."""
    storage = checkpoint.open_root()
    holder = live_holder(storage, checkpoint.timeouts.lease_ttl_s)
    if holder is not None:
        raise CheckpointError(
            f"train.clean_start: {storage.url} is held by another live job, "
            f"{holder.describe()}; nothing was deleted"
        )
    storage.clear()


def freeze_heap() -> None:
    """Collects once, then freezes what is left out of later collections: the model, the
    manager and the imports live as long as the process, and each full collection would
    walk them all again (some 350k objects with TorchRec imported). Called before a
    process's loop; torchtitan's training loop manages its collections alike."""
    gc.collect()
    gc.freeze()


def run(config: JobConfig) -> dict[str, Any]:
    """Trains, checkpoints, injects failures, evaluates; checks the last checkpoint restores exactly."""
    rank = dist.get_rank()
    root = config.checkpoint.path
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if config.train.clean_start and first_attempt:
        Collective(None).on_rank0(lambda: _clean(config.checkpoint))
    dist.barrier()
    t = Trainer.build(config, config.train.seed)  # fails on every rank if root is unusable
    if rank == 0:
        config.checkpoint.open_root().delete(DONE_MARKER)  # an earlier run's
    if isinstance(t.data, criteo.CriteoBatches):
        steps = config.train.steps
        say(
            f"criteo: {t.data.samples} training samples from {config.data.path}; "
            f"{steps} steps make {t.data.epochs(steps):.2f} epoch(s)"
        )
    start = (t.ckpt.restore() or 0) if config.train.resume else 0
    if start:
        say(
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
    probed = job_tables(config) if config.serve.step_rows else []
    freeze_heap()
    for step in range(start + 1, config.train.steps + 1):
        loss = train_step(t.model, t.opt, t.data.next(rank))
        if probed:
            write_step_rows(t.model, probed, step)
        dies = _arm_failure(config, step)
        did_save = t.ckpt.maybe_save(step)
        if dies:
            _fail(step, did_save)
        if did_save:
            bar.set_postfix(loss=f"{loss:.4f}", ckpt=step)
        bar.update(1)
    bar.close()
    last, saving = config.train.steps, config.checkpoint.interval_steps is not None
    if saving and last > start and not did_save:
        t.ckpt.save(last)  # the last step, off the interval: a restart resumes at the end
    t.ckpt.wait()
    result: dict[str, Any] = {
        "loss": loss,
        "seconds": time.perf_counter() - began,
        "resumed_from": start,
    }
    # Before evaluating: FBGEMM counts every forward, evaluation's too, in the kernels'
    # step counters, which the last checkpoint holds as they were at its step.
    latest = root_info(root).latest
    if config.train.verify_restore and latest is not None:
        result.update(_restore_check(config, t, latest))
    result.update(evaluate(t.model, t.data, config.eval.batches))
    say(
        f"eval: AUC {result['auc']:.4f}, log loss {result['logloss']:.4f} ({config.eval.batches} batches/rank)"
    )
    saved = root_info(root)
    if saved.checkpoints:
        full = full_fp32_bytes(t.model, t.app_state, root.rstrip("/") + "-fp32-reference")
        result.update(summarize(saved, full))
        if config.train.figure_path and rank == 0:
            plot_bytes(saved, full, Path(config.train.figure_path))
            say(f"bytes per interval: {config.train.figure_path}")
    result["digest"] = state_digest(t.model, t.data)
    t.ckpt.close()
    if config.train.metrics_path and rank == 0:
        path = Path(config.train.metrics_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    if rank == 0:
        # Last: a serving process beside the job stops when it sees this (and the metrics).
        done = {"step": saved.latest.step if saved.latest else None, "finished_at": time.time()}
        storage = config.checkpoint.open_root()
        storage.create()  # a job that committed nothing may have no root yet
        storage.write(DONE_MARKER, json.dumps(done).encode())
    return result
