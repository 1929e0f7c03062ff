"""Training stall, commit time, bytes written and restore time of one checkpoint of
a sharded model: torchrec_cnr's four policies (fp32 and 4-bit adaptive) against
torchsnapshot and torch.distributed.checkpoint (DCP), in one run on one model.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_checkpoint.py \
        --json out/bench_checkpoint.json

The model is 8 table-wise tables x 1,000,000 rows x dim 64 (2.05 GB of fp32
weights) on 2 gloo ranks, built once with torchrec_cnr's tracking sharders;
every method checkpoints that same model. Smoke run: add ``--rows 100000``.

- Physical limits, measured in the same run: the disk's sequential write
  bandwidth (rank 0 writes ``--disk-gb`` in 64 MB chunks with ``os.write``,
  then ``os.fsync``; best of ``--disk-passes``, as the first pass also pays
  for first-touching the page cache) and read bandwidth (the same file read
  back after its page cache is dropped), and a plain in-memory copy of each
  checkpoint's staged bytes (``dst.copy_(src)`` on warm pages, every rank at
  once).
- torchsnapshot ``Snapshot.take`` (synchronous: stall = commit) and
  ``Snapshot.async_take`` (stall = until it returns; commit = until
  ``pending.wait()`` returns), the latter twice: as shipped, and with its
  intended copy of CPU tensors restored (torchsnapshot 0.1.0 compares a str
  with an enum member and never copies, so training that goes on while it
  writes tears the snapshot; the run shows it by modifying rows right after
  ``async_take`` returns). The stall targets use the copying variant.
  torchsnapshot never fsyncs; the time a following fsync of the tree takes is
  reported separately.
- DCP ``save(model.state_dict())`` (fsyncs by default) and ``async_save``
  (reported as failed, with the exception text, if it raises).
- torchrec_cnr, for each policy x {fp32, 4-bit adaptive} x {5%, 25%} of rows
  modified, on a fresh root: a baseline (step 1), then ``--repeats`` timed
  saves. Before each timed save the tracker bits are set to exactly that
  fraction of each shard's rows (one fixed random subset, the 5% subset inside
  the 25% one), and those rows' weights get +1e-3, so the delta holds real
  changes. stall = time inside ``save()``; commit = until ``wait()`` returns,
  from the start of ``save()``. The ``full`` policy saves every row each time.

Every time is the maximum over ranks; stall and commit are the median over
``--repeats``, restore the median of ``--restore-repeats``. Before each restore
the checkpoint's files are dropped from the page cache (fsync +
``POSIX_FADV_DONTNEED``) and the rows of the 25% subset are corrupted (+1);
the restore runs on every rank (torchrec_cnr: a second CheckpointManager on
the same root restores the whole chain, checksums verified as by default),
then the corrupted rows are compared with their saved values. Every root is
deleted after use.

Targets (PASS/MISS): intermittent fp32 stall <= async_take stall / 10 at 5%
and / 3 at 25%; that stall <= 2 x the memcpy of its staged bytes; full fp32
commit throughput >= 50% of the disk's write bandwidth; a consecutive or
intermittent fp32 chain restores in <= 1.5 x torchsnapshot's full restore.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchsnapshot import Snapshot
from torchsnapshot.io_preparers.tensor import TensorBufferStager
from torchsnapshot.serialization import Serializer

from torchrec_cnr import CheckpointConfig, CheckpointManager, model_state
from torchrec_cnr.config import QuantizeConfig
from torchrec_cnr.manifest import Manifest, fsync_tree, tree_bytes
from torchrec_cnr.policy import POLICIES
from torchrec_cnr.staging import serialize_app_state
from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.tracker import LocalShard
from torchrec_cnr.workload import TableSpec, ZipfBatches, build_model, dense_optimizer, train_step

COMMAND = (
    "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_checkpoint.py "
    "--json out/bench_checkpoint.json"
)
QUANTS = {"fp32": QuantizeConfig(), "4-bit": QuantizeConfig(method="adaptive", bits=4)}
GB = 1e9
_T0 = time.perf_counter()


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[bench_checkpoint {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr)
        sys.stderr.flush()


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Runs ``fn`` on every rank at once; its time is the slowest rank's."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    return _max(dt), out


def _bcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rmtree(path: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _drop_cache(path: Path) -> None:
    """Makes every file under ``path`` durable, then drops it from the page cache."""
    if dist.get_rank() == 0:
        for d, _, names in os.walk(path):
            for n in names:
                fd = os.open(os.path.join(d, n), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
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


def _disk_bandwidth(bench: Path, nbytes: int, chunk: int, passes: int) -> dict[str, Any]:
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
    return _bcast(result)


_MEMCPY: dict[tuple[Any, ...], float] = {}


def _memcpy_s(local_bytes: int) -> float:
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
            times.append(_max(time.perf_counter() - t0))
        del src, dst
        _MEMCPY[key] = statistics.median(times)
    return _MEMCPY[key]


def _staged_bytes(
    shards: list[LocalShard], sel: list[torch.Tensor] | None, dense_bytes: int, app_bytes: int
) -> int:
    """Bytes this rank stages for a checkpoint of the rows ``sel`` (every row if ``None``)."""
    total = dense_bytes + app_bytes
    for i, s in enumerate(shards):
        n = s.spec.rows if sel is None or s.words is None else sel[i].numel()
        per_row = s.weight.shape[1] * s.weight.element_size()
        per_row += sum(
            t.numel() // max(t.shape[0], 1) * t.element_size() for t in s.states.values()
        )
        total += n * per_row
        if n < s.spec.rows:
            total += n * 4  # int32 global row ids
    return total


def _modify(shards: list[LocalShard], sel: list[torch.Tensor]) -> None:
    """Exactly ``sel`` is modified since the last checkpoint: bits set, weights nudged."""
    with torch.no_grad():
        for s, rows in zip(shards, sel):
            s.drain()
            s.weight[rows] += 1e-3
            if s.words is not None:
                s.words.zero_()
                bitmap.set_bits(s.words, rows)


class _RestoreCheck:
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
        return _max(err)


RESTORE_REPEATS = 2


def _restore(
    path: Path, shards: list[LocalShard], check_sel: list[torch.Tensor], fn: Callable[[], Any]
) -> tuple[float, float]:
    """Median time of ``RESTORE_REPEATS`` cold restores, and the worst check error."""
    times, err = [], 0.0
    for _ in range(RESTORE_REPEATS):
        _drop_cache(path)
        check = _RestoreCheck(shards, check_sel)
        dt, _ = _timed(fn)
        dist.barrier()
        times.append(dt)
        err = max(err, check.max_abs_err())
    return statistics.median(times), err


@contextlib.contextmanager
def _ts_async_copies(enabled: bool) -> Iterator[None]:
    """Makes torchsnapshot's async_take copy CPU tensors, as its code intends.

    torchsnapshot 0.1.0's ``TensorBufferStager._should_copy_cpu_tensor``
    compares the entry's serializer (a str) with the ``Serializer.BUFFER_PROTOCOL``
    enum member, which is never equal, so ``async_take`` keeps memoryviews of
    the live CPU tensors and returns before writing them: training that runs
    on tears the snapshot. This patch compares with ``.value``.
    """
    if not enabled:
        yield
        return
    original = TensorBufferStager._should_copy_cpu_tensor

    def fixed(self: TensorBufferStager) -> bool:
        if self.entry.serializer == Serializer.BUFFER_PROTOCOL.value and (
            self.is_async_snapshot or not self.tensor.is_contiguous()
        ):
            return True
        return original(self)

    TensorBufferStager._should_copy_cpu_tensor = fixed  # type: ignore[method-assign]
    try:
        yield
    finally:
        TensorBufferStager._should_copy_cpu_tensor = original  # type: ignore[method-assign]


def _ts_async(
    model: torch.nn.Module,
    path: Path,
    shards: list[LocalShard],
    check_sel: list[torch.Tensor],
    copy: bool,
) -> dict[str, Any]:
    """torchsnapshot async_take; training goes on (+1 on the check rows) while it writes."""
    rank = dist.get_rank()
    method = "torchsnapshot async_take" + (" (copy fix)" if copy else " (as shipped)")
    ref = [s.weight[r].clone() for s, r in zip(shards, check_sel)]
    with _ts_async_copies(copy):
        dist.barrier()
        t0 = time.perf_counter()
        pending = Snapshot.async_take(str(path), app_state={"model": model}, replicated=["**"])
        t1 = time.perf_counter()
        with torch.no_grad():
            for s, r in zip(shards, check_sel):
                s.weight[r] += 1.0
        pending.wait()
        t2 = time.perf_counter()
    stall, commit = _max(t1 - t0), _max(t2 - t0)
    del pending
    nbytes = _bcast(tree_bytes(path) if rank == 0 else None)
    fsync_s, _ = _timed(lambda: fsync_tree(path) if rank == 0 else None)
    _drop_cache(path)
    restore_s, _ = _timed(lambda: Snapshot(str(path)).restore(app_state={"model": model}))
    torn = 0.0
    for s, r, v in zip(shards, check_sel, ref):
        if r.numel():
            torn = max(torn, float((s.weight[r] - v).abs().max()))
    torn = _max(torn)
    with torch.no_grad():  # the model as it was, whatever the snapshot held
        for s, r, v in zip(shards, check_sel, ref):
            s.weight[r] = v
    _log(
        f"{method}: stall {stall:.3f}s, commit {commit:.2f}s (+{fsync_s:.2f}s fsync), "
        f"{nbytes / GB:.2f} GB, restore {restore_s:.2f}s; rows modified after it returned "
        f"{'leaked into the snapshot (torn)' if torn else 'stayed out (consistent)'}: max abs err {torn:.3g}"
    )
    _rmtree(path)
    return {
        "method": method,
        "stall_s": stall,
        "commit_s": commit,
        "fsync_after_s": fsync_s,
        "bytes": nbytes,
        "restore_s": restore_s,
        "restore_max_abs_err": torn,
        "consistent": torn == 0.0,
    }


def _peers(
    model: torch.nn.Module,
    bench: Path,
    shards: list[LocalShard],
    check_sel: list[torch.Tensor],
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    rank = dist.get_rank()

    # torchsnapshot, synchronous
    path = bench / "ts_take"
    dt, _ = _timed(lambda: Snapshot.take(str(path), app_state={"model": model}, replicated=["**"]))
    nbytes = _bcast(tree_bytes(path) if rank == 0 else None)
    fsync_s, _ = _timed(lambda: fsync_tree(path) if rank == 0 else None)
    restore_s, err = _restore(
        path,
        shards,
        check_sel,
        lambda: Snapshot(str(path)).restore(app_state={"model": model}),
    )
    rows.append(
        {
            "method": "torchsnapshot take",
            "stall_s": dt,
            "commit_s": dt,
            "fsync_after_s": fsync_s,
            "bytes": nbytes,
            "restore_s": restore_s,
            "restore_max_abs_err": err,
        }
    )
    _log(
        f"torchsnapshot take: {dt:.2f}s, {nbytes / GB:.2f} GB (+{fsync_s:.2f}s fsync), "
        f"restore {restore_s:.2f}s (err {err:.2g})"
    )
    _rmtree(path)
    gc.collect()

    for copy in (False, True):
        rows.append(_ts_async(model, bench / f"ts_async_{copy}", shards, check_sel, copy))
        gc.collect()

    # DCP, synchronous (FileSystemWriter fsyncs by default)
    path = bench / "dcp_save"
    row: dict[str, Any] = {"method": "DCP save", "restore_s": None}
    try:
        dt, _ = _timed(lambda: dcp.save(model.state_dict(), checkpoint_id=str(path)))
        row.update(stall_s=dt, commit_s=dt, bytes=_bcast(tree_bytes(path) if rank == 0 else None))

        def load() -> None:
            sd = model.state_dict()
            dcp.load(sd, checkpoint_id=str(path))
            model.load_state_dict(sd)

        restore_s, err = _restore(path, shards, check_sel, load)
        row.update(restore_s=restore_s, restore_max_abs_err=err)
        _log(
            f"DCP save: {dt:.2f}s, {row['bytes'] / GB:.2f} GB, restore {restore_s:.2f}s (err {err:.2g})"
        )
    except Exception as e:  # reported, not fatal: the other methods still run
        row["error"] = f"{type(e).__name__}: {e}"
        _log(f"DCP save failed: {row['error']}")
    rows.append(row)
    _rmtree(path)
    gc.collect()

    # DCP, asynchronous, on a group of its own so a failure cannot tangle the default one
    path = bench / "dcp_async"
    row = {"method": "DCP async_save", "restore_s": None}
    dcp_pg = dist.new_group(backend="gloo")
    error = None
    dist.barrier()
    t0 = time.perf_counter()
    try:
        response = dcp.async_save(model.state_dict(), checkpoint_id=str(path), process_group=dcp_pg)
        t1 = time.perf_counter()
        getattr(response, "upload_completion", response).result()
        t2 = time.perf_counter()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        row["error"] = "; ".join(failed)
        _log(f"DCP async_save failed: {row['error']}")
    else:
        row.update(
            stall_s=_max(t1 - t0),
            commit_s=_max(t2 - t0),
            bytes=_bcast(tree_bytes(path) if rank == 0 else None),
        )
        _log(
            f"DCP async_save: stall {row['stall_s']:.2f}s, commit {row['commit_s']:.2f}s, "
            f"{row['bytes'] / GB:.2f} GB"
        )
    rows.append(row)
    _rmtree(path)
    gc.collect()
    return rows


def _save(ckpt: CheckpointManager, root: Path, step: int) -> tuple[float, float, dict[str, Any]]:
    """stall (inside save) and commit (until wait returns) of one checkpoint, and its manifest entry."""
    dist.barrier()
    t0 = time.perf_counter()
    ckpt.save(step)
    t1 = time.perf_counter()
    ckpt.wait()
    t2 = time.perf_counter()
    entry = Manifest.load(root).latest() if dist.get_rank() == 0 else None
    return _max(t1 - t0), _max(t2 - t0), _bcast(entry)


def _cnr(
    model: torch.nn.Module,
    bench: Path,
    shards: list[LocalShard],
    policy: str,
    quant: str,
    frac: float,
    sel: list[torch.Tensor],
    check_sel: list[torch.Tensor],
    step_bytes: dict[str, int],
    repeats: int,
) -> dict[str, Any]:
    rank = dist.get_rank()
    root = bench / f"cnr_{policy}_{quant}_{round(frac * 100)}"
    _rmtree(root)
    cfg = CheckpointConfig(path=str(root), policy=policy, on_busy="wait", quantize=QUANTS[quant])
    ckpt = CheckpointManager(model, cfg)

    b_stall, b_commit, base = _save(ckpt, root, 1)
    assert base is not None and base["kind"] == "full"
    saves = []
    for rep in range(repeats):
        _modify(shards, sel)
        stall, commit, entry = _save(ckpt, root, 2 + rep)
        assert entry is not None
        saves.append(
            {
                "stall_s": stall,
                "commit_s": commit,
                "kind": entry["kind"],
                "bytes": entry["bytes"],
                "staged_bytes_rank0": entry["staged_bytes"],
                "chain_len": len(entry["chain"]),
            }
        )
    ckpt.close()
    del ckpt
    gc.collect()
    delta = saves[-1]["kind"] == "delta"
    local_staged = step_bytes["delta" if delta else "full"]
    if rank == 0 and local_staged != saves[-1]["staged_bytes_rank0"]:
        print(
            f"WARNING: computed staged bytes {local_staged} != manifest {saves[-1]['staged_bytes_rank0']}",
            file=sys.stderr,
        )
    memcpy = _memcpy_s(local_staged)

    restorer = CheckpointManager(model, cfg)
    restore_s, err = _restore(root, shards, check_sel, restorer.restore)
    restorer.close()
    del restorer
    gc.collect()
    _rmtree(root)
    row = {
        "method": f"torchrec_cnr {policy} {quant}",
        "policy": policy,
        "quant": quant,
        "fraction": frac,
        "stall_s": statistics.median(s["stall_s"] for s in saves),
        "commit_s": statistics.median(s["commit_s"] for s in saves),
        "bytes": statistics.median(s["bytes"] for s in saves),
        "staged_bytes_rank0": saves[-1]["staged_bytes_rank0"],
        "staged_bytes_local_max": _max(local_staged),
        "memcpy_s": memcpy,
        "restore_s": restore_s,
        "restore_chain_len": saves[-1]["chain_len"],
        "restore_max_abs_err": err,
        "baseline": {"stall_s": b_stall, "commit_s": b_commit, "bytes": base["bytes"]},
        "saves": saves,
    }
    _log(
        f"{row['method']} {frac:.0%}: stall {row['stall_s']:.3f}s (memcpy {memcpy:.4f}s), "
        f"commit {row['commit_s']:.2f}s, {row['bytes'] / GB:.3f} GB ({saves[-1]['kind']}), "
        f"restore {restore_s:.2f}s of {row['restore_chain_len']} (err {err:.2g}); "
        f"baseline stall {b_stall:.2f}s commit {b_commit:.2f}s"
    )
    if quant == "fp32" and err != 0.0 and rank == 0:
        print(f"WARNING: fp32 restore of {row['method']} is not exact: {err}", file=sys.stderr)
    return row


def _fmt(x: float | None, spec: str) -> str:
    return format("-", ">" + spec.lstrip(">").split(".")[0]) if x is None else format(x, spec)


def _report(results: dict[str, Any]) -> list[dict[str, Any]]:
    peers, cnr = results["peers"], results["cnr"]
    disk, mem = results["disk"], results["memcpy_full"]
    print(
        f"\n{results['model']}; disk ({disk['bytes'] / GB:.2f} GB, best of {len(disk['passes'])} passes): "
        f"write {disk['write_gb_s']:.3f} GB/s (passes "
        + ", ".join(f"{disk['bytes'] / r['write_s'] / GB:.3f}" for r in disk["passes"])
        + f"), read (page cache dropped) {disk['read_gb_s']:.3f} GB/s; plain memcpy of a full rank's staged bytes "
        f"{mem['bytes'] / GB:.2f} GB in {mem['s']:.3f}s ({mem['bytes'] / mem['s'] / GB:.2f} GB/s per rank)"
    )
    print(
        f"\n| {'method':<38} | {'fraction':>8} | {'stall s':>8} | {'commit s':>8} | "
        f"{'bytes written GB':>16} | {'restore s':>9} |"
    )
    print(f"|{'-' * 40}|{'-' * 9}:|{'-' * 9}:|{'-' * 9}:|{'-' * 17}:|{'-' * 10}:|")
    for r in peers:
        if "error" in r:
            print(
                f"| {r['method']:<38} | {'full':>8} | {'failed':>8} | {'failed':>8} | {'-':>16} | {'-':>9} |"
            )
            continue
        print(
            f"| {r['method']:<38} | {'full':>8} | {r['stall_s']:>8.3f} | {r['commit_s']:>8.2f} | "
            f"{r['bytes'] / GB:>16.3f} | {_fmt(r['restore_s'], '>9.2f')} |"
        )
    for r in cnr:
        print(
            f"| {r['method']:<38} | {r['fraction']:>8.0%} | {r['stall_s']:>8.3f} | {r['commit_s']:>8.2f} | "
            f"{r['bytes'] / GB:>16.3f} | {r['restore_s']:>9.2f} |"
        )
    print(
        "\ntorchsnapshot never fsyncs: its commit excludes durability; fsync of the tree afterwards took "
        + ", ".join(
            f"{r['method']} {r['fsync_after_s']:.2f}s" for r in peers if "fsync_after_s" in r
        )
        + ". torchrec_cnr and DCP commit times include fsync. torchrec_cnr restores verify checksums."
    )
    print(
        "torchrec_cnr restore chain lengths: "
        + ", ".join(
            f"{r['policy']} {r['quant']} {r['fraction']:.0%}: {r['restore_chain_len']}"
            for r in cnr
            if r["policy"] == "consecutive"
        )
        + " (one_shot/intermittent: 2, full: 1)"
    )
    for r in peers:
        if "error" in r:
            print(f"{r['method']} failed: {r['error']}")
    errs = {r["method"] + f" {r.get('fraction', 1):.0%}": r.get("restore_max_abs_err") for r in cnr}
    bad = {k: v for k, v in errs.items() if "fp32" in k and v}
    print(
        f"restore check: fp32 restores exact: {'yes' if not bad else bad}; 4-bit max abs err "
        f"{max((v for k, v in errs.items() if '4-bit' in k), default=0):.3g}"
    )

    by = {(r["policy"], r["quant"], r["fraction"]): r for r in cnr}
    peer = {r["method"]: r for r in peers}
    ratios: list[dict[str, Any]] = []

    def line(name: str, value: float, target: float, ok: bool, text: str) -> None:
        ratios.append({"name": name, "value": value, "target": target, "pass": ok})
        print(f"{text}: {'PASS' if ok else 'MISS'}")

    print()
    fracs = sorted({r["fraction"] for r in cnr})
    needed = [(p, "fp32", f) for p in ("full", "consecutive", "intermittent") for f in fracs]
    if len(fracs) != 2 or any(k not in by for k in needed) or "error" in peer["torchsnapshot take"]:
        print("ratio lines need full, consecutive and intermittent fp32 at two fractions")
        return ratios
    async_stall = peer["torchsnapshot async_take (copy fix)"]["stall_s"]
    shipped = peer["torchsnapshot async_take (as shipped)"]
    for frac, div in zip(fracs, (10, 3)):
        s = by[("intermittent", "fp32", frac)]["stall_s"]
        line(
            f"stall_intermittent_fp32_{frac:.0%}_vs_async_take",
            s,
            async_stall / div,
            s <= async_stall / div,
            f"stall intermittent fp32 {frac:.0%} {s:.3f}s vs torchsnapshot async_take (copy fix) "
            f"{async_stall:.3f}s / {div} = {async_stall / div:.3f}s ({async_stall / s:.1f}x less)",
        )
        print(
            f"  (info: vs async_take as shipped {shipped['stall_s']:.3f}s, {shipped['stall_s'] / s:.1f}x; "
            f"its snapshot is {'consistent' if shipped['consistent'] else 'torn: it copies nothing'})"
        )
    for frac in fracs:
        r = by[("intermittent", "fp32", frac)]
        line(
            f"stall_intermittent_fp32_{frac:.0%}_vs_memcpy",
            r["stall_s"],
            2 * r["memcpy_s"],
            r["stall_s"] <= 2 * r["memcpy_s"],
            f"stall intermittent fp32 {frac:.0%} {r['stall_s']:.3f}s vs 2 x memcpy of its "
            f"{r['staged_bytes_local_max'] / 1e6:.0f} MB staged per rank ({r['memcpy_s']:.4f}s) = "
            f"{2 * r['memcpy_s']:.4f}s",
        )
    full = [s for f in fracs for s in by[("full", "fp32", f)]["saves"]]
    tput = statistics.median(s["bytes"] / s["commit_s"] for s in full) / GB
    disk_bw = disk["write_gb_s"]
    line(
        "commit_throughput_full_fp32_vs_disk",
        tput,
        0.5 * disk_bw,
        tput >= 0.5 * disk_bw,
        f"commit throughput torchrec_cnr full fp32 {tput:.3f} GB/s vs 50% of disk write "
        f"{disk_bw:.3f} GB/s = {0.5 * disk_bw:.3f} GB/s ({tput / disk_bw:.0%} of disk)",
    )
    each = sorted(s["bytes"] / s["commit_s"] / GB for s in full)
    take = peer["torchsnapshot take"]
    take_tput = take["bytes"] / (take["commit_s"] + take["fsync_after_s"]) / GB
    print(
        f"  (info: over its {len(each)} full saves {each[0]:.3f}..{each[-1]:.3f} GB/s; "
        f"torchsnapshot take + fsync in this run {take_tput:.3f} GB/s)"
    )
    ts_restore = peer["torchsnapshot take"]["restore_s"]
    for policy in ("consecutive", "intermittent"):
        for frac in fracs:
            r = by[(policy, "fp32", frac)]
            line(
                f"restore_{policy}_fp32_{frac:.0%}_vs_torchsnapshot",
                r["restore_s"],
                1.5 * ts_restore,
                r["restore_s"] <= 1.5 * ts_restore,
                f"restore {policy} fp32 {frac:.0%} (chain of {r['restore_chain_len']}) {r['restore_s']:.2f}s "
                f"vs 1.5 x torchsnapshot restore {ts_restore:.2f}s = {1.5 * ts_restore:.2f}s",
            )
    return ratios


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.25])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--repeats", type=int, default=3, help="timed saves per method, median kept")
    p.add_argument(
        "--restore-repeats", type=int, default=2, help="cold restores per method, median kept"
    )
    p.add_argument("--warmup-steps", type=int, default=2, help="training steps before measuring")
    p.add_argument("--disk-gb", type=float, default=2.0, help="size of the disk bandwidth test")
    p.add_argument("--disk-passes", type=int, default=2, help="disk test passes, best kept")
    p.add_argument(
        "--root", type=Path, default=None, help="scratch directory (default: a temp dir)"
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    global RESTORE_REPEATS
    RESTORE_REPEATS = args.restore_repeats
    dist.init_process_group("gloo")
    scratch = None
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.root is None:
            name = [tempfile.mkdtemp(prefix="bench_checkpoint_")] if rank == 0 else [None]
            dist.broadcast_object_list(name)
            scratch = args.root = Path(name[0])
        bench = args.root
        if rank == 0:
            bench.mkdir(parents=True, exist_ok=True)
        dist.barrier()

        chunk = 64 << 20
        nbytes = max(chunk, int(args.disk_gb * GB) // chunk * chunk)
        disk = _disk_bandwidth(bench, nbytes, chunk, args.disk_passes)
        _log(
            f"disk ({nbytes / GB:.2f} GB, best of {args.disk_passes}): write {disk['write_gb_s']:.3f} GB/s, "
            f"read {disk['read_gb_s']:.3f} GB/s; passes "
            + ", ".join(f"{r['write_s']:.2f}s/{r['read_s']:.2f}s" for r in disk["passes"])
        )

        tables = [TableSpec(f"t{i}", args.rows, args.dim, "table_wise") for i in range(args.tables)]
        model = build_model(tables, seed=0)
        if args.warmup_steps:
            opt = dense_optimizer(model)
            data = ZipfBatches(tables, 512, seed=0)
            for step in range(1, args.warmup_steps + 1):
                train_step(model, opt, data.batch(rank, step))
            del data
        shards = model_state.local_shards(model)
        emb_bytes = _max(sum(s.weight.numel() * s.weight.element_size() for s in shards))
        total_emb = args.tables * args.rows * args.dim * 4
        model_desc = (
            f"{args.tables} tables x {args.rows} rows x dim {args.dim} = {total_emb / GB:.2f} GB fp32 "
            f"on {world} ranks (table_wise, largest rank {emb_bytes / GB:.2f} GB)"
        )
        _log(f"model built: {model_desc}")

        g = torch.Generator().manual_seed(1234 + rank)
        perms = [torch.randperm(s.spec.rows, generator=g) for s in shards]

        def subset(frac: float) -> list[torch.Tensor]:
            return [q[: round(frac * q.numel())].sort().values for q in perms]

        sels = {f: subset(f) for f in args.fractions}
        check_sel = subset(max(args.fractions))
        dense_bytes = sum(
            t.numel() * t.element_size() for t in model_state.dense_state(model).values()
        )
        app_bytes = len(serialize_app_state({}))
        full_bytes = _staged_bytes(shards, None, dense_bytes, app_bytes)
        memcpy_full = {"bytes": int(_max(full_bytes)), "s": _memcpy_s(full_bytes)}
        _log(
            f"memcpy of {full_bytes / GB:.2f} GB per rank: {memcpy_full['s']:.3f}s "
            f"({full_bytes / memcpy_full['s'] / GB:.2f} GB/s)"
        )

        peers = _peers(model, bench, shards, check_sel)
        cnr = []
        for policy in args.policies:
            for quant in QUANTS:
                for frac in args.fractions:
                    step_bytes = {
                        "full": full_bytes,
                        "delta": _staged_bytes(shards, sels[frac], dense_bytes, app_bytes),
                    }
                    cnr.append(
                        _cnr(
                            model,
                            bench,
                            shards,
                            policy,
                            quant,
                            frac,
                            sels[frac],
                            check_sel,
                            step_bytes,
                            args.repeats,
                        )
                    )
        wall = time.perf_counter() - _T0
        results = {
            "command": COMMAND,
            "args": {k: str(v) for k, v in vars(args).items()},
            "model": model_desc,
            "world_size": world,
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "disk": disk,
            "memcpy_full": memcpy_full,
            "peers": peers,
            "cnr": cnr,
            "wall_s": wall,
        }
        if rank == 0:
            results["ratios"] = _report(results)
            print(f"\nwall time {wall:.0f}s")
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=1))
        dist.barrier()  # leave together: gloo aborts a rank whose peer tears down first
    finally:
        if scratch is not None and dist.get_rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
