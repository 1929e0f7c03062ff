"""A serving follower against full reloads: bytes read, update time, lag, blocking and
memory of keeping a serving model at the latest committed checkpoint of a training job.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=2 \\
        -m benchmarks.serving --out out/bench/serving.json

The job is the DLRM of 8 table-wise tables x 500,000 rows x dim 64 (1.02 GB of fp32
weights, row-wise Adagrad) on 2 gloo ranks, trained ``--warmup-steps`` steps. For each
policy (consecutive, intermittent) and each pair of checkpoint format and served model
(``--pairs``: fp32 checkpoints served as fp32 and 4-bit adaptive checkpoints served as
INT4; ``fp32:int4``, fp32 checkpoints requantized for INT4, on request), on a fresh root:

1. the job commits a full baseline; the follower starts cold and serves it;
2. for each fraction (1%, 5%, 25%), ``--updates`` times: exactly that share of every
   table's rows (a new random subset each time) is modified (:func:`_touch`), and the job
   commits a checkpoint, at least ``--interval-s`` after the previous commit, and waits
   until the follower serves it;
3. after each fraction's updates, in the serving process: a full reload
   (``export_state_dict(root)`` + ``load_state_dict``, then ``quantize_embeddings`` for
   INT4) and torchsnapshot's ``Snapshot(path).read_object`` of every table tensor of the
   latest full checkpoint (the checkpoint directories are torchsnapshot snapshots).

The follower (:class:`torchrec_cnr.Follower`) runs in its own process, which rank 0
starts with ``multiprocessing`` (spawn) and keeps for the whole run; it polls every
``--poll-s`` on its thread over the file system. Served (a) fp32: ``FloatTarget`` over the
unsharded DLRM; (b) INT4: ``QuantizedTarget`` over ``quantize_embeddings(model,
dtype=torch.quint4x2, inplace=True)``. The job waits for each update before its next
checkpoint, so updates do not compete with training for the cores; the page cache holds
the just-written files for the follower and the peers alike (no cache is dropped).

Per update (the follower's own report): rows and bytes read, seconds from the poll to
applied, seconds serving was blocked (the exclusive side of its lock), lag from commit to
served. Changed bytes: the rows changed since the served step (``list_checkpoints``'
``rows_changed``) x the stored row (fp32 ``4 * dim``; 4-bit the adaptive quantizer's row)
plus its stored id (int32). Memory: the serving process's peak resident set during each
fraction's updates above the one just before them (free heap returned to the system
first), the served model being resident before.

Targets, for every policy and pair: bytes read per update <= 1.2 x the changed bytes
(the worst update); at 5%: update time (median) <= a full reload / 10, lag (worst) <= 1 s,
serving blocked (worst) <= 10 ms; at the largest fraction, the serving process's resident
set grows during updates by at most one table's changed rows (its memory <= the model plus
one table's changed rows).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import logging
import multiprocessing as mp
import multiprocessing.queues
import queue
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.inference.modules import quantize_embeddings
from torchrec.models.dlrm import DLRM
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC
from torchsnapshot import Snapshot

from benchmarks.harness import Bench, Case, Outcome, main
from benchmarks.measure import (
    GB,
    QUANTS,
    Policy,
    from_rank0,
    model_arguments,
    proc_status_mb,
    random_rows,
    reset_peak_rss,
    rmtree,
    timed_save,
    uniform_model,
)
from benchmarks.results import Column, Goal, Table
from cnr_train.workload import ZipfBatches, train_step
from torchrec_cnr import (
    CheckpointConfig,
    CheckpointManager,
    FloatTarget,
    Follower,
    QuantizedTarget,
    export_state_dict,
    list_checkpoints,
    quantize,
)
from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.model_state import local_shards
from torchrec_cnr.tracking.shard import LocalShard

POLICIES: tuple[Policy, ...] = ("consecutive", "intermittent")
PAIRS = ("fp32:fp32", "4-bit:int4", "fp32:int4")
"""Checkpoint format : served model; ``fp32:int4`` (requantized by the follower) is not run
by default, which keeps the full-size run under ten minutes on 2 cores."""
MB = 2**20
"""As ``/proc`` counts memory (:func:`benchmarks.measure.proc_status_mb`); bytes read too."""
# Staging stores ids as int32 below 2**31 rows (torchrec_cnr.staging); our tables are.
ID_BYTES = 4
NUM_DENSE = 4  # build_model's default, which uniform_model builds


def _pct(f: float) -> str:
    return f"{f * 100:g}"


def _run_key(policy: str, pair: str) -> str:
    ckpt, served = pair.split(":")
    return f"{policy}_{ckpt.replace('-', '')}_{served}"


def _row_bytes(quant: str, dim: int) -> int:
    """Bytes of one stored row: fp32 values, or the quantizer's parts for one row."""
    cfg = QUANTS[quant]
    if cfg.method == "none":
        return 4 * dim
    assert isinstance(cfg.bits, int), cfg.bits
    q = quantize(torch.zeros(1, dim), cfg.method, cfg.bits)
    return sum(t.numel() * t.element_size() for t in q.to_tensors().values())


def _touch(shards: list[LocalShard], rows: list[torch.Tensor]) -> None:
    """Marks exactly ``rows`` of each shard modified, as training would: their bits set in
    the tracker's bitmap and in its since-the-last-checkpoint one (``recent``), which the
    checkpoints' ``rows_changed`` and the follower's plans come from, and their weights
    nudged. Unlike :func:`benchmarks.measure.modify`, no bit is cleared: the policy's
    bitmap keeps what earlier intervals set (an intermittent delta holds every row since
    its baseline), and ``recent`` is cleared by each save."""
    with torch.no_grad():
        for s, r in zip(shards, rows):
            s.drain()
            s.weight[r] += 1e-3
            if s.words is not None and s.recent is not None:
                bitmap.set_bits_in_both(s.words, s.recent, r)


def _arguments(p: argparse.ArgumentParser) -> None:
    model_arguments(p, rows=500_000)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.05, 0.25])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--pairs", nargs="+", default=list(PAIRS[:2]), choices=PAIRS)
    p.add_argument("--updates", type=int, default=3, help="checkpoints per fraction")
    p.add_argument("--interval-s", type=float, default=2.0, help="least time between commits")
    p.add_argument("--poll-s", type=float, default=0.25, help="the follower's poll interval")
    p.add_argument("--warmup-steps", type=int, default=2, help="training steps first")


# ---------------------------------------------------------------- the serving process


@dataclass(frozen=True)
class _Spec:
    """What the serving process builds and follows."""

    root: str
    served: str
    """``fp32`` or ``int4``."""
    checkpoint: str
    """The checkpoint format, a key of :data:`QUANTS`."""
    tables: int
    rows: int
    dim: int
    poll_s: float


def _float_model(s: _Spec) -> nn.Module:
    """The job's DLRM unsharded on CPU (as :func:`cnr_train.workload.build_model` builds
    it before sharding), zeroed: every value comes from the checkpoint."""
    configs = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=s.dim, num_embeddings=s.rows, feature_names=[f"f_t{i}"]
        )
        for i in range(s.tables)
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[16, s.dim],
        over_arch_layer_sizes=[16, 1],
        dense_device=torch.device("meta"),
    )
    model.to_empty(device=torch.device("cpu"))
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.zero_()
    return model.eval()


def _int4(model: nn.Module) -> nn.Module:
    return quantize_embeddings(model, dtype=torch.quint4x2, inplace=True)


def _model_bytes(model: nn.Module) -> int:
    """Bytes the served model holds: fp32 tensors, or the INT4 TBEs' rows (padded to 16
    bytes each) plus the dense parameters."""
    quant = [m for m in model.modules() if isinstance(m, QuantEBC)]
    if not quant:
        return sum(t.numel() * t.element_size() for t in model.state_dict().values())
    tbes = [tbe for m in quant for tbe in m._emb_modules]
    host = sum(int(tbe.weights_host.numel()) for tbe in tbes)
    return host + sum(p.numel() * p.element_size() for p in model.parameters())


def _trim() -> None:
    """Returns freed heap memory to the system, so that resident-set figures start clean."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _is_table_tensor(path: str) -> bool:
    """A snapshot path of a shard's rows: ``<rank>/rows/<key>.w`` (fp32) or
    ``<rank>/rows/<key>.w.<part>`` (quantized), not its ids or optimizer state."""
    _, sep, name = path.partition("/rows/")
    return bool(sep) and (name.endswith(".w") or name.rsplit(".", 1)[0].endswith(".w"))


class _Server:
    """The served model and its follower, in the serving process."""

    def __init__(self, spec: _Spec) -> None:
        _trim()
        self.spec = spec
        self.rss0_mb = proc_status_mb("VmRSS")
        model = _float_model(spec)
        self.model = _int4(model) if spec.served == "int4" else model
        self.target = QuantizedTarget(self.model) if spec.served == "int4" else FloatTarget(model)
        self.model_bytes = _model_bytes(self.model)
        self.follower = Follower(spec.root, self.target)
        self.follower.start(spec.poll_s)

    def served(self, step: int, timeout_s: float = 600.0) -> dict[str, Any]:
        """The follower's report of the update that served ``step``, once it did."""
        deadline = time.monotonic() + timeout_s
        while self.follower.step != step:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the follower serves step {self.follower.step}, not {step}, after "
                    f"{timeout_s:.0f} s (last error: {self.follower.last_error!r})"
                )
            time.sleep(0.005)
        report = self.follower.reports[-1]
        assert report.step == step, (report, step)
        return dataclasses.asdict(report)

    def _verify(self, sd: dict[str, torch.Tensor]) -> float:
        """Largest difference of a served table row from what the served model should hold
        at the exported step: the row itself (fp32, and 4-bit rows served as INT4), or our
        adaptive 4-bit quantization of it (fp32 rows served as INT4). 0 when exact."""
        worst = 0.0
        for key, slot in self.target.tables().items():
            want = sd[key]
            if self.spec.served == "int4" and self.spec.checkpoint == "fp32":
                want = quantize(want, "adaptive", 4).dequantize()
            got = self.target.read_rows(key, torch.arange(slot.num_embeddings))
            worst = max(worst, float((got - want).abs().max()))
        return worst

    def peers(self, full_id: str, verify: bool) -> dict[str, Any]:
        """A full reload and torchsnapshot's read of the latest full checkpoint, the
        follower stopped meanwhile; with ``verify``, the served rows checked first."""
        self.follower.stop()
        try:
            out: dict[str, Any] = {}
            if verify:
                out["served_max_abs_err"] = self._verify(export_state_dict(self.spec.root))
            _trim()
            shell = _float_model(self.spec) if self.spec.served == "int4" else None
            began = time.perf_counter()
            sd = export_state_dict(self.spec.root)
            if shell is None:
                self.model.load_state_dict(sd)
            else:
                shell.load_state_dict(sd)
                _int4(shell)
            out["reload_s"] = time.perf_counter() - began
            out["reload_model_bytes"] = sum(t.numel() * t.element_size() for t in sd.values())
            del sd, shell
            _trim()
            snapshot = Snapshot(str(Path(self.spec.root) / full_id))
            paths = [p for p in snapshot.get_manifest() if _is_table_tensor(p)]
            began = time.perf_counter()
            nbytes = 0
            for path in paths:
                t: torch.Tensor = snapshot.read_object(path)
                nbytes += t.numel() * t.element_size()
                del t
            out["torchsnapshot_read_s"] = time.perf_counter() - began
            out["torchsnapshot_bytes"] = nbytes
            out["torchsnapshot_tensors"] = len(paths)
            _trim()
            return out
        finally:
            self.follower.start(self.spec.poll_s)

    def close(self) -> None:
        self.follower.close()


def _serve(
    inbox: multiprocessing.queues.Queue[Any], outbox: multiprocessing.queues.Queue[Any]
) -> None:
    """The serving process: runs the commands rank 0 sends, one at a time, and answers
    each with ``("ok", value)`` or ``("error", traceback)``."""
    # read_object without obj_out warns once per tensor that it returns a new one: it should.
    logging.getLogger("torchsnapshot.snapshot").setLevel(logging.ERROR)
    # Every object so far is the libraries': out of the collector's sight, a collection
    # (to free a model between roots) takes milliseconds, not half a second.
    gc.freeze()
    server: _Server | None = None
    try:
        while True:
            cmd, arg = inbox.get()
            try:
                value: Any = None
                if cmd == "open":
                    server = _Server(arg)
                    value = {
                        "rss0_mb": server.rss0_mb,
                        "rss_model_mb": proc_status_mb("VmRSS"),
                        "model_bytes": server.model_bytes,
                    }
                elif cmd == "served":
                    assert server is not None
                    value = server.served(arg)
                elif cmd == "reset_peak":
                    _trim()  # the cold start's freed buffers must not absorb the updates'
                    value = reset_peak_rss()
                elif cmd == "peak":
                    value = proc_status_mb("VmHWM")
                elif cmd == "peers":
                    assert server is not None
                    value = server.peers(*arg)
                elif cmd == "close":
                    if server is not None:
                        server.close()
                    server = None
                    _trim()
                elif cmd == "exit":
                    outbox.put(("ok", None))
                    return
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                outbox.put(("ok", value))
            except Exception:
                outbox.put(("error", traceback.format_exc()))
    finally:
        if server is not None:
            server.close()


class _Serving:
    """Rank 0's handle on the serving process."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.inbox: multiprocessing.queues.Queue[Any] = ctx.Queue()
        self.outbox: multiprocessing.queues.Queue[Any] = ctx.Queue()
        self.proc = ctx.Process(target=_serve, args=(self.inbox, self.outbox), daemon=True)
        self.proc.start()
        self._lock = threading.Lock()

    def ask(self, cmd: str, arg: Any = None, timeout_s: float = 900.0) -> Any:
        """Runs ``cmd`` in the serving process and returns its value.

        Raises:
            RuntimeError: the command failed there (its traceback), or the process died.
        """
        with self._lock:
            self.inbox.put((cmd, arg))
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    status, value = self.outbox.get(timeout=1.0)
                    break
                except queue.Empty:
                    if not self.proc.is_alive():
                        raise RuntimeError(
                            f"the serving process died (exit {self.proc.exitcode}) on {cmd!r}"
                        ) from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no answer to {cmd!r} in {timeout_s:.0f} s") from None
        if status != "ok":
            raise RuntimeError(f"serving process, {cmd!r}:\n{value}")
        return value

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):
            if self.proc.is_alive():
                self.ask("exit", timeout_s=60)
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# ---------------------------------------------------------------- the job


def _one_root(
    b: Bench,
    model: Any,
    shards: list[LocalShard],
    serving: _Serving | None,
    policy: Policy,
    pair: str,
) -> dict[str, Any]:
    """One root followed from a cold start through every fraction's updates."""
    a = b.args
    ckpt_fmt, served = pair.split(":")
    root = b.scratch / _run_key(policy, pair)
    cfg = CheckpointConfig(path=str(root), policy=policy, on_busy="wait", quantize=QUANTS[ckpt_fmt])
    spec = _Spec(str(root), served, ckpt_fmt, a.tables, a.rows, a.dim, a.poll_s)
    row_bytes = _row_bytes(ckpt_fmt, a.dim)
    phases: dict[str, Any] = {}
    with CheckpointManager(model, cfg) as ckpt:
        _, base_commit = timed_save(ckpt, 1)
        opened = serving.ask("open", spec) if serving else {}
        cold = serving.ask("served", 1) if serving else {}
        b.log(f"{_run_key(policy, pair)}: cold start {cold.get('seconds', 0):.2f} s")
        step = 1
        last_commit = time.monotonic()
        for frac in a.fractions:
            rss_before = serving.ask("reset_peak") if serving else 0.0
            updates = []
            for _ in range(a.updates):
                if serving is not None:
                    time.sleep(max(0.0, last_commit + a.interval_s - time.monotonic()))
                step += 1
                _touch(shards, random_rows(shards, [frac], seed=step)[frac])
                _, commit = timed_save(ckpt, step)
                last_commit = time.monotonic()
                if serving is not None:
                    updates.append({**serving.ask("served", step), "commit_s": commit})
            peak = serving.ask("peak") if serving else 0.0
            full_id = from_rank0(
                lambda: [i.id for i in list_checkpoints(str(root)) if i.kind == "full"][-1]
            )
            last = frac == a.fractions[-1]
            peers = serving.ask("peers", (full_id, last)) if serving else {}
            phases[_pct(frac)] = {
                "fraction": frac,
                "updates": updates,
                "rss_before_mb": rss_before,
                "peak_rss_mb": peak,
                **peers,
            }
            b.log(f"{_run_key(policy, pair)} {frac:.0%}: " + _brief(updates, peers))
        if serving is not None:
            serving.ask("close")
    infos = from_rank0(lambda: list_checkpoints(str(root)))
    rmtree(root)
    return _summarise(policy, pair, phases, infos, row_bytes, a.tables, opened, cold, base_commit)


def _brief(updates: list[dict[str, Any]], peers: dict[str, Any]) -> str:
    if not updates:
        return ""
    med = statistics.median(u["seconds"] for u in updates)
    return (
        f"update {med:.3f} s, lag max {max(u['lag_s'] for u in updates):.3f} s, "
        f"blocked max {max(u['blocked_s'] for u in updates) * 1e3:.1f} ms, "
        f"reload {peers.get('reload_s', 0):.2f} s, "
        f"torchsnapshot read {peers.get('torchsnapshot_read_s', 0):.2f} s"
    )


def _summarise(
    policy: str,
    pair: str,
    phases: dict[str, Any],
    infos: list[Any],
    row_bytes: int,
    tables: int,
    opened: dict[str, Any],
    cold: dict[str, Any],
    base_commit: float,
) -> dict[str, Any]:
    """Each update's changed rows and bytes (since the step served before it) and its
    bytes read over them; each fraction's medians, worst cases and memory."""
    ckpt_fmt, served = pair.split(":")
    changed = {i.step: i.rows_changed for i in infos}
    per_row = row_bytes + ID_BYTES
    served_step = 1
    worst: dict[str, Any] = {}
    for ph in phases.values():
        for u in ph["updates"]:
            rows = sum(changed[s] or 0 for s in changed if served_step < s <= u["step"])
            u["changed_rows"] = rows
            u["changed_bytes"] = rows * per_row
            u["bytes_over_changed"] = u["bytes_read"] / max(1, u["changed_bytes"])
            served_step = u["step"]
            if not worst or u["bytes_over_changed"] > worst["bytes_over_changed"]:
                worst = {**u, "fraction": ph["fraction"]}
        ups = ph["updates"]
        if not ups:
            continue
        one_table = max(u["changed_rows"] for u in ups) / tables * per_row
        ph.update(
            update_s=statistics.median(u["seconds"] for u in ups),
            lag_s_max=max(u["lag_s"] for u in ups),
            lag_s_median=statistics.median(u["lag_s"] for u in ups),
            blocked_s_max=max(u["blocked_s"] for u in ups),
            bytes_read=statistics.median(u["bytes_read"] for u in ups),
            changed_bytes=statistics.median(u["changed_bytes"] for u in ups),
            bytes_over_changed_max=max(u["bytes_over_changed"] for u in ups),
            one_table_changed_mb=one_table / MB,
            resident_mb=ph["rss_before_mb"] - opened["rss0_mb"],
            growth_mb=ph["peak_rss_mb"] - ph["rss_before_mb"],
            update_over_reload=statistics.median(u["seconds"] for u in ups) / ph["reload_s"],
        )
    return {
        "policy": policy,
        "checkpoint": ckpt_fmt,
        "served": served,
        "row_bytes": row_bytes,
        "id_bytes": ID_BYTES,
        "baseline_commit_s": base_commit,
        "model_mb": opened.get("model_bytes", 0) / MB,
        "rss0_mb": opened.get("rss0_mb"),
        "rss_model_mb": opened.get("rss_model_mb"),
        "cold": {k: cold.get(k) for k in ("rows", "bytes_read", "seconds", "cold")},
        "checkpoints": [
            {"step": i.step, "kind": i.kind, "rows_changed": i.rows_changed, "bytes": i.bytes}
            for i in infos
        ],
        "worst_bytes": worst,
        "phases": phases,
    }


# ---------------------------------------------------------------- targets and tables


def targets(policies: list[Policy], pairs: list[str], fractions: list[float]) -> list[Goal]:
    """Every policy and pair: bytes per update; at 5%: update time, lag and blocking; at
    the largest fraction: the serving process's memory."""
    five = "5" if 0.05 in fractions else _pct(sorted(fractions)[len(fractions) // 2])
    big = _pct(max(fractions))
    out: list[Goal] = []
    for p in policies:
        for pair in pairs:
            r = f"runs.{_run_key(p, pair)}"
            name = f"{p} {pair.replace(':', ' ckpt -> ')}"
            out += [
                Goal(f"{name}: bytes read per update <= 1.2 x changed rows + ids (worst)",
                       f"{r}.worst_bytes.bytes_read", "<=", f"{r}.worst_bytes.changed_bytes", 1.2),
                Goal(f"{name}: update at {five}% <= full reload / 10 (median)",
                       f"{r}.phases.{five}.update_s", "<=", f"{r}.phases.{five}.reload_s", 0.1),
                Goal(f"{name}: lag commit -> served at {five}% <= 1 s (worst)",
                       f"{r}.phases.{five}.lag_s_max", "<=", 1.0),
                Goal(f"{name}: serving blocked per update at {five}% <= 10 ms (worst)",
                       f"{r}.phases.{five}.blocked_s_max", "<=", 0.010),
                Goal(f"{name}: serving RSS growth during updates at {big}% <= one table's "
                       "changed rows, MB (the model resident before)",
                       f"{r}.phases.{big}.growth_mb", "<=", f"{r}.phases.{big}.one_table_changed_mb"),
            ]  # fmt: skip
    return out


def tables(m: dict[str, Any]) -> list[Table]:
    rows = []
    for r in m["runs"].values():
        for key, ph in r["phases"].items():
            if "update_s" not in ph:
                continue
            rows.append({"run": r, "ph": ph, "pct": key})
    which: dict[str, Column] = {
        "policy": lambda x: x["run"]["policy"],
        "checkpoint -> served": lambda x: f"{x['run']['checkpoint']} -> {x['run']['served']}",
        "changed": lambda x: f"{x['pct']}%",
    }
    per_update = Table.of(
        "Per update (median of the updates at each fraction; worst lag and blocking)",
        rows,
        {
            **which,
            "read MB": lambda x: x["ph"]["bytes_read"] / MB,
            "changed MB": lambda x: x["ph"]["changed_bytes"] / MB,
            "read / changed (worst)": lambda x: x["ph"]["bytes_over_changed_max"],
            "update s": lambda x: x["ph"]["update_s"],
            "lag s (worst)": lambda x: x["ph"]["lag_s_max"],
            "blocked ms (worst)": lambda x: x["ph"]["blocked_s_max"] * 1e3,
            "full reload s": lambda x: x["ph"]["reload_s"],
            "torchsnapshot read s": lambda x: x["ph"]["torchsnapshot_read_s"],
        },
        "Update: the follower's poll to applied. Full reload: export_state_dict + "
        "load_state_dict (+ quantize_embeddings for INT4). torchsnapshot read: every table "
        "tensor of the latest full checkpoint (not the latest step).",
    )
    memory = Table.of(
        "Serving process memory (MB)",
        rows,
        {
            **which,
            "served model": lambda x: x["run"]["model_mb"],
            "resident before updates": lambda x: x["ph"]["resident_mb"],
            "one table's changed rows": lambda x: x["ph"]["one_table_changed_mb"],
            "peak growth during updates": lambda x: x["ph"]["growth_mb"],
        },
        "Resident before updates: the serving process's resident set before this fraction's "
        "updates (freed heap returned first) above the one before the served model was built: "
        "the model, library pages touched since and retained allocations. Peak growth: its "
        "peak during the updates above that. Changed rows in the stored format, with ids.",
    )
    cold = Table.of(
        "Cold start and correctness",
        m["runs"].values(),
        {
            "policy": "policy",
            "checkpoint -> served": lambda r: f"{r['checkpoint']} -> {r['served']}",
            "cold start s": lambda r: r["cold"]["seconds"],
            "cold read GB": lambda r: r["cold"]["bytes_read"] / GB,
            "served max abs err vs export": lambda r: next(
                (
                    ph["served_max_abs_err"]
                    for ph in r["phases"].values()
                    if "served_max_abs_err" in ph
                ),
                None,
            ),
        },
        "Error: the served tables after the last update against export_state_dict of that "
        "step (fp32 -> INT4: against our adaptive 4-bit quantization of it); 0 is exact.",
    )
    return [per_update, memory, cold]


def run(b: Bench) -> Outcome:
    a = b.args
    # Started first: it imports its libraries while the job builds and trains its model.
    serving = _Serving() if b.rank == 0 else None
    try:
        model, opt, specs = uniform_model(a)
        data = ZipfBatches(specs, 512, seed=0)
        for step in range(1, a.warmup_steps + 1):
            train_step(model, opt, data.batch(b.rank, step))
        shards = local_shards(model)
        runs = {
            _run_key(p, pair): _one_root(b, model, shards, serving, p, pair)
            for p in a.policies
            for pair in a.pairs
        }
    finally:
        if serving is not None:
            serving.close()
    m = {
        "model": {
            "tables": a.tables,
            "rows": a.rows,
            "dim": a.dim,
            "fp32_gb": a.tables * a.rows * a.dim * 4 / GB,
        },
        "poll_s": a.poll_s,
        "interval_s": a.interval_s,
        "runs": runs,
    }
    return Outcome(m, tables(m) if b.rank == 0 else [], targets(a.policies, a.pairs, a.fractions))


CASE = Case(
    name="serving",
    title="A serving follower against full reloads: bytes, update time, lag, blocking, memory",
    arguments=_arguments,
    smoke="--tables 2 --rows 2000 --dim 16 --updates 1 --interval-s 0 --poll-s 0.05 "
    "--warmup-steps 1",
    run=run,
)

if __name__ == "__main__":
    sys.exit(main(CASE, __doc__))
