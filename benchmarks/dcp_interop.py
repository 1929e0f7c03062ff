"""DCP import and export of a ~1 GB model against DCP's own save and load, in turns, caches
dropped before each: ``export_dcp`` (blocks of ``--budget-mb``) against ``dcp.save``;
``restore(from_dcp=)`` against ``dcp.load``; a restore resharded row-wise, unbounded and
within ``--restore-mb``, against ``dcp.load``. Time is the slowest rank's; memory the peak
resident set above each call's start, the largest rank's. Targets: each <= its DCP peer.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from benchmarks import measure
from benchmarks.harness import Bench, Case, Outcome, cli
from benchmarks.measure import GB
from benchmarks.results import Goal, Table
from cnr_train.workload import TableSpec, build_model, dense_optimizer
from torchrec_cnr import CheckpointConfig, CheckpointManager, export_dcp
from torchrec_cnr.interop import ExportOptions, dcp_io
from torchrec_cnr.storage.fs import tree_bytes


def _arguments(p: argparse.ArgumentParser) -> None:
    measure.model_arguments(p, rows=500_000)
    p.add_argument("--rounds", type=int, default=3, help="turns of each method")
    p.add_argument("--budget-mb", type=int, default=256, help="export_dcp's block budget")
    p.add_argument("--restore-mb", type=int, default=128, help="the bounded restore's budget")
    p.add_argument("--threads", type=int, default=1, help="export_dcp's writer threads")


def _recipe(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    optim = model.fused_optimizer.state_dict()  # type: ignore[operator, union-attr]
    return {"model": model.state_dict(), "optim": optim, "dense_opt": opt.state_dict()}


def _dcp_load(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    """Stock ``dcp.load`` of the recipe, a call per top-level key (as TorchRec's needs)."""
    sd = _recipe(model, opt)
    for key in ("model", "optim"):
        dcp.load({key: sd[key]}, checkpoint_id=str(path))


def _kept_mb() -> float:
    """The memory an earlier export kept for the next one's blocks (its pages lazily freed,
    counted in the resident set until the kernel takes them back), MB."""
    return sum(len(memory) for memory in dcp_io._spare) / 2**20  # as proc_status_mb


def run(b: Bench) -> Outcome:
    a = b.args
    work = measure.uniform_model(a)
    model, opt = work.model, work.opt
    root, ours, theirs = b.scratch / "root", b.scratch / "exported", b.scratch / "dcp_save"
    with CheckpointManager(model, CheckpointConfig(path=str(root), policy="full")) as ckpt:
        measure.timed_save(ckpt, 1)
    got: dict[str, list[tuple[float, float]]] = {}

    def turns(label: str, methods: dict[str, Callable[[], Any]], prepare: Any = None) -> None:
        """``methods`` in interleaved turns, each one's seconds and peak memory noted."""

        def go(name: str) -> float:
            watched = measure.Peak(methods[name], _kept_mb if name == "export_dcp" else None)
            seconds, _ = measure.timed(watched)
            got.setdefault(name, []).append((seconds, watched.over_ranks()))
            return seconds

        b.log(f"{label}: {' against '.join(methods)}")
        b.interleaved(a.rounds, methods, go, prepare=prepare, label=label)

    options = ExportOptions(budget_mb=a.budget_mb, threads=a.threads)
    turns("export", {
        "export_dcp": lambda: export_dcp(str(root), ours, options=options, group=dist.group.WORLD),
        "dcp_save": lambda: dcp.save(_recipe(model, opt), checkpoint_id=str(theirs)),
    }, prepare=lambda name: measure.rmtree(ours if name == "export_dcp" else theirs))  # fmt: skip
    sizes = {"export_dcp": tree_bytes(ours), "dcp_save": tree_bytes(theirs)}
    with CheckpointManager(model, CheckpointConfig(path=str(b.scratch / "imported"))) as importer:
        turns("import", {
            "import": lambda: importer.restore(from_dcp=theirs, step=1),
            "dcp_load": lambda: _dcp_load(model, opt, theirs),
        })  # fmt: skip
    # Resharding: both checkpoints (of table-wise tables) into the same tables row-wise.
    specs = [TableSpec(t.name, t.rows, t.dim, "row_wise") for t in work.tables]
    resharded = build_model(specs, seed=1)
    reshard_opt = dense_optimizer(resharded)
    # A root of its own (a copy): a manager's restore fences any other manager of its root.
    if dist.get_rank() == 0:
        shutil.copytree(root, b.scratch / "root_bounded")
    dist.barrier()
    bounded = CheckpointConfig(path=str(b.scratch / "root_bounded"), policy="full",
                               restore_memory_mb=a.restore_mb)  # fmt: skip
    with (
        CheckpointManager(resharded, CheckpointConfig(path=str(root), policy="full")) as restorer,
        CheckpointManager(resharded, bounded) as restorer_bounded,
    ):
        turns("resharding", {
            "reshard_restore": lambda: restorer.restore(step=1),
            "reshard_restore_bounded": lambda: restorer_bounded.restore(step=1),
            "reshard_dcp_load": lambda: _dcp_load(resharded, reshard_opt, theirs),
        })  # fmt: skip
    m: dict[str, Any] = {name: {"seconds": statistics.median(s for s, _ in runs),
                                "seconds_all": [s for s, _ in runs],
                                "peak_mb": max(p for _, p in runs)} for name, runs in got.items()}  # fmt: skip
    m["bytes"] = sizes
    m["model_gb"] = a.tables * a.rows * a.dim * 4 / GB
    pairs = (("export_dcp", "dcp_save"), ("import", "dcp_load"),
             ("reshard_restore", "reshard_dcp_load"),
             ("reshard_restore_bounded", "reshard_dcp_load"))  # fmt: skip
    rows = [[name, m[name]["seconds"], m[name]["peak_mb"],
             f"{m[peer]['seconds']:.2f} s, {m[peer]['peak_mb']:.0f} MB"]
            for name, peer in pairs]  # fmt: skip
    note = (
        f"{a.tables} tables x {a.rows} rows x dim {a.dim} fp32 ({m['model_gb']:.2f} GB) on "
        f"{b.world} ranks, fused row-wise Adagrad; median of {a.rounds} turns, each after a "
        f"sync{' and the page cache dropped' if a.drop_caches else ''}; "
        f"export blocks of {a.budget_mb} MB; the bounded restore's "
        f"restore_memory_mb {a.restore_mb}; checkpoint bytes: export "
        f"{sizes['export_dcp'] / GB:.3f} GB, dcp.save {sizes['dcp_save'] / GB:.3f} GB"
    )
    columns = ["method", "time s (median)", "peak MB over its start (max over ranks)",
               "DCP peer, same run"]  # fmt: skip
    table = Table("DCP interop against DCP", columns, rows, note)
    goals = [
        Goal("export_dcp <= dcp.save", "export_dcp.seconds", "<=", "dcp_save.seconds"),
        Goal("import <= dcp.load", "import.seconds", "<=", "dcp_load.seconds"),
        Goal("export peak memory <= dcp.save's", "export_dcp.peak_mb", "<=", "dcp_save.peak_mb"),
        Goal("import peak memory <= dcp.load's", "import.peak_mb", "<=", "dcp_load.peak_mb"),
        Goal("resharding restore <= dcp.load (row-wise target)",
             "reshard_restore.seconds", "<=", "reshard_dcp_load.seconds"),
        Goal("resharding restore peak memory <= dcp.load's",
             "reshard_restore.peak_mb", "<=", "reshard_dcp_load.peak_mb"),
        Goal("resharding restore within restore_memory_mb <= dcp.load",
             "reshard_restore_bounded.seconds", "<=", "reshard_dcp_load.seconds"),
        Goal("resharding restore within restore_memory_mb: peak memory <= dcp.load's",
             "reshard_restore_bounded.peak_mb", "<=", "reshard_dcp_load.peak_mb"),
    ]  # fmt: skip
    return Outcome(m, [table], goals)


CASE = Case("dcp_interop", "DCP import and export of a 1 GB model against dcp.save and dcp.load",
            _arguments, "--tables 2 --rows 4000 --dim 16 --rounds 1 --budget-mb 1 --restore-mb 0",
            run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
