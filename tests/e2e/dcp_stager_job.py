"""A TorchRec job that checkpoints with stock ``dcp.async_save`` and the library's stager,
as a user's ``train.py`` would, then trains on at once; a fresh model loaded with stock
``dcp.load`` must then hold the state of the call, bit for bit.

    torchrun --standalone --nproc_per_node=2 tests/e2e/dcp_stager_job.py --root DIR \
        --cases thread process-dtensor fails [--out RESULT.json]

Each case saves under ``DIR/<case>`` with one of DCP's executors (``thread``, ``process``),
from a model whose state dict holds ShardedTensors or DTensors (``-dtensor``); ``fails``
checks that staging failed on one rank fails the save on every rank. With
``--check-only`` (any world size), each case's checkpoint is loaded into a fresh model and
compared with the references the saving job wrote beside it, table by table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.jobs import make_job  # noqa: E402
from torchrec_cnr import CheckpointError  # noqa: E402
from torchrec_cnr.interop import DcpStager  # noqa: E402
from torchrec_cnr.launch import init_distributed  # noqa: E402
from torchrec_cnr.tracking import model_state  # noqa: E402

TRAINED = 3
"""Steps trained before the save."""


def _state(job: Any) -> dict[str, Any]:
    """TorchRec's recipe, and the dense torch optimizer (a ``Stateful``)."""
    return {
        "model": job.model.state_dict(),
        "optim": job.model.fused_optimizer.state_dict(),
        "dense_opt": job.dense_opt,
    }


def _load(fresh: Any, root: str, group: dist.ProcessGroup, dense: bool = True) -> None:
    """Stock ``dcp.load`` of TorchRec's recipe, then of the dense optimizer apart.

    TorchRec's fused optimizer state holds only a rank's own tables, so a rank's target
    lacks keys the checkpoint has, which sends ``dcp.load`` to the flattening of older
    checkpoints, where an optimizer's list of param groups does not load: loaded apart
    (a partial load), it does."""
    target = _state(fresh)
    dcp.load({"model": target["model"], "optim": target["optim"]}, checkpoint_id=root,
             process_group=group)  # fmt: skip
    fresh.model.load_state_dict(target["model"])
    fresh.model.fused_optimizer.load_state_dict(target["optim"])
    if dense:
        dcp.load({"dense_opt": fresh.dense_opt}, checkpoint_id=root, process_group=group,
                 planner=DefaultLoadPlanner(allow_partial_load=True))  # fmt: skip


def _flat(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a state dict, this rank's part of each sharded one by its offsets."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if hasattr(obj, "state_dict") and not isinstance(obj, dict):
        obj = obj.state_dict()
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}/"))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            out.update(_flat(v, f"{prefix}{i}/"))
    elif isinstance(obj, ShardedTensor):
        for s in obj.local_shards():
            out[f"{prefix}{list(s.metadata.shard_offsets)}"] = s.tensor.detach().clone()
    elif isinstance(obj, DTensor):
        local = obj.to_local()
        shards = local.local_shards() if hasattr(local, "local_shards") else [local]
        offsets = local.local_offsets() if hasattr(local, "local_offsets") else [None]
        for t, at in zip(shards, offsets):
            out[f"{prefix}{list(at) if at is not None else ''}"] = t.detach().clone()
    elif isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().clone()
    return out


def _differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    missing = sorted(set(want) - set(got))
    return missing + [k for k in sorted(want) if k in got and not torch.equal(got[k], want[k])]


def _fresh(dtensor: bool) -> Any:
    """A model of another seed, trained as many steps as the saved one was at the call: its
    dense optimizer holds state for the same parameters (DCP loads into the keys the target
    has, and finds a checkpoint with more keys than those of an older format)."""
    fresh = make_job("ebc", optimizer="exact_adagrad", seed=7, dtensor=dtensor)
    fresh.train(TRAINED)
    return fresh


def save_and_check(root: str, executor: str, dtensor: bool) -> dict[str, Any]:
    job = make_job("ebc", optimizer="exact_adagrad", seed=1, dtensor=dtensor)
    job.train(TRAINED)
    stager = DcpStager(job.model)
    group = dist.new_group(backend="gloo")  # DCP's collectives apart from training's
    kind = AsyncCheckpointerType.PROCESS if executor == "process" else AsyncCheckpointerType.THREAD
    state = _state(job)
    want = _flat(state)  # the state at the call
    began = time.perf_counter()
    response = dcp.async_save(state, checkpoint_id=root, async_stager=stager,
                              process_group=group, async_checkpointer_type=kind)  # fmt: skip
    blocked_s = time.perf_counter() - began
    job.train(3)  # at once: every batch updates rows while they are staged and written
    moved = _differences(_flat(_state(job)), want)
    # A stager whose staging is a future: async_save answers with both futures.
    assert isinstance(response, AsyncSaveResponse)
    response.upload_completion.result()
    stager.close()
    torch.save(want, f"{root}.refs.{dist.get_rank()}")
    fresh = _fresh(dtensor)
    _load(fresh, root, group)
    wrong = _differences(_flat(_state(fresh)), want)
    assert moved, "training on changed nothing: the test would prove nothing"
    assert not wrong, f"loaded tensors differ from the state at the call: {wrong[:5]}"
    # Every table's rows and optimizer state were left to copy-on-write (the rest: dense).
    tracked = sum(t.numel() * t.element_size() for s in model_state.local_shards(job.model)
                  for t in [s.weight, *s.states.values()])  # fmt: skip
    assert stager.copy_on_write_bytes == tracked, (stager.copy_on_write_bytes, tracked)
    return {"blocked_s": blocked_s, "stall_s": stager.stall_s, "tensors": len(want),
            "copied_bytes": stager.copied_bytes, "copy_on_write_bytes": tracked}  # fmt: skip


def check_only(root: str, dtensor: bool) -> None:
    """Loads ``root`` (written by 2 ranks) on this job's ranks: every table, as the saving
    ranks saw it at the call, by its offsets."""
    fresh = _fresh(dtensor)
    _load(fresh, root, dist.new_group(backend="gloo"), dense=False)
    saved: dict[str, torch.Tensor] = {}
    for path in sorted(Path(root).parent.glob(f"{Path(root).name}.refs.*")):
        saved.update(torch.load(path))
    whole = _assembled(saved)
    got = _flat(_state(fresh))
    compared = 0
    for key, piece in got.items():
        name, _, at = key.rpartition("/")
        if not at.startswith("["):
            continue  # a replicated tensor: the same on every rank, compared by the saver
        region = tuple(slice(o, o + n) for o, n in zip(json.loads(at), piece.shape))
        assert torch.equal(piece, whole[name][region]), key
        compared += 1
    assert compared, "no sharded tensor was compared"


def _assembled(pieces: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each sharded tensor whole, from every rank's pieces keyed ``name/[offsets]``."""
    by_name: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    for key, piece in pieces.items():
        name, _, at = key.rpartition("/")
        if at.startswith("["):
            by_name.setdefault(name, []).append((json.loads(at), piece))
    whole = {}
    for name, parts in by_name.items():
        shape = [max(o[d] + t.shape[d] for o, t in parts) for d in range(parts[0][1].dim())]
        out = torch.empty(shape, dtype=parts[0][1].dtype)
        for offsets, t in parts:
            out[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
        whole[name] = out
    return whole


def fails_on_every_rank(root: str) -> None:
    """Staging that fails on rank 1 fails ``async_save`` on every rank, with its error."""
    job = make_job("ebc", optimizer="exact_adagrad", seed=1)
    job.train(1)
    stager = DcpStager(job.model)
    if dist.get_rank() == 1:

        def broken(self: Any, sink: Any) -> None:
            raise OSError("injected: the copy failed")

        for shard in model_state.local_shards(job.model):
            shard.drain()
        import torchrec_cnr.staging.lazy as lazy

        lazy.LazyStaging.run = broken  # type: ignore[method-assign,assignment]
    response = dcp.async_save(_state(job), checkpoint_id=root, async_stager=stager,
                              process_group=dist.new_group(backend="gloo"))  # fmt: skip
    assert isinstance(response, AsyncSaveResponse)
    try:
        response.upload_completion.result(timeout=120)
    except CheckpointError as e:
        assert "on rank 1: injected: the copy failed" in str(e), e
    else:
        raise AssertionError("the save succeeded on this rank")
    stager.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True, help="a folder; each case saves under it")
    parser.add_argument(
        "--cases", nargs="+", default=["thread"],
        help="thread, process, thread-dtensor, process-dtensor (saved and checked), fails",
    )  # fmt: skip
    parser.add_argument("--check-only", action="store_true", help="load --root's cases here")
    parser.add_argument("--out")
    args = parser.parse_args()
    init_distributed("gloo")
    results = {}
    try:
        for case in args.cases:
            root = f"{args.root}/{case}"
            if case == "fails":
                fails_on_every_rank(root)
            elif args.check_only:
                check_only(root, case.endswith("dtensor"))
            else:
                executor = case.removesuffix("-dtensor")
                results[case] = save_and_check(root, executor, case.endswith("dtensor"))
        if args.out:
            Path(f"{args.out}.{dist.get_rank()}").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
