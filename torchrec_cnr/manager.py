"""The checkpoint manager: a thin orchestrator over tracking, policy, staging,
writing, manifest and restore."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchrec_cnr import model_state
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.manifest import Manifest, ShardRecord, checkpoint_id, tree_bytes
from torchrec_cnr.policy import ChainState, Decision, Policy
from torchrec_cnr.restore import check_compatible, dense_signature, model_signature, restore_chain
from torchrec_cnr.staging import stage
from torchrec_cnr.tracking import bitmap
from torchrec_cnr.writer import write_snapshot

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Saves and restores differential checkpoints of a TorchRec model.

    Every rank constructs one and calls :meth:`save` / :meth:`restore` at the
    same steps; both are collective over ``pg``.

    Args:
        model: a ``DistributedModelParallel`` sharded with :func:`tracking_sharders`.
        config: what, where and when to save.
        app_state: extra objects with ``state_dict()`` / ``load_state_dict()``
            (data reader, dense optimizer, RNG holder, ...), saved per rank.
        pg: process group of the model's ranks; the default group if ``None``.

    Example::

        ckpt = CheckpointManager(model, CheckpointConfig(path=root, policy="intermittent",
                                 interval_steps=500), app_state={"reader": reader})
        start = ckpt.restore() or 0
        for step in range(start + 1, steps + 1):
            train_step(model, next(reader))
            ckpt.maybe_save(step)
        ckpt.wait()
    """

    def __init__(
        self,
        model: nn.Module,
        config: CheckpointConfig,
        app_state: Mapping[str, Any] | None = None,
        pg: dist.ProcessGroup | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "CheckpointManager needs an initialized torch.distributed process group"
            )
        for name, obj in (app_state or {}).items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ValueError(f"app_state[{name!r}] needs state_dict() and load_state_dict()")
        self.model = model
        self.config = config
        self.app_state = dict(app_state or {})
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)
        self.root = Path(config.path)
        self.policy = Policy(config.policy, config.baseline_rule)
        self._trackers = model_state.trackers(model)
        self._shards = model_state.local_shards(model)
        self._state = ChainState()
        self._last_saved_step: int | None = None
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        self._barrier()

    # -- collectives -------------------------------------------------------

    def _barrier(self) -> None:
        dist.barrier(group=self.pg)

    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def _all_ok(self, ok: bool) -> bool:
        flag = torch.tensor([0 if ok else 1])
        dist.all_reduce(flag, group=self.pg)
        return int(flag.item()) == 0

    # -- bits --------------------------------------------------------------

    def _words(self) -> list[torch.Tensor]:
        return [s.words for s in self._shards if s.words is not None]

    # -- save --------------------------------------------------------------

    def maybe_save(self, step: int) -> bool:
        """Saves if ``step`` is a multiple of ``config.interval_steps``; returns whether it did."""
        interval = self.config.interval_steps
        if interval is None or step <= 0 or step % interval or step == self._last_saved_step:
            return False
        self.save(step)
        return True

    def save(self, step: int) -> None:
        """Checkpoints the model, its optimizer state and ``app_state`` at ``step``.

        Collective: every rank calls it with the same ``step``. When it returns,
        the checkpoint is committed.

        Raises:
            ValueError: ``step`` is negative or not an int.
            RuntimeError: writing failed on some rank. The previous checkpoint
                stays the restore target and no modified row is forgotten.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        manifest = Manifest.load(self.root)
        decision = self.policy.decide(self._state)
        for kernel in {id(s.kernel): s.kernel for s in self._shards}.values():
            kernel.flush()  # caching kernels write their cache back first
        staged = stage(
            step, decision.kind, self._shards, model_state.dense_state(self.model), self.app_state
        )
        # Bits restart at staging time; rows modified while the write runs
        # belong to the next checkpoint. On failure the staged bits go back.
        pending = [w.clone() for w in self._words()] if decision.clear_bits else []
        if decision.clear_bits:
            for w in self._words():
                w.zero_()
        try:
            self._write_and_commit(manifest, decision, staged)
        except BaseException:
            for w, p in zip(self._words(), pending):
                w |= p
            raise
        self._last_saved_step = step

    def _write_and_commit(self, manifest: Manifest, decision: Decision, staged: Any) -> None:
        seq = manifest.next_seq()
        ckpt_id = checkpoint_id(seq, staged.step)
        path = self.root / ckpt_id
        if self.rank == 0 and path.exists():
            shutil.rmtree(path)  # left by an attempt that never committed
        self._barrier()
        error: BaseException | None = None
        try:
            write_snapshot(path, staged, self.pg)
        except Exception as e:  # every rank must learn of it before anyone commits
            error = e
        records = [s.record() for s in staged.shards]
        gathered = self._gather(
            (error is None, [r.to_json() for r in records], model_signature(self._shards))
        )
        failed = [r for r, (ok, _, _) in enumerate(gathered) if not ok]
        if failed:
            raise RuntimeError(
                f"checkpoint of step {staged.step} failed on rank(s) {failed}; "
                "the previous checkpoint stays the restore target"
            ) from error
        shard_records = [rec for _, recs, _ in gathered for rec in recs]
        tables: dict[str, dict[str, int]] = {}
        for _, _, sig in gathered:
            tables.update(sig)
        full_elems = sum(r["spec"]["rows"] * r["spec"]["cols"] for r in shard_records)
        saved_elems = sum(r["saved_rows"] * r["spec"]["cols"] for r in shard_records)
        size = saved_elems / full_elems if full_elems else 0.0
        new_state = self.policy.advance(self._state, decision, ckpt_id, size)
        if self.rank == 0:
            entry = Manifest.entry(
                seq=seq,
                step=staged.step,
                kind=decision.kind,
                policy=self.policy.name,
                chain=new_state.chain,
                sizes=new_state.sizes,
                world_size=self.world_size,
                tables=tables,
                dense=dense_signature(staged.dense),
                shards=[ShardRecord(**r) for r in shard_records],
                nbytes=tree_bytes(path),
            )
            manifest.checkpoints.append(entry)
            # IMPORTANT: the manifest names the checkpoint only after every
            # rank reported its files durable (the gather above).
            manifest.save(self.root)
            self._collect_garbage(manifest)
        self._barrier()
        self._state = new_state
        logger.info(
            "checkpoint %s committed (%s, %.1f%% of rows)", ckpt_id, decision.kind, 100 * size
        )

    def _collect_garbage(self, manifest: Manifest) -> None:
        if self.config.keep_last is None:
            return
        needed = manifest.needed_ids(self.config.keep_last)
        dropped = [e["id"] for e in manifest.checkpoints if e["id"] not in needed]
        if not dropped:
            return
        manifest.checkpoints = [e for e in manifest.checkpoints if e["id"] in needed]
        manifest.save(self.root)  # forget before deleting: never a manifest naming missing files
        for ckpt_id in dropped:
            shutil.rmtree(self.root / ckpt_id, ignore_errors=True)

    def wait(self) -> None:
        """Blocks until the pending checkpoint is committed (saves are synchronous for now)."""

    # -- restore -----------------------------------------------------------

    def restore(self, step: int | None = None) -> int | None:
        """Loads a committed checkpoint into the model, its optimizer state and ``app_state``.

        Args:
            step: the step to restore; the latest committed checkpoint if ``None``.

        Returns:
            The restored step, or ``None`` if the root holds no checkpoint.

        Raises:
            ValueError: no committed checkpoint has ``step``.
            ModelMismatchError: the checkpoint belongs to another model; nothing changed.
            CheckpointReadError: a file of the chain is missing or unreadable; nothing changed.
        """
        manifest = Manifest.load(self.root)
        entry = manifest.find(step)
        if entry is None:
            if step is None:
                return None
            raise ValueError(
                f"no committed checkpoint of step {step} in {self.root}; committed steps: {manifest.steps()}"
            )
        tables: dict[str, dict[str, int]] = {}
        for sig in self._gather(model_signature(self._shards)):
            tables.update(sig)
        dense = model_state.dense_state(self.model)
        check_compatible(entry, tables, dense_signature(dense), str(self.root))
        error: BaseException | None = None
        try:
            touched = restore_chain(
                self.root, manifest, entry, self._shards, dense, self.app_state, self.rank
            )
        except Exception as e:  # every rank must leave restore together
            error = e
        if not self._all_ok(error is None):
            if error is not None:
                raise error
            raise RuntimeError(f"restore of step {entry['step']} failed on another rank")
        for w in self._words():
            w.zero_()
        if entry["policy"] == self.policy.name:
            self._state = ChainState(list(entry["chain"]), list(entry["sizes"]))
            if self.policy.name in ("one_shot", "intermittent"):
                # The next delta must hold every row changed since the baseline,
                # including those this restore took from the chain's deltas.
                for shard, mask in zip(self._shards, touched):
                    if shard.words is not None:
                        bitmap.set_bits(shard.words, mask.nonzero().flatten())
        else:
            self._state = ChainState()  # another policy wrote it: start a new baseline
        self._barrier()
        if self.rank == 0:
            manifest.restores += 1
            manifest.save(self.root)
        self._barrier()
        self._last_saved_step = entry["step"]
        return int(entry["step"])
