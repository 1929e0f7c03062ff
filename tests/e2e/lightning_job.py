"""A Lightning job: TorchRec's ``TestSparseNN`` trained by Lightning's ``Trainer.fit`` with
``ModelParallelStrategy`` (the DMP model built in ``configure_model()``), the library's
callback checkpointing it, as a user's ``train.py`` would under torchrun.

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 tests/e2e/lightning_job.py \
        --root DIR --steps 30 --every 10 [--kill-after 20] --out STATE

With ``--kill-after N``, rank 1 SIGKILLs itself right after the save of step N returned (in
the job's first attempt), while that checkpoint commits; torchrun restarts the job, which
resumes from the latest committed step. Each rank writes a digest of its whole state at the
end to ``STATE.<rank>``, and the step it resumed from to ``STATE.<rank>.resumed``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.docs.standins import digest  # noqa: E402
from tests.jobs import Job, make_job  # noqa: E402
from torchrec_cnr import CheckpointConfig  # noqa: E402
from torchrec_cnr.launch import init_distributed  # noqa: E402
from torchrec_cnr.trainers.lightning import LightningCheckpointer  # noqa: E402


class Module(pl.LightningModule):
    """The job as a LightningModule: the DMP model is built in ``configure_model()``; the
    dense optimizer is Lightning's, the fused one updates the rows in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.job: Job | None = None
        self.reader = Reader(self)

    def configure_model(self) -> None:
        if self.job is None:
            self.job = make_job("ebc", optimizer="exact_adagrad", seed=1)
            self.model = self.job.model

    def training_step(self, batch: tuple[int, Any], batch_idx: int) -> torch.Tensor:
        assert self.job is not None
        self.reader.trained, data = batch
        return self.job.loss(self.model, data)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.job is not None
        return self.job.dense_opt


class Reader:
    """The job's batches, a pure function of the rank and the position, each with its
    position. Lightning fetches a batch ahead of the one it trains and saves a resumable
    dataloader's state as it is then: the state here is the position of the batch trained
    last (set by ``training_step``), so that a resumed job reads on from the next one."""

    def __init__(self, module: Module) -> None:
        self.module, self.position, self.trained = module, 0, 0

    def __iter__(self) -> Reader:
        return self

    def __next__(self) -> tuple[int, Any]:
        assert self.module.job is not None
        self.position += 1
        return self.position, self.module.job.data.batch(dist.get_rank(), self.position)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.trained}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = self.trained = state["position"]


class KillAfter(pl.Callback):
    """SIGKILLs rank 1 right after the save of step ``after`` returned, first attempt only."""

    def __init__(self, after: int) -> None:
        self.after = after

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.global_step == self.after and first and dist.get_rank() == 1:
            print(f"rank 1 SIGKILLed after the save of step {self.after}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--kill-after", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    init_distributed("gloo")  # before Lightning, which reuses the group
    try:
        module = Module()
        reader = module.reader
        config = CheckpointConfig(path=args.root, interval_steps=args.every, keep_last=args.keep)
        checkpointer = LightningCheckpointer(config)  # after the kill: it saves first
        callbacks: list[pl.Callback] = [checkpointer]
        if args.kill_after:
            callbacks.append(KillAfter(args.kill_after))
        trainer = pl.Trainer(
            strategy=ModelParallelStrategy(), accelerator="cpu", devices=2,
            max_steps=args.steps, enable_checkpointing=False, logger=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        )  # fmt: skip
        trainer.fit(module, reader)
        assert module.job is not None
        out = f"{args.out}.{dist.get_rank()}"
        Path(out).write_text(digest(module.model, module.job.dense_opt, reader))
        Path(f"{out}.resumed").write_text(str(checkpointer.restored_step))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
