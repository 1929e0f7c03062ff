"""A torchtnt job: TorchRec's ``TestSparseNN`` trained by torchtnt's ``train()``, the
library's callback checkpointing it, as a user's ``train.py`` would under torchrun.

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 tests/e2e/tnt_job.py \
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

import torch
import torch.distributed as dist
from torchtnt.framework import train
from torchtnt.framework.callback import Callback
from torchtnt.framework.state import State
from torchtnt.framework.unit import TrainUnit

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.docs.standins import digest  # noqa: E402
from tests.jobs import Job, make_job  # noqa: E402
from torchrec_cnr import CheckpointConfig  # noqa: E402
from torchrec_cnr.launch import init_distributed  # noqa: E402
from torchrec_cnr.trainers.tnt import TorchtntCheckpointer  # noqa: E402


class Reader:
    """The job's batches, a pure function of the rank and the step; its position in its
    state dict, so that a resumed job reads on from where the saved one was."""

    def __init__(self, job: Job) -> None:
        self.job, self.position = job, 0

    def __iter__(self) -> Reader:
        return self

    def __next__(self) -> Any:
        self.position += 1
        return self.job.data.batch(dist.get_rank(), self.position)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class Unit(TrainUnit[Any]):
    """One training step of the job: forward, backward (the fused optimizer updates the
    rows), the dense optimizer."""

    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job

    def train_step(self, state: State, data: Any) -> None:
        self.job.dense_opt.zero_grad()
        self.job.loss(self.job.model, data).backward()
        self.job.dense_opt.step()


class KillAfter(Callback):
    """SIGKILLs rank 1 right after the save of step ``after`` returned, first attempt only."""

    def __init__(self, after: int) -> None:
        self.after = after

    def on_train_step_end(self, state: State, unit: TrainUnit[Any]) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if unit.train_progress.num_steps_completed == self.after and first:
            if dist.get_rank() == 1:
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
    init_distributed("gloo")
    try:
        job = make_job("ebc", optimizer="exact_adagrad", seed=1)
        torch.manual_seed(dist.get_rank())
        reader = Reader(job)
        config = CheckpointConfig(path=args.root, interval_steps=args.every, keep_last=args.keep)
        checkpointer = TorchtntCheckpointer(
            job.model, config, app_state={"reader": reader, "dense_opt": job.dense_opt}
        )
        callbacks: list[Callback] = [checkpointer]
        if args.kill_after:
            callbacks.append(KillAfter(args.kill_after))
        train(Unit(job), reader, max_steps=args.steps, callbacks=callbacks)
        out = f"{args.out}.{dist.get_rank()}"
        Path(out).write_text(digest(job.model, job.dense_opt, reader))
        Path(f"{out}.resumed").write_text(str(checkpointer.restored_step))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
