"""The peers a checkpoint benchmark compares against, on the same model: torchsnapshot
``take`` and ``async_take``, and torch.distributed.checkpoint ``save``/``async_save``."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchsnapshot import Snapshot
from torchsnapshot.io_preparers.tensor import TensorBufferStager
from torchsnapshot.serialization import Serializer

from cnr_train.bench.common import (
    GB,
    bcast,
    drop_cache,
    fsync_tree,
    log,
    max_over_ranks,
    rmtree,
    timed,
    timed_restores,
)
from torchrec_cnr.storage.fs import tree_bytes
from torchrec_cnr.tracking.shard import LocalShard


@contextlib.contextmanager
def torchsnapshot_async_copies(enabled: bool) -> Iterator[None]:
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


def torchsnapshot_async(
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
    with torchsnapshot_async_copies(copy):
        dist.barrier()
        t0 = time.perf_counter()
        pending = Snapshot.async_take(str(path), app_state={"model": model}, replicated=["**"])
        t1 = time.perf_counter()
        with torch.no_grad():
            for s, r in zip(shards, check_sel):
                s.weight[r] += 1.0
        pending.wait()
        t2 = time.perf_counter()
    stall, commit = max_over_ranks(t1 - t0), max_over_ranks(t2 - t0)
    del pending
    nbytes = bcast(tree_bytes(path) if rank == 0 else None)
    fsync_s, _ = timed(lambda: fsync_tree(path) if rank == 0 else None)
    drop_cache(path)
    restore_s, _ = timed(lambda: Snapshot(str(path)).restore(app_state={"model": model}))
    torn = 0.0
    for s, r, v in zip(shards, check_sel, ref):
        if r.numel():
            torn = max(torn, float((s.weight[r] - v).abs().max()))
    torn = max_over_ranks(torn)
    with torch.no_grad():  # the model as it was, whatever the snapshot held
        for s, r, v in zip(shards, check_sel, ref):
            s.weight[r] = v
    log(
        f"{method}: stall {stall:.3f}s, commit {commit:.2f}s (+{fsync_s:.2f}s fsync), "
        f"{nbytes / GB:.2f} GB, restore {restore_s:.2f}s; rows modified after it returned "
        f"{'leaked into the snapshot (torn)' if torn else 'stayed out (consistent)'}: max abs err {torn:.3g}"
    )
    rmtree(path)
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


def run_peers(
    model: torch.nn.Module,
    bench: Path,
    shards: list[LocalShard],
    check_sel: list[torch.Tensor],
    restore_repeats: int = 2,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    rank = dist.get_rank()

    # torchsnapshot, synchronous
    path = bench / "ts_take"
    dt, _ = timed(lambda: Snapshot.take(str(path), app_state={"model": model}, replicated=["**"]))
    nbytes = bcast(tree_bytes(path) if rank == 0 else None)
    fsync_s, _ = timed(lambda: fsync_tree(path) if rank == 0 else None)
    restore_s, err = timed_restores(
        path,
        shards,
        check_sel,
        lambda: Snapshot(str(path)).restore(app_state={"model": model}),
        restore_repeats,
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
    log(
        f"torchsnapshot take: {dt:.2f}s, {nbytes / GB:.2f} GB (+{fsync_s:.2f}s fsync), "
        f"restore {restore_s:.2f}s (err {err:.2g})"
    )
    rmtree(path)
    gc.collect()

    for copy in (False, True):
        rows.append(torchsnapshot_async(model, bench / f"ts_async_{copy}", shards, check_sel, copy))
        gc.collect()

    # DCP, synchronous (FileSystemWriter fsyncs by default)
    path = bench / "dcp_save"
    row: dict[str, Any] = {"method": "DCP save", "restore_s": None}
    try:
        dt, _ = timed(lambda: dcp.save(model.state_dict(), checkpoint_id=str(path)))
        row.update(stall_s=dt, commit_s=dt, bytes=bcast(tree_bytes(path) if rank == 0 else None))

        def load() -> None:
            sd = model.state_dict()
            dcp.load(sd, checkpoint_id=str(path))
            model.load_state_dict(sd)

        restore_s, err = timed_restores(path, shards, check_sel, load, restore_repeats)
        row.update(restore_s=restore_s, restore_max_abs_err=err)
        log(
            f"DCP save: {dt:.2f}s, {row['bytes'] / GB:.2f} GB, restore {restore_s:.2f}s (err {err:.2g})"
        )
    except Exception as e:  # reported, not fatal: the other methods still run
        row["error"] = f"{type(e).__name__}: {e}"
        log(f"DCP save failed: {row['error']}")
    rows.append(row)
    rmtree(path)
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
        completion: Any = getattr(response, "upload_completion", response)
        completion.result()
        t2 = time.perf_counter()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        row["error"] = "; ".join(failed)
        log(f"DCP async_save failed: {row['error']}")
    else:
        row.update(
            stall_s=max_over_ranks(t1 - t0),
            commit_s=max_over_ranks(t2 - t0),
            bytes=bcast(tree_bytes(path) if rank == 0 else None),
        )
        log(
            f"DCP async_save: stall {row['stall_s']:.2f}s, commit {row['commit_s']:.2f}s, "
            f"{row['bytes'] / GB:.2f} GB"
        )
    rows.append(row)
    rmtree(path)
    gc.collect()
    return rows
