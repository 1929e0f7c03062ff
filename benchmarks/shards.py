"""A checkpoint's metadata against its number of shards, simulated (no training, no tensors)
for ``--ranks`` x ``--tables`` row-wise tables split over every rank: each configuration,
in a process of its own, commits a baseline and a delta (``--fraction`` of each shard's
rows) of a real save's shard records (``tests/data/format_v6``). Seconds, bytes and peak
Python memory of rank 0's commit, a rank's restore planning and a follower's update plan.
Targets: each figure per shard at the largest configuration <= 1.5x the smallest's.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import multiprocessing
import pickle
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.harness import Bench, Case, Outcome, cli
from benchmarks.results import Column, Goal, Table
from torchrec_cnr import schema
from torchrec_cnr.commit import commit as commit_mod
from torchrec_cnr.commit.lease import Lease
from torchrec_cnr.encoding import RankWrite, ShardRecord
from torchrec_cnr.iocontext import IOContext
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.read.chain import ChainReader
from torchrec_cnr.restore import apply
from torchrec_cnr.selection.policy import ChainState, Decision, Policy
from torchrec_cnr.serving.plan import plan_update
from torchrec_cnr.snapshot.index import index_part, parse_index
from torchrec_cnr.staging import StagedCheckpoint
from torchrec_cnr.storage import CountingStorage, Storage, open_storage
from torchrec_cnr.tracking import ShardSpec
from torchrec_cnr.tracking.shard import LocalShard

FIXTURE = Path(__file__).parents[1] / "tests" / "data" / "format_v6" / "consecutive"


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 512, 4096])
    p.add_argument("--tables", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--rows", type=int, default=10_000_000, help="rows of each table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--fraction", type=float, default=0.05, help="rows each delta shard saves")
    p.add_argument("--max-shards", type=int, default=1_100_000,
                   help="configurations with more shards are reported as not run")  # fmt: skip


class _Template:
    """A real save's row-wise delta shard: its record and its index entries, as JSON."""

    def __init__(self) -> None:
        ckpt = sorted(p for p in FIXTURE.iterdir() if p.name[0].isdigit())[-1]
        entry = json.loads((ckpt / "checkpoint.json").read_text())["entry"]
        raw = next(s for s in entry["shards"] if s["spec"]["sharding"] == "row_wise")
        self.key = raw["key"]
        self.record = json.dumps(raw)
        rank = raw["spec"]["rank"]
        entries = parse_index((ckpt / ".snapshot_metadata").read_bytes())
        prefix = schema.rows_path(rank, self.key + ".")
        self.index = {p[len(prefix) :]: e for p, e in entries.items() if p.startswith(prefix)}

    def shard(self, spec: ShardSpec, key: str, saved: int, all_rows: bool) -> ShardRecord:
        raw = json.loads(self.record.replace(f'"{self.key}.', f'"{key}.'))
        raw |= {"key": key, "spec": spec.to_json(), "saved_rows": saved, "all_rows": all_rows,
                "nbytes": saved * spec.cols * 4}  # fmt: skip
        return ShardRecord.from_json(raw)

    def entries(self, rank: int, key: str, saved: int) -> dict[str, Any]:
        out = {}
        for suffix, e in self.index.items():
            e = copy.copy(e)
            e.shape = [saved, *e.shape[1:]]  # type: ignore[union-attr]
            out[schema.rows_path(rank, f"{key}.{suffix}")] = e
        return out


def _spec(a: argparse.Namespace, ranks: int, rank: int, table: int) -> ShardSpec:
    rows = a.rows // ranks
    return ShardSpec(f"model.t{table}", rank, "row_wise", rank * rows, 0, rows, a.dim, rows * ranks,
                     a.dim, f"model.embedding_bags.t{table}.weight")  # fmt: skip


def _rank_write(a: argparse.Namespace, tmpl: _Template, ranks: int, tables: int, rank: int,
                full: bool, storage: Storage, ckpt_id: str) -> RankWrite:  # fmt: skip
    shards: list[ShardRecord] = []
    entries: dict[str, Any] = {}
    for t in range(tables):
        spec = _spec(a, ranks, rank, t)
        saved = spec.rows if full else max(1, int(spec.rows * a.fraction))
        shards.append(tmpl.shard(spec, f"s{t}", saved, full))
        entries |= tmpl.entries(rank, f"s{t}", saved)
    # Each rank serializes its share of the index and writes its part of the shard records
    # itself (ShardWriter.finish).
    data, checksum = schema.part_bytes(ckpt_id, rank, shards)
    storage.write(schema.part_path(ckpt_id, rank), data)
    return RankWrite(shards, {}, 0, 0, 0, 0.0, index_part(entries), checksum)


class _Group:
    """Rank 0 of ``ranks`` simulated ranks: a gather brings the others' pickled reports."""

    rank = 0

    def __init__(self, others: list[bytes]) -> None:
        self.others, self.world_size = others, len(others) + 1

    def agree(self, error: BaseException | None) -> None:
        if error is not None:
            raise error

    def gather_on_rank0(self, obj: Any) -> list[Any]:
        return [obj, *(pickle.loads(b) for b in self.others)]

    def on_rank0(self, fn: Any) -> Any:
        return fn()


class _MadeUp(ChainReader):
    """A chain reader that makes up the ids tensors (the simulation has no tensors)."""

    def saved_ids(self, n: int, rec: ShardRecord) -> torch.Tensor:
        ss = rec.spec
        return torch.arange(ss.row_offset, ss.row_offset + rec.saved_rows)

    def kept(self, entry: Any, rank: int, name: str) -> torch.Tensor:
        return torch.arange(64)  # a shard's changed ids (their values do not matter here)


def _measure(fn: Callable[[], Any], trace: bool, repeat: int = 1) -> float:
    """Seconds ``fn`` takes (the median of ``repeat`` calls), or with ``trace`` the peak MB
    of Python memory it allocates."""
    if not trace:
        seconds = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds)
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def _commit(a: argparse.Namespace, root: Path, ranks: int, tables: int, seq: int,
            chain: list[ChainState], trace: bool = False) -> dict[str, float]:  # fmt: skip
    """Commits checkpoint ``seq`` (0: a baseline) as rank 0, after ``chain[0]``: its figures."""
    tmpl = _Template()
    full = seq == 0
    ckpt_id = schema.checkpoint_id(seq, seq + 1, 1)
    storage = CountingStorage(open_storage(str(root)))
    storage.create()
    writes = [_rank_write(a, tmpl, ranks, tables, r, full, storage, ckpt_id) for r in range(ranks)]
    mine, others = writes[0], [pickle.dumps(w) for w in writes[1:]]
    del writes
    decision = Decision("full" if full else "delta", True)
    staged = StagedCheckpoint(seq + 1, decision.kind, {}, b"", 0)
    resolver = SimpleNamespace(restores=0)
    writer = SimpleNamespace(ckpt_id=ckpt_id, finish=lambda staged: mine)  # its write, made before
    pending = commit_mod.Pending(seq, staged, writer, decision, chain[0], resolver)  # type: ignore[arg-type]
    target = commit_mod.CommitTarget(storage, Policy("consecutive"), 1, None)
    if full:  # the root's writer generation 1
        lease = Lease(storage, take_over=False, fallback=False, ttl_s=60.0)
        assert lease.claim() is None
        lease.stop_thread()
    storage.bytes_written = 0

    def commit() -> None:
        chain[0] = commit_mod.write_and_commit(pending, _Group(others), target)  # type: ignore[arg-type]

    figure = _measure(commit, trace)
    if trace:
        return {"commit_mb": figure}
    return {"commit_s": figure, "commit_b": storage.bytes_written}


def _latest(storage: Storage, io: IOContext) -> _MadeUp:
    """A reader of the chain of the root's latest checkpoint."""
    manifest = Manifest.load(storage)
    entry = manifest.latest()
    assert entry is not None
    return _MadeUp(storage, manifest, entry, io, verify=False, lazy=True)


def _restore_plan(a: argparse.Namespace, root: Path, ranks: int, tables: int, io: IOContext) -> int:
    """One rank's restore planning of the latest checkpoint; the bytes it read."""
    rank = ranks // 2
    shards = [LocalShard(_spec(a, ranks, rank, t), torch.empty(0, a.dim),
                         {"momentum1": torch.empty(0)}, "EXACT_ROWWISE_ADAGRAD", None, None)
              for t in range(tables)]  # fmt: skip
    storage = CountingStorage(open_storage(str(root)))
    chain = _latest(storage, io)
    if apply.own_part_suffices(chain, shards, rank):  # as restore_entry decides
        chain = chain.narrowed(chain.links, only_rank=rank)
    # The ids a restore reads first (its first plan) are made up by saved_ids.
    steps, _ = apply._place(chain, apply._sources(chain, shards))
    assert len(steps) == len(chain.links) * tables, len(steps)
    return storage.bytes_read


def _follower_plan(root: Path, tables: int, io: IOContext) -> None:
    """A follower's plan from the latest checkpoint's baseline to it."""
    chain = _latest(open_storage(str(root)), io)
    served = chain.manifest.record(chain.links[0])
    update = plan_update(chain.manifest, chain, served, served.id)
    assert update is not None and not update.cold and len(update.rows) == tables


def _one(a: argparse.Namespace, ranks: int, tables: int) -> dict[str, float]:
    """One configuration (run in a process of its own)."""
    got: dict[str, float] = {}
    io = IOContext()
    with tempfile.TemporaryDirectory(dir=a.scratch) as tmp:
        root = Path(tmp) / "ckpt"
        chain = [ChainState()]
        _commit(a, root, ranks, tables, 0, chain)
        got |= _commit(a, root, ranks, tables, 1, chain)
        for trace in (False, True):
            unit = "mb" if trace else "s"
            # Plans only read: the median of 3 (one, right after a commit of hundreds of MB,
            # varied with the disk's write-back).
            plan = functools.partial(_restore_plan, a, root, ranks, tables, io)
            got[f"plan_{unit}"] = _measure(plan, trace, 3)
            got[f"follow_{unit}"] = _measure(lambda: _follower_plan(root, tables, io), trace, 3)
        got["plan_b"] = _restore_plan(a, root, ranks, tables, io)
        got |= _commit(a, root, ranks, tables, 2, chain, trace=True)
    io.close()
    return got


def run(b: Bench) -> Outcome:
    a = b.args
    a.scratch = str(b.scratch)
    rows: list[dict[str, Any]] = []
    spawn = multiprocessing.get_context("spawn")
    for tables in a.tables:
        for ranks in a.ranks:
            shards = ranks * tables
            row: dict[str, Any] = {"ranks": ranks, "tables": tables, "shards": shards}
            if shards > a.max_shards:
                b.log(f"{ranks} x {tables}: not run ({shards} shards > --max-shards)")
                rows.append(row)
                continue
            if multiprocessing.current_process().daemon:  # no children (the smoke test)
                got = _one(a, ranks, tables)
            else:
                with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                    got = pool.submit(_one, a, ranks, tables).result()
            row |= got
            # A rank's restore planning per shard of its own; the others per shard of all.
            row |= {f"{k}_per_shard": v / (tables if k.startswith("plan") else shards)
                    for k, v in got.items()}  # fmt: skip
            b.log_row(row)
            rows.append(row)
    measured = [r for r in rows if "commit_s" in r]
    small, large = measured[0], max(measured, key=lambda r: r["shards"])
    by = {f"{r['ranks']}x{r['tables']}": r for r in measured}
    goals = [
        Goal(f"{what} per shard at {large['shards']} shards <= 1.5x at {small['shards']}",
             f"{large['ranks']}x{large['tables']}.{key}_per_shard", "<=",
             f"{small['ranks']}x{small['tables']}.{key}_per_shard", 1.5)
        for key, what in (("commit_s", "commit time"), ("commit_b", "bytes a commit writes"),
                          ("plan_s", "a restore's planning"), ("follow_s", "a follower's planning"))
    ]  # fmt: skip

    def ms(key: str) -> Column:
        return lambda r: 1e3 * r[key] if key in r else "not run"

    def us(key: str) -> Column:
        return lambda r: 1e6 * r[key] if key in r else ""

    def mb(key: str, unit: float) -> Column:
        return lambda r: r[key] / unit if key in r else ""

    columns: dict[str, Column] = {
        "ranks": "ranks", "tables": "tables", "shards": "shards",
        "commit (ms)": ms("commit_s"), "per shard (us)": us("commit_s_per_shard"),
        "commit writes (MB)": mb("commit_b", 1e6), "per shard (B)": mb("commit_b_per_shard", 1),
        "commit peak (MB)": mb("commit_mb", 1),
        "restore planning (ms)": ms("plan_s"), "per own shard (us)": us("plan_s_per_shard"),
        "planning reads (MB)": mb("plan_b", 1e6), "planning peak (MB)": mb("plan_mb", 1),
        "follower planning (ms)": ms("follow_s"), "per shard (us)  ": us("follow_s_per_shard"),
        "follower peak (MB)": mb("follow_mb", 1),
    }  # fmt: skip
    table = Table.of(
        "A checkpoint's metadata against its shards (one process per configuration)", rows, columns,
        note=f"row-wise tables of {a.rows} x {a.dim} split over every rank; a delta of "
        f"{a.fraction:.0%} of each shard's rows; restore planning is one rank's, per shard "
        "of that rank (one a table); the others per shard of the checkpoint",
    )  # fmt: skip
    return Outcome({"rows": rows, **by}, [table], goals)


CASE = Case("shards", "Shards: a commit's and a plan's cost against a checkpoint's shards",
            _arguments, "--ranks 4 16 --tables 3 --rows 1000", run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
