"""A commit's cost against the history before it, from checkpoint 10 to 10,000.

The model trains one step between saves, each waited for, every checkpoint kept. Over the
``--window`` commits ending at each of ``--probes``: save + commit time, the metadata bytes
rank 0's commit reads and writes, the writer's CPU, a follower's update and a restore's
planning (``ChainReader.open``). Targets: each figure at the last probe <= 1.2x the first's.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks import measure
from benchmarks.harness import Bench, Case, Outcome, cli
from benchmarks.results import Column, Goal, Table
from cnr_train.serve import serving_model
from cnr_train.workload import ZipfBatches
from torchrec_cnr import CheckpointConfig, CheckpointManager, Follower
from torchrec_cnr.manifest.store import TAIL
from torchrec_cnr.read import ChainReader
from torchrec_cnr.serving import FloatTarget
from torchrec_cnr.storage import CountingStorage, open_storage

# The module of the save's commit job, which calls write_rank and write_and_commit.
compact: Any = importlib.import_module("torchrec_cnr.commit.job")

FIGURES = ("stall_s", "commit_s", "read_b", "written_b", "writer_cpu_s", "follow_s", "follow_b",
           "plan_s", "plan_b", "plan_link_s", "links")  # fmt: skip


def _arguments(p: argparse.ArgumentParser) -> None:
    measure.model_arguments(p, rows=5000, tables=4, dim=16)
    p.add_argument("--policies", nargs="+", default=["intermittent", "consecutive"])
    p.add_argument("--probes", type=int, nargs="+", default=[10, 100, 300, 1000, 3000, 10000])
    p.add_argument("--window", type=int, default=TAIL, help="commits per probe (a sealing cycle)")


class _WriterClock:
    """The background writer's CPU seconds for each write and commit on this rank."""

    PARTS = ("write_rank", "write_and_commit")

    def __init__(self) -> None:
        self.last = 0.0
        self._inner = {name: getattr(compact, name) for name in self.PARTS}
        for name in self.PARTS:
            setattr(compact, name, self._timed(name))

    def _timed(self, name: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if name == self.PARTS[0]:
                self.last = 0.0
            t0 = time.thread_time()
            try:
                return self._inner[name](*args, **kwargs)
            finally:
                self.last += time.thread_time() - t0

        return timed

    def close(self) -> None:
        for name, fn in self._inner.items():
            setattr(compact, name, fn)


def _policy(b: Bench, policy: measure.Policy) -> list[dict[str, Any]]:
    a = b.args
    work = measure.uniform_model(a)
    loop = measure.StepLoop(work, ZipfBatches(work.tables, batch_size=64, seed=3), b.rank)
    root = b.scratch / policy
    storage = CountingStorage(open_storage(str(root)))
    ckpt = CheckpointManager(work.model, CheckpointConfig(path=str(root), policy=policy),
                             {"dense_opt": work.opt}, storage=storage)  # fmt: skip
    follower_box: list[Follower] = []
    clock = _WriterClock()
    last = max(a.probes)
    measured = {p for probe in a.probes for p in range(probe - a.window + 1, probe + 1)}
    rows: list[dict[str, Any]] = []
    window: list[dict[str, float]] = []
    try:
        for step in range(1, last + 1):
            loop.train(1)
            storage.bytes_read = storage.bytes_written = 0
            stall_s, commit_s = measure.timed_save(ckpt, step)
            if step + 1 in measured and step not in measured and b.rank == 0:
                _follower(root, follower_box, work).poll()  # one behind at the window's start
            if step not in measured:
                continue
            got = {"stall_s": stall_s, "commit_s": commit_s, "read_b": storage.bytes_read,
                   "written_b": storage.bytes_written}  # fmt: skip
            got["writer_cpu_s"] = measure.max_over_ranks(clock.last)[0]
            got |= measure.bcast(_follow_and_plan(root, follower_box, work) if b.rank == 0 else {})
            window.append(got)
            if step in a.probes:
                rows.append(_summary(policy, step, window, root))
                b.log_row(rows[-1])
                window = []
            dist.barrier()
    finally:
        clock.close()
        for follower in follower_box:
            follower.close()
        ckpt.close()
    return rows


def _follower(root: Path, box: list[Follower], work: measure.Workload) -> Follower:
    """The follower of ``root``, made at the first window (its first poll loads cold)."""
    if not box:
        box.append(Follower(str(root), FloatTarget(serving_model(work.tables, 4, "fp32"))))
    return box[0]


def _follow_and_plan(root: Path, box: list[Follower], work: measure.Workload) -> dict[str, float]:
    """A follower's update to the commit just made, and a restore's planning of it."""
    follower = _follower(root, box, work)
    follower.poll()
    report = follower.reports[-1]
    planner = CountingStorage(open_storage(str(root)))
    t0 = time.perf_counter()
    with ChainReader.open(planner, verify=False) as chain:
        assert all(chain.manifest.shards(link) for link in chain.links)  # every link's record
    plan_s, links = time.perf_counter() - t0, len(chain.links)
    return {"follow_s": report.seconds, "follow_b": report.bytes_read, "plan_s": plan_s,
            "plan_b": planner.bytes_read, "plan_link_s": plan_s / links, "links": links}  # fmt: skip


def _summary(policy: str, step: int, window: list[dict[str, float]], root: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"policy": policy, "checkpoint": step}
    for key in FIGURES:
        values = [w[key] for w in window if key in w]
        if not values:
            continue
        row[key] = statistics.median(values) if key.endswith("_s") else statistics.fmean(values)
    manifest = root / "manifest.json"
    row["manifest_b"] = manifest.stat().st_size if manifest.exists() else 0
    return row


def _goals(probes: list[int], policies: list[str]) -> list[Goal]:
    first, last = min(probes), max(probes)
    figures = (("commit_s", "save + commit"), ("read_b", "bytes a commit reads"),
               ("written_b", "bytes a commit writes"),
               ("writer_cpu_s", "the writer's CPU per commit"),
               ("follow_s", "a follower's update"))  # fmt: skip
    # A restore's planning, per link for a consecutive chain (it grows until compacted).
    planning = {"consecutive": ("plan_link_s", "a restore's planning per chain link")}
    return [
        Goal(f"{policy}: {what} at checkpoint {last} <= 1.2x checkpoint {first}",
             f"{policy}.{last}.{key}", "<=", f"{policy}.{first}.{key}", 1.2)
        for policy in policies
        for key, what in (*figures, planning.get(policy, ("plan_s", "a restore's planning")))
    ]  # fmt: skip


def run(b: Bench) -> Outcome:
    a = b.args
    rows = [r for policy in a.policies for r in _policy(b, policy)]
    by: dict[str, dict[str, Any]] = {}
    for r in rows:
        by.setdefault(r["policy"], {})[str(r["checkpoint"])] = r
    columns: dict[str, Column] = {"policy": "policy", "checkpoint": "checkpoint",
               "stall (ms)": lambda r: 1e3 * r["stall_s"],
               "save + commit (ms)": lambda r: 1e3 * r["commit_s"],
               "commit reads (KB)": lambda r: r["read_b"] / 1e3,
               "commit writes (KB)": lambda r: r["written_b"] / 1e3,
               "writer CPU (ms)": lambda r: 1e3 * r["writer_cpu_s"],
               "follower update (ms)": lambda r: 1e3 * r["follow_s"],
               "restore planning (ms)": lambda r: 1e3 * r["plan_s"], "chain links": "links",
               "planning per link (ms)": lambda r: 1e3 * r["plan_link_s"],
               "manifest.json (KB)": lambda r: r["manifest_b"] / 1e3}  # fmt: skip
    table = Table.of(
        "A commit against the history before it (medians and means over each window)", rows,
        columns, note=f"{a.tables} tables of {a.rows} x {a.dim}, 2 ranks, a save every step, "
        f"each waited for, every checkpoint kept; {a.window} commits per probe",
    )  # fmt: skip
    return Outcome({"rows": rows, **by}, [table], _goals(a.probes, a.policies))


CASE = Case("history", "History: a commit's cost from checkpoint 10 to 10,000", _arguments,
            "--probes 10 40 --rows 500", run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
