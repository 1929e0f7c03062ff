"""``dcp.async_save`` of a TorchRec DLRM (``--tables`` x ``--rows`` x ``--dim`` fp32, fused
row-wise Adagrad) with the library's stager, in turns against ``dcp.save``, DCP's
``DefaultStager`` (it fails on the TorchRec model: timed on a dense model of equal bytes),
torchsnapshot's ``async_take`` (patched to copy, :mod:`benchmarks.peers`) and the manager.

*Blocked*: the call's time, the slowest rank's; *slowdown*: the mean step while the write
runs (``--steps`` at least) over a clean stretch's; memory: the peak resident set over the
call's start, the largest rank's. The stager's checkpoint is loaded back with stock
``dcp.load`` and compared with the state at the call. Targets: the stager blocks <= 1/10 of
``dcp.save`` and ``async_take``, and <= 2x the manager.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchsnapshot import Snapshot

from benchmarks import measure, peers
from benchmarks.harness import Bench, Case, Outcome, cli
from benchmarks.measure import GB, StepLoop
from benchmarks.results import Goal, Table
from cnr_train.workload import ZipfBatches
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.interop import DcpStager
from torchrec_cnr.testing.memory import proc_status_mb, reset_peak_rss

Wait = Callable[[], bool]  # whether the write in flight has ended


def _arguments(p: argparse.ArgumentParser) -> None:
    measure.model_arguments(p, rows=500_000)
    p.add_argument("--rounds", type=int, default=3, help="turns of each method")
    p.add_argument("--steps", type=int, default=20, help="steps trained after each call")
    p.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    p.add_argument("--executors", nargs="+", choices=("thread", "process"),
                   default=["thread", "process"], help="DCP's executors the stager runs with "
                   "(process: under torchrun; the tests' ranks are daemons, which may not start one)")  # fmt: skip


def _recipe(loop: StepLoop) -> dict[str, Any]:
    model = loop.work.model
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}


class _Dense(nn.Module):
    """A dense model of ``nbytes`` of fp32 parameters, in pieces of 64 MB."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        n, piece = nbytes // 4, 16 << 20
        self.pieces = nn.ParameterList(
            nn.Parameter(torch.randn(min(piece, n - i))) for i in range(0, n, piece)
        )


def _flat(obj: Any) -> list[torch.Tensor]:
    """Every tensor of a state dict, this rank's shards of the sharded ones, in order."""
    if isinstance(obj, dict):
        return [t for k in sorted(obj) for t in _flat(obj[k])]
    if hasattr(obj, "local_shards"):
        return [s.tensor.clone() for s in obj.local_shards()]
    return [obj.detach().clone()] if isinstance(obj, torch.Tensor) else []


def run(b: Bench) -> Outcome:
    a = b.args
    loop = StepLoop.warm(a, a.batch, steps=3)
    group = dist.new_group(backend="gloo")  # DCP's collectives apart from training's
    stager = DcpStager(loop.work.model)
    manager = CheckpointManager(loop.work.model,
                                CheckpointConfig(path=str(b.scratch / "manager"), policy="full"))  # fmt: skip
    dense_bytes = sum(t.numel() * t.element_size() for t in _flat(_recipe(loop)))
    dense = _Dense(dense_bytes)
    figures: dict[str, dict[str, list[float]]] = {}

    def arm(name: str, call: Callable[[], Wait]) -> float:
        """``call()`` (the save), then training until the write ends; its figures noted."""
        dist.barrier()
        before = reset_peak_rss()
        t0 = time.perf_counter()
        done = call()
        blocked = time.perf_counter() - t0
        steps: list[float] = []
        # Every rank trains as many steps: until the write has ended on every rank.
        while len(steps) < a.steps or not all(measure.gathered(done())):
            steps += loop.train(1)
        total = time.perf_counter() - t0
        peak = proc_status_mb("VmHWM") - before
        blocked_s, total_s = measure.max_over_ranks(blocked, total)
        got = figures.setdefault(name, {})
        now = {"blocked_s": blocked_s, "total_s": total_s, "step_s": statistics.mean(steps),
               "peak_mb": measure.max_over_ranks(peak)[0]}  # fmt: skip
        for key, value in now.items():
            got.setdefault(key, []).append(value)
        if name.startswith("stager"):  # of the call, the stager's own part
            got.setdefault("stage_s", []).append(measure.max_over_ranks(stager.stall_s)[0])
        return blocked_s

    def async_save(executor: AsyncCheckpointerType, path: Path, state: Any = None,
                   **kw: Any) -> Wait:  # fmt: skip
        response: Any = dcp.async_save(
            state if state is not None else _recipe(loop), checkpoint_id=str(path),
            process_group=group, async_checkpointer_type=executor, **kw,
        )  # fmt: skip
        upload = getattr(response, "upload_completion", response)

        def finished() -> bool:
            if upload.done():
                upload.result()  # raises what the write raised
                return True
            return False

        return finished

    def manager_save() -> Wait:
        manager.save(loop.step)
        # Its background job's state (no collective): the commit has ended.
        return lambda: manager._background.busy is None

    def async_take(path: Path) -> Wait:
        with peers._copying_async_take():
            pending = Snapshot.async_take(str(path), app_state={"model": loop.work.model},
                                          replicated=["**"])  # fmt: skip
        return pending.done

    paths = {name: b.scratch / name for name in
             ("stager_thread", "stager_process", "dcp_save", "default_stager_dense",
              "torchsnapshot_async_take")}  # fmt: skip
    executors = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
    methods: dict[str, Callable[[], Wait]] = {
        f"stager_{e}": lambda e=e: async_save(executors[e], paths[f"stager_{e}"],  # type: ignore[misc]
                                              async_stager=stager)
        for e in a.executors
    }  # fmt: skip
    methods |= {
        "dcp_save": lambda: (dcp.save(_recipe(loop), checkpoint_id=str(paths["dcp_save"]),
                                      process_group=group), lambda: True)[1],
        "default_stager_dense": lambda: async_save(
            AsyncCheckpointerType.THREAD, paths["default_stager_dense"],
            state={"model": dense.state_dict()}),
        "torchsnapshot_async_take": lambda: async_take(paths["torchsnapshot_async_take"]),
        "manager_save": manager_save,
    }  # fmt: skip
    if "process" in a.executors:  # DCP's process executor starts its daemon with its first save
        warm = async_save(executors["process"], b.scratch / "warm", async_stager=stager)
        while not all(measure.gathered(warm())):
            time.sleep(0.1)
    clean = [statistics.mean(loop.train(a.steps)) for _ in range(2)]
    b.interleaved(a.rounds, methods, lambda n: arm(n, methods[n]),
                  prepare=lambda n: measure.rmtree(paths[n]) if n in paths else None,
                  label="save")  # fmt: skip
    for _ in range(a.rounds):
        clean.append(statistics.mean(loop.train(a.steps)))
    clean_step = statistics.median(clean)
    m: dict[str, Any] = {name: {k: statistics.median(v) for k, v in got.items()}
                         | {"blocked_all": got["blocked_s"]} for name, got in figures.items()}  # fmt: skip
    for name in m:
        m[name]["slowdown"] = m[name]["step_s"] / clean_step - 1
    m["clean_step_s"] = clean_step
    m["model_gb"] = dense_bytes * b.world / GB
    m["default_stager_torchrec"] = _default_stager_fails(loop, b.scratch / "default", group)
    m["stager_load_exact"] = _round_trip(a, loop, stager, b.scratch / "round_trip", group)
    stager.close()
    manager.close()
    rows = [[name, m[name]["blocked_s"], m[name]["total_s"], 100 * m[name]["slowdown"],
             m[name]["peak_mb"]] for name in methods]  # fmt: skip
    note = (
        f"{a.tables} tables x {a.rows} rows x dim {a.dim} fp32 ({m['model_gb']:.2f} GB with "
        f"the optimizer state) on {b.world} ranks; median of {a.rounds} turns; slowdown: the "
        f"mean step while the write runs against a clean stretch ({clean_step * 1e3:.1f} ms); "
        "default_stager_dense: DCP's DefaultStager on a dense model of equal bytes; on the "
        f"TorchRec model it fails: {m['default_stager_torchrec']}; the stager's checkpoint "
        f"loaded with stock dcp.load equals the state at the call: {m['stager_load_exact']}"
    )
    columns = ["method", "blocked s", "until written s", "training slowdown %",
               "peak MB over its start"]  # fmt: skip
    table = Table("dcp.async_save with DcpStager against the other ways to save", columns, rows,
                  note)  # fmt: skip
    goals = [
        Goal("stager (thread) blocked <= 1/10 of dcp.save's", "stager_thread.blocked_s", "<=",
             "dcp_save.blocked_s", 0.1),
        Goal("stager (thread) blocked <= 1/10 of torchsnapshot async_take's",
             "stager_thread.blocked_s", "<=", "torchsnapshot_async_take.blocked_s", 0.1),
        Goal("stager (thread) blocked <= 2x the manager's save",
             "stager_thread.blocked_s", "<=", "manager_save.blocked_s", 2.0),
    ]  # fmt: skip
    if "process" in a.executors:
        goals.append(Goal("stager (process) blocked <= 1/10 of dcp.save's",
                          "stager_process.blocked_s", "<=", "dcp_save.blocked_s", 0.1))  # fmt: skip
    return Outcome(m, [table], goals)


def _default_stager_fails(loop: StepLoop, path: Path, group: dist.ProcessGroup) -> str:
    """DCP's own stager on the TorchRec model: what it raises (every rank's agreed)."""
    error = None
    try:
        response: Any = dcp.async_save(_recipe(loop), checkpoint_id=str(path),
                                       process_group=group)  # fmt: skip
        getattr(response, "upload_completion", response).result()
    except Exception as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    found = [e for e in measure.gathered(error) if e]
    return found[0] if found else "it worked"


def _round_trip(a: argparse.Namespace, loop: StepLoop, stager: DcpStager, path: Path,
                group: dist.ProcessGroup) -> bool:  # fmt: skip
    """The stager's save, training at once, then stock ``dcp.load`` into a second model:
    whether it holds the state of the call, on every rank."""
    want = _flat(_recipe(loop))
    response: Any = dcp.async_save(_recipe(loop), checkpoint_id=str(path), async_stager=stager,
                                   process_group=group)  # fmt: skip
    loop.train(3)
    response.upload_completion.result()
    other = StepLoop(measure.uniform_model(a), ZipfBatches(loop.work.tables, 8),
                     dist.get_rank())  # fmt: skip
    target = _recipe(other)
    dcp.load(target, checkpoint_id=str(path), process_group=group)
    other.work.model.load_state_dict(target["model"])
    other.work.model.fused_optimizer.load_state_dict(target["optim"])
    got = _flat(_recipe(other))
    same = len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want))
    return all(measure.gathered(same))


CASE = Case("dcp_stager", "dcp.async_save of a TorchRec model with DcpStager against dcp.save, "
            "DefaultStager, torchsnapshot async_take and the manager", _arguments,
            "--tables 2 --rows 4000 --dim 16 --rounds 1 --steps 2 --batch 32 --executors thread",
            run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
