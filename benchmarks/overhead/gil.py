"""``--gil`` of :mod:`benchmarks.overhead`: which threads hold the GIL while the model trains
and commits continuously (a save every step, ``on_busy="skip"``, fp32 and 4-bit): ``py-spy
record --gil --threads`` on each rank for ``--gil-s`` seconds per format gives each thread
group's share of the samples (training, ``cnr-writer``, ``cnr-io``, others).

Target (fp32 and 4-bit): the writer's threads hold the GIL in <= 10% of the samples.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks.harness import Bench, Outcome
from benchmarks.measure import QUANTS, StepLoop, gathered, max_over_ranks, rmtree
from benchmarks.overhead.common import warm_trainer
from benchmarks.results import Goal, Table
from torchrec_cnr import CheckpointConfig, CheckpointManager

GIL_GROUPS = ("training", "cnr-writer", "cnr-io", "other")


def _gil_shares(raw: str) -> dict[str, float]:
    """Each thread group's share of the samples of ``py-spy record --format raw --threads``
    (a line per stack: ``thread (<tid>): <name>;frame;... <count>``)."""
    counts = dict.fromkeys(GIL_GROUPS, 0)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        head = stack.split(";", 1)[0]
        if count.isdigit() and head.startswith("thread ("):
            name = head.partition("): ")[2]
            group = next((g for g in GIL_GROUPS[1:3] if name.startswith(g)), "other")
            counts["training" if name == "MainThread" else group] += int(count)
    total = sum(counts.values())
    if not total:
        raise RuntimeError(f"py-spy recorded no sample holding the GIL: {raw[:200]!r}")
    return {g: c / total for g, c in counts.items()} | {"samples": total}


def _gil_run(b: Bench, trainer: StepLoop, quant: str) -> dict[str, Any]:
    """One format: train and save every step for ``--gil-s`` seconds under py-spy."""
    root = b.scratch / f"gil_{quant}"
    rmtree(root)
    cfg = CheckpointConfig(path=str(root), policy="intermittent", quantize=QUANTS[quant],
                           on_busy="skip")  # fmt: skip
    out = b.artifacts / f"gil_{quant}_rank{b.rank}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    with CheckpointManager(trainer.work.model, cfg) as ckpt:
        ckpt.save(trainer.step)
        ckpt.wait()  # the baseline: what follows is the steady state
        dist.barrier()
        spy = subprocess.Popen(
            [str(Path(sys.executable).parent / "py-spy"), "record", "--gil", "--threads",
             "--nonblocking", "--format", "raw", "--rate", "100", "--duration",
             str(max(1, round(b.args.gil_s))), "--pid", str(os.getpid()), "--output", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        saves = steps = 0
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*skipped: the checkpoint of step")
            while not max_over_ranks(float(spy.poll() is not None))[0]:  # the ranks step together
                trainer.train(1)
                steps += 1
                saves += bool(ckpt.save(trainer.step))
        ckpt.wait()
    if spy.wait() != 0:
        output = spy.stdout.read() if spy.stdout else ""
        raise RuntimeError(f"py-spy failed ({spy.returncode}): {output}")
    shares = _gil_shares(out.read_text())
    rmtree(root)
    first = gathered(shares | {"saves": saves, "steps": steps})[0]
    return {"format": quant, **first, "writer": first["cnr-writer"] + first["cnr-io"]}


def run(b: Bench) -> Outcome:
    """The GIL's holders during continuous commits, per format."""
    trainer, _ = warm_trainer(b)
    rows = [_gil_run(b, trainer, quant) for quant in QUANTS]
    for r in rows:
        b.log_row(r)
    m = {"mode": "gil", "world_size": b.world, "seconds": b.args.gil_s,
         "formats": {r["format"].replace("-", ""): r for r in rows}}  # fmt: skip
    table = Table.of(
        f"Share of the samples holding the GIL, by thread, during continuous commits "
        f"(rank 0 of {b.world}, {b.args.gil_s:.0f} s per format)",
        rows,
        {"format": "format", "training": "training", "writer (cnr-writer)": "cnr-writer",
         "I/O (cnr-io)": "cnr-io", "other": "other", "samples": "samples", "commits": "saves",
         "steps": "steps"},
        "py-spy record --gil --threads --nonblocking at 100 Hz on rank 0's process.",
    )  # fmt: skip
    targets = [
        Goal(f"{r['format']}: the writer's threads hold the GIL in <= 10% of the samples",
             f"formats.{r['format'].replace('-', '')}.writer", "<=", 0.10)
        for r in rows
    ]  # fmt: skip
    return Outcome(m, [table], targets)
