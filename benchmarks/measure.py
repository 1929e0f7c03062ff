"""What the benchmarks measure with: timing over ranks (every figure the slowest rank's),
the limits figures are compared with (the disk, a memcpy), cold reads, peak memory, the
model most cases checkpoint, the rows they modify, and an S3 store. What the tests share
with them is in :mod:`torchrec_cnr.testing`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import resource
import shutil
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel

from cnr_train.workload import TableSpec, ZipfBatches, build_model, dense_optimizer, train_step
from torchrec_cnr import CheckpointManager, QuantizeConfig
from torchrec_cnr.rowcopy import put_rows
from torchrec_cnr.storage import fs
from torchrec_cnr.testing import stores
from torchrec_cnr.testing.memory import proc_status_mb, reset_peak_rss
from torchrec_cnr.testing.stores import moto_server
from torchrec_cnr.tracking.shard import LocalShard
from torchrec_cnr.tracking.tracker import TrackingMode

GB = 1e9
Rows = list[torch.Tensor]
T = TypeVar("T")
Policy = Literal["full", "one_shot", "consecutive", "intermittent"]
POLICIES: tuple[Policy, ...] = ("full", "one_shot", "consecutive", "intermittent")
"""Check-N-Run's row-selection policies, as ``CheckpointConfig.policy`` names them."""


def bcast(obj: T) -> T:
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gathered(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order, on every rank."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def from_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` run by rank 0 alone (e.g. reading a manifest), its value on every rank."""
    dist.barrier()
    return cast(T, bcast(fn() if dist.get_rank() == 0 else None))


def max_over_ranks(*values: float) -> list[float]:
    """Each value's maximum over ranks (on the GPU where the group is nccl's)."""
    on = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Runs ``fn`` on every rank at once; its time is the slowest rank's."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return max_over_ranks(time.perf_counter() - t0)[0], out


def timed_save(ckpt: CheckpointManager, step: int) -> tuple[float, float]:
    """``(stall, commit)`` of one checkpoint, slowest rank's: in ``save()``, to ``wait()``."""
    dist.barrier()
    t0 = time.perf_counter()
    ckpt.save(step)
    t1 = time.perf_counter()
    ckpt.wait()
    return cast(tuple[float, float], tuple(max_over_ranks(t1 - t0, time.perf_counter() - t0)))


def best_seconds(fn: Callable[[], Any], repeats: int, min_total: float = 1.0) -> float:
    """Fastest of ``repeats`` calls of ``fn`` after a warm-up, or more up to ``min_total``
    seconds (100 calls at most): the minimum filters out other processes' stalls."""
    fn()
    best, total, calls = float("inf"), 0.0, 0
    while calls < repeats or (total < min_total and calls < 100):
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, total, calls = min(best, took), total + took, calls + 1
    return best


def rmtree(path: Path) -> None:
    """Deletes ``path`` (rank 0) between barriers, so that no rank still uses it."""
    from_rank0(lambda: shutil.rmtree(path, ignore_errors=True))
    dist.barrier()


def fsync_tree(path: Path) -> None:
    """Rank 0 fsyncs every file and folder under ``path`` (what torchsnapshot leaves out)."""
    if dist.get_rank() != 0:
        return
    for d, _, names in os.walk(path):
        for n in [*names, "."]:
            fs.fsync_dir(os.path.join(d, n))  # an fsync through a read-only descriptor


def evict(path: Path) -> None:
    """Makes every file under ``path`` durable and drops it from the page cache (the next
    read is cold), in this process alone; :func:`drop_cache` is the collective."""
    for d, _, names in os.walk(path):
        for n in names:
            fs._fsync_and_drop(Path(d, n))


def drop_cache(path: Path) -> None:
    """:func:`evict` by rank 0, for every rank."""
    from_rank0(lambda: evict(path))


def _disk_pass(path: Path, nbytes: int, chunk: int) -> dict[str, float]:
    """Writes ``nbytes`` to ``path`` in ``chunk``-byte writes, fsyncs, reads them back cold."""
    buf = os.urandom(chunk)
    with open(path, "wb") as f:  # buffered: every byte written, whatever write(2) returns
        t0 = time.perf_counter()
        for _ in range(nbytes // chunk):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
        write_s = time.perf_counter() - t0
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    rbuf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        t0 = time.perf_counter()
        while f.readinto(rbuf):
            pass
        read_s = time.perf_counter() - t0
    path.unlink()
    return {"write_s": write_s, "read_s": read_s}


def disk_bandwidth(folder: Path, nbytes: int, chunk: int = 64 << 20,
                   passes: int = 2) -> dict[str, Any]:  # fmt: skip
    """The disk's sequential bandwidth, measured by rank 0: the best of ``passes`` of
    :func:`_disk_pass` (the first touches the cache)."""
    chunk = min(chunk, nbytes)
    nbytes = nbytes // chunk * chunk

    def measure() -> dict[str, Any]:
        runs = [_disk_pass(folder / "disk_bandwidth.bin", nbytes, chunk) for _ in range(passes)]
        return {"bytes": nbytes, "passes": runs,
                "write_gb_s": max(nbytes / r["write_s"] for r in runs) / GB,
                "read_gb_s": max(nbytes / r["read_s"] for r in runs) / GB}  # fmt: skip

    return from_rank0(measure)


def disk_read_s(folder: Path, nbytes: int, chunk: int = 64 << 20) -> float:
    """Seconds the disk under ``folder`` takes to read ``nbytes`` cold, in this process (the
    best of two passes)."""
    chunk = max(1, min(chunk, nbytes))
    nbytes = max(1, nbytes // chunk) * chunk
    return min(_disk_pass(folder / "disk_read.bin", nbytes, chunk)["read_s"] for _ in range(2))


def memcpy_s(nbytes: int) -> float:
    """Slowest rank's time to copy its ``nbytes`` between warm buffers (median of 3)."""
    return _memcpy_s(tuple(gathered(nbytes)))


@functools.cache
def _memcpy_s(every_rank: tuple[int, ...]) -> float:
    src = torch.ones(max(every_rank[dist.get_rank()], 1), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # every page touched first, as the staging pool's are
    return statistics.median(timed(lambda: dst.copy_(src))[0] for _ in range(3))


@functools.cache
def scatter_s(rows: int, row_bytes: int, table_rows: int) -> float:
    """Time to write ``rows`` rows of ``row_bytes`` at random ascending places of a warm table
    of ``table_rows`` rows with the follower's row copy (:func:`~torchrec_cnr.rowcopy.put_rows`;
    median of 3): the least an update applied in place costs."""
    table = torch.ones(table_rows, row_bytes, dtype=torch.uint8)
    src = torch.ones(rows, row_bytes, dtype=torch.uint8)
    ids = torch.randperm(table_rows)[:rows].sort().values
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        put_rows(table, ids, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used (user and system, every thread's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU seconds of this process's children and their descendants, once waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Peak:
    """``fn`` that notes the most resident memory its calls added over their start, MB (this
    rank's; the peak reset at each call), and what ``kept()`` says, in MB, that they found
    held for them from an earlier call (memory an export keeps for the next)."""

    def __init__(self, fn: Callable[..., Any], kept: Callable[[], float] | None = None) -> None:
        self.fn, self.mb, self.kept = fn, 0.0, kept

    def __call__(self, *args: Any) -> Any:
        before = reset_peak_rss() - (self.kept() if self.kept is not None else 0.0)
        got = self.fn(*args)
        self.mb = max(self.mb, proc_status_mb("VmHWM") - before)
        return got

    def over_ranks(self) -> float:
        """The largest rank's figure (a collective)."""
        return max_over_ranks(self.mb)[0]


def model_arguments(p: argparse.ArgumentParser, rows: int, tables: int = 8, dim: int = 64) -> None:
    """``--tables``, ``--rows`` and ``--dim`` of the model that :func:`uniform_model` builds."""
    p.add_argument("--tables", type=int, default=tables)
    p.add_argument("--rows", type=int, default=rows)
    p.add_argument("--dim", type=int, default=dim)


QUANTS = {"fp32": QuantizeConfig(), "4-bit": QuantizeConfig(method="adaptive", bits=4, min_rows=0)}
"""The formats the benchmarks compare: fp32, and adaptive 4-bit on every table (smoke's too)."""


class Workload(NamedTuple):
    model: DistributedModelParallel
    opt: torch.optim.Optimizer  # the dense parameters' (the tables' is fused into their kernels)
    tables: list[TableSpec]


def uniform_model(args: argparse.Namespace, tracking_mode: TrackingMode = "bitmap") -> Workload:
    """The DLRM of ``--tables`` x ``--rows`` x ``--dim``, sharded, and its dense optimizer."""
    tables = [TableSpec(f"t{i}", args.rows, args.dim, "table_wise") for i in range(args.tables)]
    model = build_model(tables, seed=0, tracking_mode=tracking_mode)
    return Workload(model, dense_optimizer(model), tables)


@dataclass
class StepLoop:
    """A workload's training loop: its model, its data and the next step."""

    work: Workload
    data: ZipfBatches
    rank: int
    step: int = 0

    def train(self, steps: int, after: Callable[[int], None] | None = None) -> list[float]:
        """Trains ``steps`` steps; ``after(step)`` runs inside each. Each step's seconds."""
        took = []
        for _ in range(steps):
            self.step += 1
            t0 = time.perf_counter()
            train_step(self.work.model, self.work.opt, self.data.batch(self.rank, self.step))
            if after is not None:
                after(self.step)
            took.append(time.perf_counter() - t0)
        return took

    @classmethod
    def warm(cls, args: argparse.Namespace, batch: int, steps: int) -> StepLoop:
        """:func:`uniform_model`'s on Zipf batches of ``batch`` per rank, ``steps`` trained."""
        work = uniform_model(args)
        loop = cls(work, ZipfBatches(work.tables, batch, seed=0), dist.get_rank())
        loop.train(steps)
        return loop

    def align(self, k: int) -> None:
        """Moves the step on so that the next multiple of ``k`` comes after ``k // 2`` steps
        (each save falls mid-interval)."""
        self.step += (-(self.step + k // 2)) % k


def random_rows(shards: list[LocalShard], fractions: Sequence[float],
                seed: int = 1234) -> dict[float, Rows]:  # fmt: skip
    """For each fraction, that share of each local shard's rows (sorted local indices) from
    one seeded permutation per shard: a smaller fraction's rows are in a larger one's."""
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    perms = [torch.randperm(s.spec.rows, generator=g) for s in shards]
    return {f: [p[: round(f * p.numel())].sort().values for p in perms] for f in fractions}


def max_abs_diff(shards: list[LocalShard], rows: Rows, values: Rows) -> float:
    """The largest difference, over ranks, between ``rows`` of each shard and ``values``."""
    pairs = [(s.weight[r], v) for s, r, v in zip(shards, rows, values) if r.numel()]
    return max_over_ranks(max((float((w - v).abs().max()) for w, v in pairs), default=0.0))[0]


def timed_restore(fn: Callable[[], Any], path: Path, shards: list[LocalShard],
                  rows: Rows) -> tuple[float, float]:  # fmt: skip
    """A cold restore by ``fn`` (``path`` dropped from the page cache), ``rows`` corrupted
    (+1) before: ``(time, max abs error of rows against their values before)``."""
    drop_cache(path)
    saved = [s.weight[r].clone() for s, r in zip(shards, rows)]
    with torch.no_grad():
        for s, r in zip(shards, rows):
            s.weight[r] += 1.0
    took, _ = timed(fn)
    return took, max_abs_diff(shards, rows, saved)


def store_cpu_s(url: str | None) -> float | None:
    """CPU seconds of the local server at ``url`` where this process started it, else ``None``."""
    pid = stores.STARTED.get(url or "")
    return None if pid is None else process_cpu_s(pid)


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """An S3 endpoint for every rank: ``AWS_ENDPOINT_URL``, else rank 0's :func:`moto_server`."""
    with contextlib.ExitStack() as stack:
        url = os.environ.get("AWS_ENDPOINT_URL")
        started = url is None and dist.get_rank() == 0
        if started:
            url = stack.enter_context(moto_server())
        url, started = bcast((url, started))
        assert url is not None
        if started:  # moto takes any credentials; a real store's must not be replaced
            os.environ.update(AWS_ENDPOINT_URL=url, AWS_DEFAULT_REGION="us-east-1",
                              AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")  # fmt: skip
        try:
            yield url
        finally:
            dist.barrier()


def s3_bucket() -> str:
    """A new bucket on the endpoint of :func:`s3_server`, made by rank 0."""

    def make() -> str:
        import boto3

        name = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=name)
        return name

    return from_rank0(make)
