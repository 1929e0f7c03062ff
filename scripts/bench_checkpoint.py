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

Side by side (``--rounds`` interleaved rounds, medians; the disk of a shared VM drifts, so
the figures a target compares are taken in turns, each from a settled disk: previous
output deleted, ``os.sync()``, rotating order): the durable commit of a full checkpoint by
torchsnapshot ``take`` + fsync, torchrec_cnr fp32 and torchrec_cnr 4-bit adaptive (each on
a fresh root); then cold restores of torchsnapshot's full snapshot, of intermittent chains
(baseline + one delta) at each fraction and of a consecutive chain of 4.

Targets (PASS/MISS): intermittent fp32 stall <= async_take stall / 10 at 5% and / 3 at
25%; every delta stall <= 2 x the memcpy of its staged bytes; a manager's first full
stall <= 2 x its later ones; side by side: full fp32 commit <= torchsnapshot take +
fsync and >= 70% of the disk's write bandwidth, 4-bit commit <= fp32 commit, intermittent
restores <= torchsnapshot's full restore, the consecutive chain of 4 <= 1.5 x it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchsnapshot import Snapshot

from cnr_train.bench.common import (
    GB,
    bcast,
    disk_bandwidth,
    fsync_tree,
    log,
    max_over_ranks,
    memcpy_s,
    modify,
    rmtree,
    scratch_dir,
    timed,
    timed_restores,
)
from cnr_train.bench.peers import run_peers
from cnr_train.workload import TableSpec, ZipfBatches, build_model, dense_optimizer, train_step
from torchrec_cnr import CheckpointConfig, CheckpointManager, QuantizeConfig
from torchrec_cnr.commit import Entry, Manifest
from torchrec_cnr.selection import POLICIES
from torchrec_cnr.selection.policy import PolicyName
from torchrec_cnr.staging import serialize_app_state
from torchrec_cnr.tracking import model_state
from torchrec_cnr.tracking.shard import LocalShard

COMMAND = (
    "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/bench_checkpoint.py "
    "--json out/bench_checkpoint.json"
)
ASYNC = "torchsnapshot async_take (copy fix)"
QUANTS = {"fp32": QuantizeConfig(), "4-bit": QuantizeConfig(method="adaptive", bits=4)}


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


def _save(ckpt: CheckpointManager, root: Path, step: int) -> tuple[float, float, Entry | None]:
    """stall (inside save) and commit (until wait returns) of one checkpoint, and its manifest entry."""
    dist.barrier()
    t0 = time.perf_counter()
    ckpt.save(step)
    t1 = time.perf_counter()
    ckpt.wait()
    t2 = time.perf_counter()
    entry = Manifest.load(root).latest() if dist.get_rank() == 0 else None
    return max_over_ranks(t1 - t0), max_over_ranks(t2 - t0), bcast(entry)


def _cnr(
    model: torch.nn.Module,
    bench: Path,
    shards: list[LocalShard],
    policy: PolicyName,
    quant: str,
    frac: float,
    sel: list[torch.Tensor],
    check_sel: list[torch.Tensor],
    step_bytes: dict[str, int],
    repeats: int,
    restore_repeats: int,
) -> dict[str, Any]:
    rank = dist.get_rank()
    root = bench / f"cnr_{policy}_{quant}_{round(frac * 100)}"
    rmtree(root)
    cfg = CheckpointConfig(path=str(root), policy=policy, on_busy="wait", quantize=QUANTS[quant])
    ckpt = CheckpointManager(model, cfg)

    b_stall, b_commit, base = _save(ckpt, root, 1)
    assert base is not None and base.kind == "full"
    saves: list[dict[str, Any]] = []
    for rep in range(repeats):
        modify(shards, sel)
        stall, commit, entry = _save(ckpt, root, 2 + rep)
        assert entry is not None
        saves.append(
            {
                "stall_s": stall,
                "commit_s": commit,
                "kind": entry.kind,
                "bytes": entry.bytes,
                "staged_bytes_rank0": entry.staged_bytes,
                "chain_len": len(entry.chain),
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
    memcpy = memcpy_s(local_staged)

    restorer = CheckpointManager(model, cfg)
    restore_s, err = timed_restores(root, shards, check_sel, restorer.restore, restore_repeats)
    restorer.close()
    del restorer
    gc.collect()
    rmtree(root)
    row = {
        "method": f"torchrec_cnr {policy} {quant}",
        "policy": policy,
        "quant": quant,
        "fraction": frac,
        "stall_s": statistics.median(s["stall_s"] for s in saves),
        "commit_s": statistics.median(s["commit_s"] for s in saves),
        "bytes": statistics.median(s["bytes"] for s in saves),
        "staged_bytes_rank0": saves[-1]["staged_bytes_rank0"],
        "staged_bytes_local_max": max_over_ranks(local_staged),
        "memcpy_s": memcpy,
        "restore_s": restore_s,
        "restore_chain_len": saves[-1]["chain_len"],
        "restore_max_abs_err": err,
        "baseline": {"stall_s": b_stall, "commit_s": b_commit, "bytes": base.bytes},
        "saves": saves,
    }
    log(
        f"{row['method']} {frac:.0%}: stall {row['stall_s']:.3f}s (memcpy {memcpy:.4f}s), "
        f"commit {row['commit_s']:.2f}s, {row['bytes'] / GB:.3f} GB ({saves[-1]['kind']}), "
        f"restore {restore_s:.2f}s of {row['restore_chain_len']} (err {err:.2g}); "
        f"baseline stall {b_stall:.2f}s commit {b_commit:.2f}s"
    )
    if quant == "fp32" and err != 0.0 and rank == 0:
        print(f"WARNING: fp32 restore of {row['method']} is not exact: {err}", file=sys.stderr)
    return row


def _ts_take(model: torch.nn.Module, path: Path) -> float:
    """torchsnapshot ``take`` plus the fsync of its tree it leaves out: its durable commit."""

    def take() -> None:
        Snapshot.take(str(path), app_state={"model": model}, replicated=["**"])
        if dist.get_rank() == 0:
            fsync_tree(path)

    return timed(take)[0]


def _side_by_side(
    model: torch.nn.Module,
    bench: Path,
    shards: list[LocalShard],
    sels: dict[float, list[torch.Tensor]],
    check_sel: list[torch.Tensor],
    rounds: int,
) -> dict[str, Any]:
    """The figures the targets compare, interleaved round by round so that a drift
    of the disk hits every method alike: durable full commits (torchsnapshot
    ``take`` + fsync, torchrec_cnr fp32 and 4-bit), then cold restores
    (torchsnapshot's full snapshot, intermittent chains at each fraction, a
    consecutive chain of 4)."""
    fracs = sorted(sels)
    ts_path = bench / "sbs_ts"
    commits: dict[str, list[float]] = {"torchsnapshot": [], **{q: [] for q in QUANTS}}
    full_bytes = 0

    def cnr_full(quant: str) -> float:
        nonlocal full_bytes
        root = bench / f"sbs_full_{quant}"
        with CheckpointManager(
            model, CheckpointConfig(path=str(root), policy="full", quantize=QUANTS[quant])
        ) as ckpt:
            _, commit, entry = _save(ckpt, root, 1)
        if quant == "fp32" and entry is not None:
            full_bytes = entry.bytes
        return commit

    for r in range(rounds):
        # Each method starts from a settled disk: the previous output deleted and every
        # dirty page and pending discard flushed; the order rotates every round.
        methods = list(commits)
        for name in methods[r % len(methods) :] + methods[: r % len(methods)]:
            rmtree(ts_path if name == "torchsnapshot" else bench / f"sbs_full_{name}")
            if dist.get_rank() == 0:
                os.sync()
            commits[name].append(
                _ts_take(model, ts_path) if name == "torchsnapshot" else cnr_full(name)
            )
            gc.collect()
        log(
            f"side by side, round {r + 1}/{rounds}: durable full commit "
            + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in commits.items())
        )
    for q in QUANTS:
        rmtree(bench / f"sbs_full_{q}")
    _ts_take(model, ts_path)  # the snapshot the restores read

    # Chains to restore: intermittent at each fraction (baseline + one delta), and a
    # consecutive chain of 4 (baseline + three deltas) at the smallest fraction.
    chains: dict[str, CheckpointConfig] = {}
    plan: list[tuple[str, PolicyName, float, int]] = [
        *((f"intermittent {f:.0%}", "intermittent", f, 1) for f in fracs),
        (f"consecutive {fracs[0]:.0%} chain of 4", "consecutive", fracs[0], 3),
    ]
    for name, policy, frac, deltas in plan:
        cfg = CheckpointConfig(path=str(bench / f"sbs_{policy}_{frac}"), policy=policy)
        with CheckpointManager(model, cfg) as ckpt:
            for step in range(1, deltas + 2):
                if step > 1:
                    modify(shards, sels[frac])
                _save(ckpt, Path(cfg.path), step)
        chains[name] = cfg
        gc.collect()
    restores: dict[str, list[float]] = {"torchsnapshot": [], **{k: [] for k in chains}}
    errs: dict[str, float] = {}

    def ts_restore() -> None:
        Snapshot(str(ts_path)).restore(app_state={"model": model})

    for r in range(rounds):
        t, errs["torchsnapshot"] = timed_restores(ts_path, shards, check_sel, ts_restore, 1)
        restores["torchsnapshot"].append(t)
        for name, cfg in chains.items():
            with CheckpointManager(model, cfg) as restorer:
                t, errs[name] = timed_restores(
                    Path(cfg.path), shards, check_sel, restorer.restore, 1
                )
            restores[name].append(t)
            gc.collect()
        log(
            f"side by side, round {r + 1}/{rounds}: cold restore "
            + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in restores.items())
        )
    rmtree(ts_path)
    for cfg in chains.values():
        rmtree(Path(cfg.path))
    med = statistics.median
    return {
        "rounds": rounds,
        "full_bytes": full_bytes,
        "commit_s": {k: med(v) for k, v in commits.items()},
        "commits": commits,
        "restore_s": {k: med(v) for k, v in restores.items()},
        "restores": restores,
        "restore_max_abs_err": errs,
    }


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
    have = {(r["policy"], r["quant"]) for r in cnr}
    if len(fracs) == 2 and ("intermittent", "fp32") in have and "error" not in peer[ASYNC]:
        async_stall = peer[ASYNC]["stall_s"]
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
                f"  (info: vs async_take as shipped {shipped['stall_s']:.3f}s, "
                f"{shipped['stall_s'] / s:.1f}x; its snapshot is "
                f"{'consistent' if shipped['consistent'] else 'torn: it copies nothing'})"
            )
    for r in cnr:
        if r["policy"] != "full" and r["quant"] == "fp32":
            line(
                f"stall_{r['policy']}_fp32_{r['fraction']:.0%}_vs_memcpy",
                r["stall_s"],
                2 * r["memcpy_s"],
                r["stall_s"] <= 2 * r["memcpy_s"],
                f"stall {r['policy']} fp32 {r['fraction']:.0%} {r['stall_s']:.4f}s vs 2 x memcpy of "
                f"its {r['staged_bytes_local_max'] / 1e6:.0f} MB staged per rank "
                f"({r['memcpy_s']:.4f}s) = {2 * r['memcpy_s']:.4f}s ({r['stall_s'] / r['memcpy_s']:.2f}x)",
            )

    sbs = results["side_by_side"]
    commit, restore = sbs["commit_s"], sbs["restore_s"]
    print(
        f"\nside by side, median of {sbs['rounds']} interleaved rounds "
        f"(restores cold, checksums verified):"
    )
    disk_bw = disk["write_gb_s"]
    tput = sbs["full_bytes"] / commit["fp32"] / GB
    line(
        "commit_full_fp32_vs_torchsnapshot_take_fsync",
        commit["fp32"],
        commit["torchsnapshot"],
        commit["fp32"] <= commit["torchsnapshot"],
        f"durable commit, full fp32: torchrec_cnr {commit['fp32']:.2f}s vs torchsnapshot take + "
        f"fsync {commit['torchsnapshot']:.2f}s ({commit['torchsnapshot'] / commit['fp32']:.2f}x)",
    )
    line(
        "commit_full_fp32_vs_disk",
        tput,
        0.7 * disk_bw,
        tput >= 0.7 * disk_bw,
        f"commit throughput full fp32 {tput:.3f} GB/s vs 70% of the disk's write "
        f"{disk_bw:.3f} GB/s = {0.7 * disk_bw:.3f} GB/s ({tput / disk_bw:.0%} of disk)",
    )
    line(
        "commit_full_4bit_vs_fp32",
        commit["4-bit"],
        commit["fp32"],
        commit["4-bit"] <= commit["fp32"],
        f"durable commit, full: 4-bit adaptive {commit['4-bit']:.2f}s vs fp32 {commit['fp32']:.2f}s",
    )
    for frac in fracs if ("full", "fp32") in have else []:
        r = by[("full", "fp32", frac)]
        first, later = r["baseline"]["stall_s"], r["stall_s"]
        line(
            f"stall_first_full_vs_later_{frac:.0%}_run",
            first,
            2 * later,
            first <= 2 * later,
            f"stall of a manager's first full save {first:.3f}s vs 2 x its later ones "
            f"{later:.3f}s = {2 * later:.3f}s (full fp32, {frac:.0%} run)",
        )
    ts = restore["torchsnapshot"]
    for name, took in restore.items():
        if name == "torchsnapshot":
            continue
        bound = 1.5 if name.startswith("consecutive") else 1.0
        line(
            f"restore_{name.replace(' ', '_')}_vs_torchsnapshot",
            took,
            bound * ts,
            took <= bound * ts,
            f"restore {name}: {took:.2f}s vs {bound:g} x torchsnapshot full restore {ts:.2f}s "
            f"= {bound * ts:.2f}s ({took / ts:.2f}x)",
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
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of the side-by-side targets"
    )
    p.add_argument("--warmup-steps", type=int, default=2, help="training steps before measuring")
    p.add_argument("--disk-gb", type=float, default=2.0, help="size of the disk bandwidth test")
    p.add_argument("--disk-passes", type=int, default=2, help="disk test passes, best kept")
    p.add_argument(
        "--root", type=Path, default=None, help="scratch directory (default: a temp dir)"
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    dist.init_process_group("gloo")
    began = time.perf_counter()
    scratch = None
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.root is None:
            scratch = args.root = scratch_dir("bench_checkpoint_")
        bench = args.root
        if rank == 0:
            bench.mkdir(parents=True, exist_ok=True)
        dist.barrier()

        chunk = 64 << 20
        nbytes = max(chunk, int(args.disk_gb * GB) // chunk * chunk)
        disk = disk_bandwidth(bench, nbytes, chunk, args.disk_passes)
        log(
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
        emb_bytes = max_over_ranks(sum(s.weight.numel() * s.weight.element_size() for s in shards))
        total_emb = args.tables * args.rows * args.dim * 4
        model_desc = (
            f"{args.tables} tables x {args.rows} rows x dim {args.dim} = {total_emb / GB:.2f} GB fp32 "
            f"on {world} ranks (table_wise, largest rank {emb_bytes / GB:.2f} GB)"
        )
        log(f"model built: {model_desc}")

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
        memcpy_full = {"bytes": int(max_over_ranks(full_bytes)), "s": memcpy_s(full_bytes)}
        log(
            f"memcpy of {full_bytes / GB:.2f} GB per rank: {memcpy_full['s']:.3f}s "
            f"({full_bytes / memcpy_full['s'] / GB:.2f} GB/s)"
        )

        side_by_side = _side_by_side(model, bench, shards, sels, check_sel, args.rounds)
        peers = run_peers(model, bench, shards, check_sel, args.restore_repeats)
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
                            args.restore_repeats,
                        )
                    )
        wall = time.perf_counter() - began
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
            "side_by_side": side_by_side,
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
