"""``--gil`` of :mod:`benchmarks.overhead`: which threads hold the GIL while the model trains
and commits continuously (a save every step, ``on_busy="skip"``), the writer on threads or
in its own process: ``py-spy record --gil --threads`` on each rank for ``--gil-s`` seconds.
Target (writer process): the writer's threads hold the GIL in <= 10% of the samples.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks.harness import Bench, Outcome
from benchmarks.measure import QUANTS, StepLoop, gathered, max_over_ranks, process_cpu_s, rmtree
from benchmarks.overhead import warm_trainer
from benchmarks.results import Goal, Table
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.config import BACKGROUND, Background

GIL_GROUPS = ("training", "cnr-writer", "cnr-encode", "cnr-io", "cnr-tracker", "other")
WRITER = GIL_GROUPS[1:4]


def _gil_shares(raw: str) -> dict[str, float]:
    """Each thread group's share of the samples of ``py-spy record --format raw --threads``
    (a line per stack: ``thread (<tid>): <name>;frame;... <count>``)."""
    counts = dict.fromkeys(GIL_GROUPS, 0)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        head = stack.split(";", 1)[0]
        if count.isdigit() and head.startswith("thread ("):
            name = head.partition("): ")[2]
            group = next((g for g in GIL_GROUPS[1:-1] if name.startswith(g)), "other")
            counts["training" if name == "MainThread" else group] += int(count)
    total = sum(counts.values())
    if not total:
        raise RuntimeError(f"py-spy recorded no sample holding the GIL: {raw[:200]!r}")
    return {g: c / total for g, c in counts.items()} | {"samples": total}


def _gil_run(b: Bench, trainer: StepLoop, quant: str, background: Background) -> dict[str, Any]:
    """One format and writer: train and save every step for ``--gil-s`` seconds under py-spy."""
    root = b.scratch / f"gil_{quant}_{background}"
    rmtree(root)
    cfg = CheckpointConfig(path=str(root), policy="intermittent", quantize=QUANTS[quant],
                           on_busy="skip", background=background)  # fmt: skip
    out = b.artifacts / f"gil_{quant}_{background}_rank{b.rank}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with CheckpointManager(trainer.work.model, cfg) as ckpt:
        built = time.perf_counter()
        ckpt.save(trainer.step)
        saved = time.perf_counter()
        ckpt.wait()  # the baseline (its write waits for a writer process to start)
        first = {"built_s": built - began, "first_stall_s": saved - built,
                 "first_commit_s": time.perf_counter() - saved}  # fmt: skip
        writer = ckpt.writer_pid
        cpu0 = process_cpu_s(writer) if writer is not None else 0.0
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
        cpu = process_cpu_s(writer) - cpu0 if writer is not None else None
    if spy.wait() != 0:
        output = spy.stdout.read() if spy.stdout else ""
        raise RuntimeError(f"py-spy failed ({spy.returncode}): {output}")
    shares = _gil_shares(out.read_text())
    rmtree(root)
    rank0 = gathered(shares | first | {"saves": saves, "steps": steps})[0]
    writer_cpu = None if cpu is None or not saves else cpu / saves
    return {"format": quant, "background": background, **rank0,
            "writer": sum(rank0[g] for g in WRITER), "writer_cpu_s": writer_cpu}  # fmt: skip


def run(b: Bench) -> Outcome:
    """The GIL's holders during continuous commits, per format and writer."""
    trainer, _ = warm_trainer(b)
    rows = [_gil_run(b, trainer, q, bg) for q in QUANTS for bg in BACKGROUND]
    for r in rows:
        b.log_row(r)
    m = {"mode": "gil", "world_size": b.world, "seconds": b.args.gil_s,
         "runs": {f"{r['format'].replace('-', '')}_{r['background']}": r for r in rows}}  # fmt: skip
    table = Table.of(
        f"Share of the training process's samples holding the GIL, by thread, during "
        f"continuous commits (rank 0 of {b.world}, {b.args.gil_s:.0f} s per run)", rows,
        {"format": "format", "writer": "background", "training": "training",
         "writer's threads": "writer", "cnr-writer": "cnr-writer", "cnr-encode": "cnr-encode",
         "cnr-io": "cnr-io", "tracker": "cnr-tracker", "other": "other",
         "samples": "samples", "commits": "saves", "training steps": "steps",
         "writer process CPU s / commit": "writer_cpu_s", "manager built s": "built_s",
         "first save: stall s": "first_stall_s", "first save: commit s": "first_commit_s"},
        "py-spy record --gil --threads --nonblocking at 100 Hz on rank 0's training process "
        "(the writer process is not sampled: its CPU time per commit is a column). First "
        "save: the baseline saved before sampling, its stall and its commit (which waits for "
        "a writer process to have started), after the manager was built.",
    )  # fmt: skip
    targets = [
        Goal(f"{r['format']}, writer process: the writer's threads hold the GIL in <= 10% of "
             "the training process's samples",
             f"runs.{r['format'].replace('-', '')}_process.writer", "<=", 0.10)
        for r in rows if r["background"] == "process"
    ]  # fmt: skip
    return Outcome(m, [table], targets)
