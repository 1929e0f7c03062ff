"""Export and compaction of a ~1 GB consecutive chain (a baseline and ``--deltas`` deltas of
``--fraction`` of the rows): in the job, ``compact()`` to ``wait()`` against a full save,
and the cold restore before and after; offline, in one process, ``export_state_dict``,
``torch.save``, ``read_table`` and ``cnr compact``, against reading as many bytes.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from benchmarks import measure
from benchmarks.harness import Bench, Case, Outcome, cli
from benchmarks.results import Table
from torchrec_cnr import CheckpointConfig, CheckpointManager, offline
from torchrec_cnr.cli import main as cnr
from torchrec_cnr.testing.rows import modify
from torchrec_cnr.tracking.model_state import local_shards

T = TypeVar("T")


def _arguments(p: argparse.ArgumentParser) -> None:
    measure.model_arguments(p, rows=500_000)
    p.add_argument("--deltas", type=int, default=3)
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--disk-mb", type=int, default=1024, help="size of the disk test")
    p.add_argument("--repeats", type=int, default=3, help="offline reads, median")


def _chain(b: Bench, root: Path, model: torch.nn.Module) -> CheckpointManager:
    """A consecutive chain of a baseline and ``--deltas`` deltas; the manager stays open."""
    shards = local_shards(model)
    ckpt = CheckpointManager(model, CheckpointConfig(path=str(root), policy="consecutive"))
    measure.timed_save(ckpt, 1)
    frac = b.args.fraction
    for step in range(2, b.args.deltas + 2):
        modify(shards, measure.random_rows(shards, [frac], seed=step)[frac])
        measure.timed_save(ckpt, step)
    return ckpt


def _in_job(b: Bench, model: torch.nn.Module) -> dict[str, Any]:
    root, step = b.scratch / "in_job", b.args.deltas + 1
    ckpt = _chain(b, root, model)
    measure.drop_cache(root)
    restore_chain, _ = measure.timed(lambda: ckpt.restore(step))

    def compact() -> None:
        ckpt.compact()
        ckpt.wait()

    watched = measure.Peak(compact)
    compact_s, _ = measure.timed(watched)
    measure.drop_cache(root)
    restore_one, _ = measure.timed(lambda: ckpt.restore(step))
    ckpt.close()
    # The peer: a full save of the same state, committed (what a fresh baseline costs).
    with CheckpointManager(model, CheckpointConfig(str(b.scratch / "full"), policy="full")) as full:
        _, full_s = measure.timed_save(full, step)
    infos = {i.id: i for i in measure.from_rank0(lambda: offline.list_checkpoints(str(root)))}
    latest = list(infos.values())[-1]
    assert latest.compacted_from and len(latest.chain) == 1, latest
    return {"compact_s": compact_s, "full_save_s": full_s, "restore_chain_s": restore_chain,
            "restore_compacted_s": restore_one, "compact_peak_mb": watched.over_ranks(),
            "chain_bytes": infos[latest.compacted_from].restore_bytes,
            "compacted_bytes": latest.bytes}  # fmt: skip


def _offline_figures(root: Path, out: Path, repeats: int) -> dict[str, Any]:
    """In this process alone, without a model or a process group."""
    times: dict[str, list[float]] = {"export": [], "save": [], "table": [], "compact": []}
    compact = measure.Peak(lambda: cnr(["compact", str(root)]))

    def clock(name: str, fn: Callable[[], T]) -> T:
        measure.evict(root)  # every read is cold
        t0 = time.perf_counter()
        value = fn()
        times[name].append(time.perf_counter() - t0)
        return value

    read_bytes = offline.checkpoint_info(str(root)).restore_bytes
    for _ in range(repeats):
        state_dict = clock("export", lambda: offline.export_state_dict(str(root)))
        clock("save", functools.partial(offline.save_export, state_dict, out, "torch"))
        out.unlink()
        del state_dict
        clock("table", lambda: offline.read_table(str(root), "t0"))
    assert clock("compact", compact) == 0
    medians = {f"{k}_s": statistics.median(v) for k, v in times.items()}
    return {"read_bytes": read_bytes, "compact_peak_mb": compact.mb, **medians}


def run(b: Bench) -> Outcome:
    a = b.args
    model = measure.uniform_model(a).model
    disk = measure.disk_bandwidth(b.scratch, a.disk_mb << 20, chunk=8 << 20)
    b.log("chain in a job, compacted by the job")
    job = _in_job(b, model)
    b.log("second chain, then export and offline compaction in one process")
    _chain(b, b.scratch / "offline", model).close()
    export = b.scratch / "export.pt"
    off = measure.from_rank0(lambda: _offline_figures(b.scratch / "offline", export, a.repeats))
    off["read_disk_s"] = off["read_bytes"] / measure.GB / disk["read_gb_s"]
    m = {"disk": disk, "in_job": job, "offline": off}
    rows = [
        ["compaction in the job (`compact()` to `wait()`), s", job["compact_s"],
         f"full save of the same model {job['full_save_s']:.2f} s"],
        ["compaction offline (`cnr compact`, 1 process), s", off["compact_s"], ""],
        ["peak memory of the compaction in the job over its start, MB (largest rank)",
         job["compact_peak_mb"], f"a table's shard: {a.rows * a.dim * 4 / 2**20:.0f} MB"],
        ["peak memory of `cnr compact` over its start, MB", off["compact_peak_mb"], ""],
        [f"restore of that step, chain of {a.deltas + 1}, s", job["restore_chain_s"],
         f"after compaction: {job['restore_compacted_s']:.2f} s"],
        ["`export_state_dict` (1 process, cold cache), s", off["export_s"],
         f"reading its {off['read_bytes'] / measure.GB:.2f} GB from disk: {off['read_disk_s']:.2f} s"],
        ["writing the export with `torch.save`, s", off["save_s"], ""],
        [f"`read_table` of one {a.rows} x {a.dim} table, s", off["table_s"], ""],
    ]  # fmt: skip
    note = (
        f"{a.tables} tables x {a.rows} rows x dim {a.dim} fp32 on {b.world} ranks; a consecutive "
        f"chain of a baseline and {a.deltas} deltas of {a.fraction:.0%} "
        f"({job['chain_bytes'] / measure.GB:.2f} GB stored); disk: write {disk['write_gb_s']:.2f} GB/s, "
        f"read {disk['read_gb_s']:.2f} GB/s"
    )
    table = Table("Export and compaction", ["figure", "value", "peer, same run"], rows, note)
    return Outcome(m, [table])


CASE = Case("offline", "Export and compaction of a 1 GB chain", _arguments,
            "--tables 2 --rows 4000 --dim 16 --deltas 2 --disk-mb 8 --repeats 1", run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
