"""The harness every benchmark and experiment runs on: a :class:`Case` declares its
arguments, its ``--smoke`` sizes and a ``run(bench)``; :func:`main` does the rest alike (the
process group, a scratch folder, one JSON result of :mod:`benchmarks.results`, teardown).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
import importlib.metadata
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist

from benchmarks import results
from benchmarks.measure import bcast
from benchmarks.results import Goal, Table
from torchrec_cnr.launch import init_distributed

# What a result records of its environment: the versions and the variables that change
# what a run measures.
_VERSIONS = ("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "torchsnapshot", "numpy", "moto")
_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "AWS_ENDPOINT_URL")
_T0 = time.perf_counter()


@dataclass(frozen=True)
class Outcome:
    """What a case's ``run`` returns on every rank; rank 0's is written."""

    measurements: dict[str, Any]
    tables: list[Table]
    targets: list[Goal] = field(default_factory=list)


@dataclass(frozen=True)
class Case:
    """A benchmark or experiment: its arguments, its smoke sizes and what it runs."""

    name: str
    """The module under ``benchmarks`` (``experiments.cpr`` for an experiment)."""
    title: str
    arguments: Callable[[argparse.ArgumentParser], None]
    smoke: str
    """The arguments ``--smoke`` stands for: tiny sizes, the same code path, seconds."""
    run: Callable[[Bench], Outcome]
    kind: Literal["benchmark", "experiment"] = "benchmark"


@dataclass
class Bench:
    """What a case's ``run`` gets: its arguments, a scratch folder, a place for artifacts."""

    case: str
    args: argparse.Namespace
    scratch: Path
    """A fresh folder that every rank sees, deleted at the end."""
    artifacts: Path
    """Beside the JSON result (``out/bench/x.json`` -> ``out/bench/x/``): figures, CSVs."""
    command: str = ""
    """The command that runs this case again (:func:`command_line`)."""
    rank: int = field(default_factory=dist.get_rank)
    world: int = field(default_factory=dist.get_world_size)
    """This rank and the number of ranks, of the group the case runs on."""

    def log(self, msg: str) -> None:
        """A progress line on stderr, from rank 0."""
        if dist.get_rank() == 0:
            print(f"[{self.case} {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr)
            sys.stderr.flush()

    def log_row(self, row: Mapping[str, Any]) -> None:
        """:meth:`log` of a row of figures, floats to 4 digits."""
        self.log(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in row.items()))  # fmt: skip

    def settle(self) -> None:
        """Syncs, and drops the page cache where allowed (as root, not in ``--smoke`` runs).
        Where it is refused (not root, a read-only ``/proc/sys``), it says so once and the
        result records ``drop_caches`` false."""
        if dist.get_rank() == 0:
            os.sync()
            if self.args.drop_caches:
                try:
                    Path("/proc/sys/vm/drop_caches").write_text("1\n")
                except OSError as e:
                    self.log(f"the page cache is not dropped between methods: {e}")
                    self.args.drop_caches = False
        dist.barrier()

    def interleaved(self, rounds: int, methods: Iterable[str], measure: Callable[[str], float],
                    prepare: Callable[[str], None] | None = None, settle: bool = True,
                    label: str = "") -> dict[str, list[float]]:  # fmt: skip
        """``measure(m)`` of each of ``methods`` per round, rotating (a drift of the disk hits
        each alike); before each, ``prepare`` (e.g. deleting its output) and :meth:`settle`."""
        names = list(methods)
        got: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                if prepare is not None:
                    prepare(name)
                if settle:
                    self.settle()
                gc.collect()
                got[name].append(measure(name))
            figures = ", ".join(f"{n} {v[-1]:.3f}" for n, v in got.items())
            self.log(f"{label} round {r + 1}/{rounds}: {figures}")
        return got


def main(case: Case, doc: str | None, argv: Sequence[str] | None = None) -> int:
    """Runs ``case`` on torchrun's process group, one of its own (``python -m``) or one that
    exists (the tests' ranks), and writes its result on rank 0; it cleans up however it ends."""
    stem = case.name.rsplit(".", 1)[-1]
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{case.name}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    case.arguments(parser)
    parser.add_argument("--out", type=Path, default=Path(f"out/bench/{stem}.json"))
    parser.add_argument("--smoke", action="store_true", help=f"short for: {case.smoke}")
    parser.add_argument("--scratch", type=Path, help="where to make the scratch folder")
    parser.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                        help="between interleaved methods, only sync (the page cache is the "
                        "machine's)")  # fmt: skip
    given = list(sys.argv[1:] if argv is None else argv)
    # The smoke sizes first: explicit arguments still win.
    smoke = [*shlex.split(case.smoke), "--no-drop-caches"] if "--smoke" in given else []
    args = parser.parse_args([*smoke, *given])
    made_group = not dist.is_initialized()
    if made_group:
        init_distributed("gloo")
    began = time.perf_counter()
    scratch: Path | None = None
    try:
        rank0 = dist.get_rank() == 0
        # Before the case sets any variable of its own (an S3 endpoint, say).
        env = environment() if rank0 else {}
        if rank0 and args.scratch is not None:
            args.scratch.mkdir(parents=True, exist_ok=True)
        made = tempfile.mkdtemp(prefix=f"bench_{stem}_", dir=args.scratch) if rank0 else ""
        scratch = Path(bcast(made))
        command = command_line(case, given)
        bench = Bench(case.name, args, scratch, args.out.with_suffix(""), command)
        outcome = case.run(bench)
        if rank0:
            now = datetime.datetime.now(datetime.timezone.utc)
            results.write(args.out, {
                "case": case.name, "kind": case.kind, "title": case.title,
                "date": now.isoformat(timespec="seconds"),
                "command": command, "note": "", "smoke": args.smoke, "environment": env,
                "config": {k: v for k, v in vars(args).items() if k not in ("out", "scratch")},
                "wall_s": time.perf_counter() - began,
                "measurements": outcome.measurements, "tables": outcome.tables,
                "targets": outcome.targets,
            })  # fmt: skip
            for t in results.load(args.out)["targets"]:
                bench.log(f"{t['verdict']:>5}  {t['name']}")
            bench.log(f"wrote {args.out}")
        dist.barrier()  # leave together: gloo aborts a rank whose peer tears down first
    finally:
        if scratch is not None and dist.get_rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        if made_group:
            dist.destroy_process_group()
    return 0


def cli(case: Case, doc: str | None) -> NoReturn:
    """``python -m benchmarks.<name>``: :func:`main`, exiting with its status."""
    sys.exit(main(case, doc))


def command_line(case: Case, argv: Sequence[str]) -> str:
    """The command that runs this case again with ``argv``, on as many ranks as ran it."""
    omp = os.environ.get("OMP_NUM_THREADS")
    env = [] if omp is None else [f"OMP_NUM_THREADS={omp}"]
    launcher = [".venv/bin/python"]
    if "TORCHELASTIC_RUN_ID" in os.environ or dist.get_world_size() > 1:
        nproc = os.environ.get("LOCAL_WORLD_SIZE", str(dist.get_world_size()))
        launcher = [".venv/bin/torchrun", "--standalone", f"--nproc_per_node={nproc}"]
    return shlex.join([*env, *launcher, "-m", f"benchmarks.{case.name}", *argv])


def environment() -> dict[str, Any]:
    """The machine, the versions and the environment variables a result depends on."""
    versions = {"python": platform.python_version()}
    for name in _VERSIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    git = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        describe = ["git", "describe", "--always", "--dirty"]
        git = subprocess.run(describe, capture_output=True, text=True, timeout=10).stdout.strip()
    return {
        "host": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "world_size": dist.get_world_size(), "torch_threads": torch.get_num_threads(),
        "git": git, "versions": versions,
        "env": {k: v for k, v in os.environ.items() if k in _ENV or k.startswith("TORCHREC_CNR_")},
    }  # fmt: skip


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """``rows`` as a CSV, their keys as the header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (a server has no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Writes a matplotlib figure as a PNG and frees it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
