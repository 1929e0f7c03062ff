"""Measuring helpers the benchmark scripts share: timing over ranks, and the physical
limits (disk bandwidth, memory copy) that figures are compared against."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.shard import LocalShard

GB = 1e9
_T0 = time.perf_counter()
_NAME = os.path.basename(sys.argv[0]).removesuffix(".py")


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[{_NAME} {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr)
        sys.stderr.flush()


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Runs ``fn`` on every rank at once; its time is the slowest rank's."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    return max_over_ranks(dt), out


def bcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def scratch_dir(prefix: str) -> Path:
    """A fresh temporary folder, created by rank 0 and named on every rank."""
    name = tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None
    return Path(bcast(name))


def rmtree(path: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def evict(path: Path) -> None:
    """Makes every file under ``path`` durable, then drops it from the page cache."""
    for d, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def proc_status_mb(field: str) -> float:
    """A memory figure of this process (``VmRSS``, ``VmHWM``, ...) from ``/proc/self/status``, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def fsync_tree(path: Path) -> None:
    """fsyncs every file and directory under ``path`` (what torchsnapshot leaves out)."""
    for d, _, names in os.walk(path):
        for name in [*names, "."]:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def drop_cache(path: Path) -> None:
    """:func:`evict`, by rank 0, for every rank."""
    if dist.get_rank() == 0:
        evict(path)
    dist.barrier()


def _disk_pass(path: Path, nbytes: int, chunk: int) -> dict[str, float]:
    buf = memoryview(os.urandom(chunk))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < nbytes:
            done = 0
            while done < chunk:
                done += os.write(fd, buf[done:])
            written += chunk
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    rbuf = bytearray(chunk)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        read = 0
        while n := os.readv(fd, [rbuf]):
            read += n
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
    path.unlink()
    return {"bytes": written, "write_s": write_s, "read_s": read_s}


def disk_bandwidth(bench: Path, nbytes: int, chunk: int, passes: int) -> dict[str, Any]:
    """Rank 0 writes ``nbytes`` sequentially and fsyncs, then reads them back cold; best pass.

    The first pass also pays for first-touching host memory (page cache), so
    the best of several passes is the disk's figure.
    """
    result: dict[str, Any] = {}
    if dist.get_rank() == 0:
        runs = [_disk_pass(bench / "disk_bandwidth.bin", nbytes, chunk) for _ in range(passes)]
        result = {
            "bytes": nbytes,
            "passes": runs,
            "write_gb_s": max(nbytes / r["write_s"] for r in runs) / GB,
            "read_gb_s": max(nbytes / r["read_s"] for r in runs) / GB,
        }
    dist.barrier()
    return bcast(result)


_MEMCPY: dict[tuple[Any, ...], float] = {}


def memcpy_s(local_bytes: int) -> float:
    """Slowest rank's time to copy its ``local_bytes`` between warm host buffers (median of 3)."""
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, local_bytes)
    key = tuple(sizes)
    if key not in _MEMCPY:
        src = torch.ones(max(local_bytes, 1), dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up: every page touched, as the staging pool's are
        times = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(max_over_ranks(time.perf_counter() - t0))
        del src, dst
        _MEMCPY[key] = statistics.median(times)
    return _MEMCPY[key]


def modify(shards: list[LocalShard], sel: list[torch.Tensor]) -> None:
    """Exactly ``sel`` is modified since the last checkpoint: bits set, weights nudged."""
    with torch.no_grad():
        for s, rows in zip(shards, sel):
            s.drain()
            s.weight[rows] += 1e-3
            if s.words is not None:
                s.words.zero_()
                bitmap.set_bits(s.words, rows)


class RestoreCheck:
    """Corrupts the check rows before a restore; after it, how far they are from the saved values."""

    def __init__(self, shards: list[LocalShard], sel: list[torch.Tensor]) -> None:
        self.shards, self.sel = shards, sel
        self.ref = [s.weight[r].clone() for s, r in zip(shards, sel)]
        with torch.no_grad():
            for s, r in zip(shards, sel):
                s.weight[r] += 1.0

    def max_abs_err(self) -> float:
        err = 0.0
        for s, r, ref in zip(self.shards, self.sel, self.ref):
            if r.numel():
                err = max(err, float((s.weight[r] - ref).abs().max()))
        self.ref = []
        return max_over_ranks(err)


def timed_restores(
    path: Path,
    shards: list[LocalShard],
    check_sel: list[torch.Tensor],
    fn: Callable[[], Any],
    repeats: int = 2,
) -> tuple[float, float]:
    """Median time of ``repeats`` cold restores, and the worst check error."""
    times, err = [], 0.0
    for _ in range(repeats):
        drop_cache(path)
        check = RestoreCheck(shards, check_sel)
        dt, _ = timed(fn)
        dist.barrier()
        times.append(dt)
        err = max(err, check.max_abs_err())
    return statistics.median(times), err
