"""The peers a checkpoint is compared with, on the same model: torchsnapshot ``take`` and
``async_take``, torch.distributed.checkpoint ``save`` and ``async_save``, each a row of
figures, the slowest rank's. The one patch (:func:`_copying_async_take`) is applied inside
the peer that needs it and undone when it returns.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchsnapshot import Snapshot
from torchsnapshot.io_preparers.tensor import TensorBufferStager
from torchsnapshot.serialization import Serializer

from benchmarks import measure
from benchmarks.measure import Rows
from torchrec_cnr.storage.fs import tree_bytes
from torchrec_cnr.tracking.shard import LocalShard

Row = dict[str, Any]


def torchsnapshot_take_durable(model: torch.nn.Module, path: Path) -> float:
    """torchsnapshot ``take`` and the fsync it leaves out: a durable commit, as ours and DCP's."""

    def take() -> None:
        _snapshot(model, path)
        measure.fsync_tree(path)

    return measure.timed(take)[0]


def _snapshot(model: torch.nn.Module, path: Path) -> None:
    Snapshot.take(str(path), app_state={"model": model}, replicated=["**"])


def torchsnapshot_restore(model: torch.nn.Module, path: Path) -> Callable[[], None]:
    """A restore of the snapshot at ``path`` into ``model``, to time."""
    return lambda: Snapshot(str(path)).restore(app_state={"model": model})


def _copying_async_take() -> contextlib.AbstractContextManager[Any]:
    """Makes torchsnapshot's ``async_take`` copy CPU tensors, as its code intends: 0.1.0
    compares the serializer (a str) with an enum member, never equal, so it keeps views of the
    live tensors and training tears the snapshot. This compares ``.value``."""
    original = TensorBufferStager._should_copy_cpu_tensor

    def fixed(self: TensorBufferStager) -> bool:
        if self.entry.serializer == Serializer.BUFFER_PROTOCOL.value and (
            self.is_async_snapshot or not self.tensor.is_contiguous()
        ):
            return True
        return original(self)

    return mock.patch.object(TensorBufferStager, "_should_copy_cpu_tensor", fixed)


def _take(model: torch.nn.Module, path: Path, shards: list[LocalShard], rows: Rows) -> Row:
    took, _ = measure.timed(lambda: _snapshot(model, path))
    fsync_s, _ = measure.timed(lambda: measure.fsync_tree(path))
    restore_s, err = measure.timed_restore(torchsnapshot_restore(model, path), path, shards, rows)
    return {"method": "torchsnapshot take", "stall_s": took, "commit_s": took,
            "fsync_after_s": fsync_s, "restore_s": restore_s, "restore_max_abs_err": err}  # fmt: skip


def _async_take(model: torch.nn.Module, path: Path, shards: list[LocalShard], rows: Rows,
                copy: bool) -> Row:  # fmt: skip
    """``async_take`` while training goes on (+1 on ``rows``): the restore shows a torn one."""
    before = [s.weight[r].clone() for s, r in zip(shards, rows)]
    with _copying_async_take() if copy else contextlib.nullcontext():
        dist.barrier()
        t0 = time.perf_counter()
        pending = Snapshot.async_take(str(path), app_state={"model": model}, replicated=["**"])
        t1 = time.perf_counter()
        with torch.no_grad():
            for s, r in zip(shards, rows):
                s.weight[r] += 1.0
        pending.wait()
        t2 = time.perf_counter()
    stall, commit = measure.max_over_ranks(t1 - t0, t2 - t0)
    del pending
    fsync_s, _ = measure.timed(lambda: measure.fsync_tree(path))
    measure.drop_cache(path)
    # The live rows are now `before + 1`: a consistent snapshot gives back `before`.
    restore_s, _ = measure.timed(torchsnapshot_restore(model, path))
    torn = measure.max_abs_diff(shards, rows, before)
    with torch.no_grad():  # the model as it was, whatever the snapshot held
        for s, r, v in zip(shards, rows, before):
            s.weight[r] = v
    return {"method": "torchsnapshot async_take" + (", patched to copy" if copy else " as shipped"),
            "stall_s": stall, "commit_s": commit, "fsync_after_s": fsync_s,
            "restore_s": restore_s, "restore_max_abs_err": torn, "consistent": torn == 0.0}  # fmt: skip


def _dcp_save(model: torch.nn.Module, path: Path, shards: list[LocalShard], rows: Rows) -> Row:
    """DCP ``save`` of the model's state dict (its FileSystemWriter fsyncs by default)."""
    try:
        took, _ = measure.timed(lambda: dcp.save(model.state_dict(), checkpoint_id=str(path)))
    except Exception as e:  # reported in the row: the other methods still run
        return {"method": "DCP save", "error": f"{type(e).__name__}: {e}"}

    def load() -> None:
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=str(path))
        model.load_state_dict(sd)

    restore_s, err = measure.timed_restore(load, path, shards, rows)
    return {"method": "DCP save", "stall_s": took, "commit_s": took, "restore_s": restore_s,
            "restore_max_abs_err": err}  # fmt: skip


def _dcp_async_save(model: torch.nn.Module, path: Path) -> Row:
    """DCP ``async_save`` on a group of its own, every rank's error gathered (all agree)."""
    group = dist.new_group(backend="gloo")
    error = None
    dist.barrier()
    t0 = t1 = t2 = time.perf_counter()
    try:
        response = dcp.async_save(model.state_dict(), checkpoint_id=str(path), process_group=group)
        t1 = time.perf_counter()
        completion: Any = getattr(response, "upload_completion", response)
        completion.result()
        t2 = time.perf_counter()
    except Exception as e:  # reported in the row: the other methods still run
        error = f"{type(e).__name__}: {e}"
    failed = [f"rank {r}: {e}" for r, e in enumerate(measure.gathered(error)) if e]
    stall, commit = measure.max_over_ranks(t1 - t0, t2 - t0)
    if failed:
        return {"method": "DCP async_save", "error": "; ".join(failed)}
    return {"method": "DCP async_save", "stall_s": stall, "commit_s": commit}


def run_peers(model: torch.nn.Module, folder: Path, shards: list[LocalShard],
              rows: Rows) -> dict[str, Row]:  # fmt: skip
    """Every peer in turn on ``model``, each into a fresh folder deleted afterwards; each
    restore is checked on ``rows`` (which ``async_take``'s training modifies as it writes)."""
    peers: dict[str, Callable[[Path], Row]] = {
        "torchsnapshot_take": lambda p: _take(model, p, shards, rows),
        "torchsnapshot_async_take": lambda p: _async_take(model, p, shards, rows, False),
        "torchsnapshot_async_take_copy": lambda p: _async_take(model, p, shards, rows, True),
        "dcp_save": lambda p: _dcp_save(model, p, shards, rows),
        "dcp_async_save": lambda p: _dcp_async_save(model, p),
    }
    out = {}
    for key, peer in peers.items():
        path = folder / key
        row = out[key] = peer(path)
        if "error" not in row:
            row["bytes"] = measure.from_rank0(lambda p=path: tree_bytes(p))  # type: ignore[misc]
        measure.rmtree(path)
        gc.collect()
    return out
