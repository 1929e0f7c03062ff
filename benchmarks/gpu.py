"""Checkpoints of CUDA tables: the stall against its copy floor, the cost to training at a
cadence, and the peers' blocking times, in one process on one GPU (``--device cpu`` runs
the same on the host: how it is tried without a GPU; its figures are not GPU figures).

- **Stall**, per size (``--gib`` of fp32 tables) and share of rows modified: a delta
  ``save()`` (median of ``--repeats``, lazy staging) and the background copy against the
  floor, a gather of as many rows on the device and their copy to pinned host memory
  (targets <= 2x); a full ``save()`` against 2 ms + a copy of the dense state.
- **Cadence**: training on the smallest size for ``--cadence-s`` s per arm: no checkpoint,
  one every ``--cadences`` s (consecutive, lazy), and the floor as often. Throughput lost:
  targets <= 1% at 2 s and <= 2x the floor's loss.
- **Peers**: the blocking time of a full save: ``save()``, torchsnapshot ``async_take``,
  ``dcp.save``, ``dcp.async_save`` alone and with ``DcpStager`` (a failure is recorded).

``--budget-s`` fits a lease: the sections run in the order ``run`` gives, and what is cut or
skipped is recorded in ``cut``.

    source .device/gpu/on_device.sh && python3 -m benchmarks.gpu --out $OUT/gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torchsnapshot import Snapshot

from benchmarks import measure, peers
from benchmarks.harness import Bench, Case, Outcome, main
from benchmarks.results import Goal, Table
from cnr_train.workload import TableSpec, ZipfBatches, build_model, dense_optimizer, train_step
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.interop import DcpStager
from torchrec_cnr.launch import init_distributed
from torchrec_cnr.offline import list_checkpoints
from torchrec_cnr.testing.rows import modify
from torchrec_cnr.tracking import model_state

DIM = 64


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--gib", type=float, nargs="+", default=[1.0, 8.0])
    p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.05, 0.25])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cadences", type=float, nargs="+", default=[2.0, 5.0, 10.0])
    p.add_argument("--cadence-s", type=float, default=30.0, help="seconds of training per arm")
    p.add_argument("--rounds", type=int, default=3, help="turns the cadence arms take")
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--budget-s", type=float,
                   help="skip a section that would start after this many seconds, and cut one "
                   "still running then (recorded as such)")  # fmt: skip


def _model(b: Bench, gib: float) -> Any:
    """The model of ``gib`` GiB of fp32 tables (4 x 64 columns), its optimizer and tables."""
    tables = [TableSpec(f"t{i}", max(1000, int(gib * 2**30 / (4 * DIM * 4))), DIM, "table_wise")
              for i in range(4)]  # fmt: skip
    model = build_model(tables, seed=0, device=torch.device(b.args.device))
    return model, dense_optimizer(model), tables


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _floor_s(b: Bench, shards: list[Any], rows: list[torch.Tensor]) -> float:
    """A gather of ``rows`` of every shard (weights and states) and their copy to pinned host
    memory: the least a checkpoint of those rows costs training."""
    pin = b.args.device == "cuda"
    pairs = []
    for s, r in zip(shards, rows):
        for t in (s.weight, *s.states.values()):
            host = torch.empty((r.numel(), *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
            pairs.append((t, r, host))

    def copy() -> None:
        for t, r, host in pairs:
            host.copy_(t.index_select(0, r), non_blocking=pin)
        _sync(b.args.device)

    copy()
    return statistics.median(measure.timed(copy)[0] for _ in range(5))


def _stall(b: Bench, gib: float, out: list[dict[str, Any]]) -> None:
    """Delta saves per share of rows, and full saves, against their floors: rows appended to
    ``out`` as they are measured (a section cut short keeps them)."""
    a = b.args
    model = _model(b, gib)[0]
    shards = model_state.local_shards(model)
    dense = model_state.dense_state(model)
    copies = [measure.timed(lambda: {k: v.detach().to("cpu") for k, v in dense.items()})[0]
              for _ in range(5)]  # fmt: skip
    dense_s = statistics.median(copies)
    root = b.scratch / f"stall_{gib}"
    steps = itertools.count(1)
    with CheckpointManager(model, CheckpointConfig(path=str(root), policy="intermittent")) as ck:
        measure.timed_save(ck, next(steps))  # the baseline
        for f, rows in measure.random_rows(shards, a.fractions).items():
            on_device = [r.to(a.device) for r in rows]
            saves, background = [], []
            for _ in range(a.repeats):
                modify(shards, on_device)
                _sync(a.device)
                saves.append(measure.timed_save(ck, next(steps))[0])
                lazy = ck.lazy_staging
                background.append(0.0 if lazy is None else lazy.background_s)
            row = {"gib": gib, "fraction": f, "save_s": statistics.median(saves),
                   "slowest_s": max(saves), "floor_s": _floor_s(b, shards, on_device),
                   "background_s": statistics.median(background)}  # fmt: skip
            b.log_row(row)
            out.append(row)
    measure.rmtree(root)
    full_cfg = CheckpointConfig(path=str(root) + "_full", policy="full", keep_last=1)
    with CheckpointManager(model, full_cfg) as ck:
        measure.timed_save(ck, 1)  # buffers faulted in once
        full = [measure.timed_save(ck, 2 + i)[0] for i in range(a.repeats)]
    out.append({"gib": gib, "fraction": 1.0, "save_s": statistics.median(full),
                "slowest_s": max(full), "floor_s": 0.002 + dense_s, "background_s": None})  # fmt: skip
    measure.rmtree(Path(f"{root}_full"))


def _copy_to(host: torch.Tensor, src: torch.Tensor, pin: bool, _step: int) -> None:
    host.copy_(src, non_blocking=pin)


def _cadence(b: Bench) -> dict[str, Any]:
    """Steps per second of one training loop per arm, the arms in turns over ``--rounds``
    rounds: no checkpoint, a checkpoint every ``e`` s, and the floor every ``e`` s (a copy to
    pinned memory of the bytes that cadence's checkpoints staged in a calibration stretch).
    A checkpoint arm's last commit ends, untimed, before the next arm's turn; each turn's
    rate is kept (``rounds``), so the spread between turns is in the result."""
    a = b.args
    model, opt, tables = _model(b, min(a.gib))
    data = ZipfBatches(tables, a.batch, seed=0)
    dev = torch.device(a.device)
    pin = a.device == "cuda"
    step = 0

    since: dict[str, float] = {}  # an arm's training seconds since its last act, across turns
    acts: dict[str, int] = {}

    def train(name: str, seconds: float, every_s: float | None,
              act: Callable[[int], Any]) -> tuple[int, float]:  # fmt: skip
        nonlocal step
        began = last = time.perf_counter()
        steps = 0
        while (now := time.perf_counter()) - began < seconds:
            step += 1
            train_step(model, opt, data.batch(0, step).to(dev))
            steps += 1
            if every_s is not None and since.get(name, 0.0) + now - last >= every_s:
                act(step)
                acts[name] = acts.get(name, 0) + 1
                since[name], last = 0.0, now
        _sync(a.device)
        since[name] = since.get(name, 0.0) + time.perf_counter() - last
        return steps, time.perf_counter() - began

    stretch = a.cadence_s / a.rounds
    arms: dict[str, tuple[float | None, Callable[[int], Any]]] = {"none": (None, lambda s: None)}
    staged: dict[str, int] = {}
    settle: dict[str, Callable[[], Any]] = {}
    with contextlib.ExitStack() as stack:
        train("warm", min(5.0, stretch), None, lambda s: None)
        for every in a.cadences:
            root = b.scratch / f"cadence_{every:g}"
            cfg = CheckpointConfig(path=str(root), policy="consecutive")
            ck = stack.enter_context(CheckpointManager(model, cfg))
            # A calibration: the bytes a checkpoint at this cadence stages.
            train(f"calibrate_{every:g}", 2.5 * every, every, ck.save)
            ck.wait()
            infos = list_checkpoints(str(root))[1:] or list_checkpoints(str(root))
            staged[f"{every:g}s"] = nbytes = int(statistics.mean(i.staged_bytes for i in infos))
            src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            arms[f"ckpt_{every:g}s"] = (every, ck.save)
            arms[f"floor_{every:g}s"] = (every, functools.partial(_copy_to, host, src, pin))
            settle[f"ckpt_{every:g}s"] = ck.wait
        steps = {name: [0, 0.0] for name in arms}
        rounds: dict[str, list[float]] = {name: [] for name in arms}  # steps/s per turn
        names = list(arms)
        for r in range(a.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                n, took = train(name, stretch, *arms[name])
                # Untimed: an arm's last commit ends before the next arm starts.
                settle.get(name, lambda: None)()
                steps[name][0] += n
                steps[name][1] += took
                rounds[name].append(n / took)
            b.log(f"cadence round {r + 1}/{a.rounds}: " + ", ".join(
                f"{k} {v[-1]:.1f}/s" for k, v in rounds.items()))  # fmt: skip
    rate = {name: n / took for name, (n, took) in steps.items()}
    return {f"{e:g}s": {"lost": 1 - rate[f"ckpt_{e:g}s"] / rate["none"],
                        "floor_lost": 1 - rate[f"floor_{e:g}s"] / rate["none"],
                        "steps_per_s": rate[f"ckpt_{e:g}s"], "plain_steps_per_s": rate["none"],
                        "rounds": rounds[f"ckpt_{e:g}s"], "plain_rounds": rounds["none"],
                        "checkpoints": acts.get(f"ckpt_{e:g}s", 0),
                        "staged_bytes": staged[f"{e:g}s"]} for e in a.cadences}  # fmt: skip


def _peers(b: Bench) -> dict[str, Any]:
    """The blocking time of a full save of the smallest model, per method."""
    model = _model(b, min(b.args.gib))[0]
    got: dict[str, Any] = {}

    def blocking(name: str, start: Callable[[Path], Any], finish: Callable[[Any], None]) -> None:
        path = b.scratch / name.replace(" ", "_")
        try:
            t0 = time.perf_counter()
            pending = start(path)
            got[name] = time.perf_counter() - t0
            finish(pending)
        except Exception as e:  # noqa: BLE001 - a peer that fails is a result
            got[name] = f"fails: {type(e).__name__}: {str(e)[:160]}"
        measure.rmtree(path)

    cfg = CheckpointConfig(path=str(b.scratch / "ours"), policy="full")
    with CheckpointManager(model, cfg) as ck:
        measure.timed_save(ck, 1)
        blocking("torchrec_cnr save()", lambda p: ck.save(2), lambda _: ck.wait())
    with peers._copying_async_take():
        blocking("torchsnapshot async_take", lambda p: Snapshot.async_take(
            str(p), app_state={"model": model}), lambda pending: pending.wait())  # fmt: skip
    blocking("dcp.save", lambda p: dcp.save(model.state_dict(), checkpoint_id=str(p)),
             lambda _: None)  # fmt: skip
    blocking("dcp.async_save", lambda p: dcp.async_save(model.state_dict(), checkpoint_id=str(p)),
             lambda fut: fut.result())  # fmt: skip
    stager = DcpStager(model)
    blocking("dcp.async_save + DcpStager", lambda p: dcp.async_save(
        model.state_dict(), checkpoint_id=str(p), async_stager=stager),
        lambda r: getattr(r, "upload_completion", r).result())  # fmt: skip
    return got


class _OutOfTime(Exception):
    pass


def _on_alarm(*_: Any) -> None:
    raise _OutOfTime


def _out_of_time(e: BaseException | None) -> bool:
    """Whether ``e`` is the alarm's, or was raised from it."""
    while e is not None:
        if isinstance(e, _OutOfTime):
            return True
        e = e.__cause__ or e.__context__
    return False


def run(b: Bench) -> Outcome:
    """The sections in order of what a short lease most needs: the stall at the smallest
    size, the peers, the cadence, then the larger sizes; under ``--budget-s`` each one's rows
    so far are kept and a section cut or skipped is named in ``cut``."""
    a = b.args
    began = time.perf_counter()
    stall: list[dict[str, Any]] = []  # rows kept as measured, also of a section cut short
    cut: dict[str, str] = {}
    need_cadence = (min(5.0, a.cadence_s / a.rounds) + 2.5 * sum(a.cadences)
                    + a.cadence_s * (1 + 2 * len(a.cadences)))  # fmt: skip
    sizes = sorted(a.gib)
    sections: list[tuple[str, float, Callable[[], Any]]] = [
        (f"stall {sizes[0]:g} GiB", 0.0, functools.partial(_stall, b, sizes[0], stall)),
        ("peers", 0.0, functools.partial(_peers, b)),
        ("cadence", need_cadence, functools.partial(_cadence, b)),
        *[(f"stall {g:g} GiB", 0.0, functools.partial(_stall, b, g, stall)) for g in sizes[1:]],
    ]  # fmt: skip
    found: dict[str, Any] = {}
    for name, need_s, section in sections:
        left = None if a.budget_s is None else a.budget_s - (time.perf_counter() - began)
        if left is not None and left < need_s + 1:
            cut[name] = f"skipped: {left:.0f} s of --budget-s left, about {need_s:.0f} s needed"
        else:
            previous = signal.signal(signal.SIGALRM, _on_alarm)
            signal.alarm(0 if left is None else int(left))
            try:
                found[name] = section()
            except BaseException as e:  # the alarm, maybe wrapped (a save's wait says failed)
                if not _out_of_time(e):
                    raise
                cut[name] = "cut at --budget-s"
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)
        if name in cut:
            b.log(f"{name}: {cut[name]}")
    cadence, blocking = found.get("cadence") or {}, found.get("peers") or {}
    m = {"device": a.device, "stall": stall, "cadence": cadence, "peers": blocking, "cut": cut}
    goals = []
    for i, r in enumerate(stall):
        at, s = f"{r['gib']:g} GiB, {r['fraction']:.0%}", f"stall.{i}"
        if r["fraction"] < 1:
            goals += [Goal(f"delta save() <= 2x the floor at {at}", f"{s}.save_s", "<=",
                           f"{s}.floor_s", 2.0),
                      Goal(f"background copy <= 2x the floor at {at}", f"{s}.background_s", "<=",
                           f"{s}.floor_s", 2.0)]  # fmt: skip
        else:
            goals.append(Goal(f"full save() <= 2 ms + the dense copy at {r['gib']:g} GiB",
                              f"{s}.save_s", "<=", f"{s}.floor_s"))  # fmt: skip
    goals += [Goal(f"throughput lost <= 2x the floor's at {e}", f"cadence.{e}.lost", "<=",
                   f"cadence.{e}.floor_lost", 2.0) for e in cadence]  # fmt: skip
    if "2s" in cadence:
        goals.append(Goal("throughput lost <= 1% at 2 s", "cadence.2s.lost", "<=", 0.01))
    tables = [
        Table.of(f"The stall of a save on {a.device}", stall, {
            "GiB": "gib", "modified": lambda r: f"{r['fraction']:.0%}",
            "save() ms": lambda r: r["save_s"] * 1e3, "floor ms": lambda r: r["floor_s"] * 1e3,
            "ratio": lambda r: r["save_s"] / r["floor_s"],
            "background copy ms": lambda r: "" if r["background_s"] is None
            else r["background_s"] * 1e3}),
        Table.of("Throughput lost to checkpoints at a cadence",
                 [{"every": e, **v} for e, v in cadence.items()], {
            "every": "every", "lost %": lambda r: r["lost"] * 100,
            "floor lost %": lambda r: r["floor_lost"] * 100,
            "no-checkpoint arm's spread over turns %": lambda r: 100 * (
                max(r["plain_rounds"]) - min(r["plain_rounds"])) / r["plain_steps_per_s"],
            "ratio": lambda r: r["lost"] / r["floor_lost"] if r["floor_lost"] > 0 else ""}),
        Table.of("Blocking time of a full save",
                 [{"method": k, "value": v} for k, v in blocking.items()], {
            "method": "method",
            "blocks ms": lambda r: r["value"] * 1e3 if isinstance(r["value"], float)
            else r["value"]}),
    ]  # fmt: skip
    return Outcome(m, tables, goals)


CASE = Case("gpu", "Checkpoints of CUDA tables: stall, cadence and peers", _arguments,
            "--device cpu --gib 0.004 --fractions 0.05 --repeats 1 --cadences 1 --cadence-s 2 "
            "--rounds 1 --batch 64", run)  # fmt: skip

if __name__ == "__main__":
    argv = sys.argv[1:]
    on_cpu = "--smoke" in argv or ("--device" in argv and argv[argv.index("--device") + 1] == "cpu")
    # One GPU: world size 1; gloo beside nccl, as DCP's async_save needs.
    init_distributed("gloo" if on_cpu else "cpu:gloo,cuda:nccl")
    try:
        code = main(CASE, __doc__)
    finally:
        torch.distributed.destroy_process_group()
    sys.exit(code)
