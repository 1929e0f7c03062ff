"""Training stall, commit time, bytes written and restore time of one checkpoint of a
sharded model (``--tables`` x ``--rows`` x ``--dim``, row-wise Adagrad): torchrec_cnr's
policies, fp32 and 4-bit, against torchsnapshot and DCP (:mod:`benchmarks.peers`), beside
the disk's bandwidth, a memcpy and the quantizer's rate.

- Per policy x format x share of rows modified: a baseline, ``--repeats`` saves,
  ``--restore-repeats`` cold restores (checked) and the peak memory.
- Side by side, in ``--rounds`` interleaved rounds: durable full commits (torchsnapshot's
  ``take`` + fsync; ours per bit width, ``O_DIRECT`` or not) and cold restores.

Targets (:func:`targets`): stalls against ``async_take``'s and a memcpy; commits against
torchsnapshot's and the disk; quantized against fp32; restores against torchsnapshot's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks import measure
from benchmarks.harness import Bench, Case, Outcome, cli
from benchmarks.measure import Rows
from benchmarks.peers import run_peers, torchsnapshot_restore, torchsnapshot_take_durable
from benchmarks.results import Column, Goal, Table
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.config import QuantizeConfig
from torchrec_cnr.encoding.writer import ENCODE_BYTES
from torchrec_cnr.offline import checkpoint_info, list_checkpoints
from torchrec_cnr.quantization import quantize
from torchrec_cnr.storage.fs import FsStorage
from torchrec_cnr.testing.rows import modify
from torchrec_cnr.tracking.model_state import local_shards
from torchrec_cnr.tracking.shard import LocalShard


def _key(policy: str, quant: str, frac: float) -> str:
    return f"{policy}_{quant.replace('-', '')}_{frac:.0%}".rstrip("%")


FORMATS = {**measure.QUANTS, **{f"{b}-bit": QuantizeConfig(method="adaptive", bits=b, min_rows=0)
                                 for b in (2, 3, 8)}}  # fmt: skip
"""The formats of the side-by-side full commits: the grid's two and other bit widths."""

RESTORE_BUDGET = 1 / 8
"""The budgeted restore arm's ``staging_memory_mb``, as a share of the rows a rank holds."""


def _peak(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and the most resident memory it added, MB, the largest rank's."""
    watched = measure.Peak(fn)
    return watched(), watched.over_ranks()


def encode_rates(shards: list[LocalShard]) -> dict[str, float]:
    """GB/s of fp32 rows one thread quantizes, per format: 32 MB of this rank's first shard
    encoded as a commit encodes a piece, best of 3, all ranks at once; the slowest rank's."""
    w = shards[0].weight.detach()
    rows = w[: ENCODE_BYTES // (4 * w.shape[1])].contiguous()
    rates = {}
    for name, q in FORMATS.items():
        if name != "fp32":
            dist.barrier()
            encode = functools.partial(quantize, rows, q.method, int(q.bits))
            best = min(measure.timed(encode)[0] for _ in range(3))  # the slowest rank's
            rates[name] = rows.numel() * 4 / best / measure.GB
    return rates


def _arguments(p: argparse.ArgumentParser) -> None:
    measure.model_arguments(p, rows=1_000_000)
    p.add_argument("--fractions", type=float, nargs=2, default=[0.05, 0.25])
    p.add_argument("--policies", nargs="+", default=list(measure.POLICIES), choices=measure.POLICIES)  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="timed saves per method, median")
    p.add_argument("--restore-repeats", type=int, default=2, help="cold restores, median")
    p.add_argument("--rounds", type=int, default=3, help="interleaved side-by-side rounds")
    p.add_argument("--warmup-steps", type=int, default=2, help="training steps first")
    p.add_argument("--disk-mb", type=int, default=2048, help="size of the disk test")
    p.add_argument("--disk-passes", type=int, default=2, help="disk test passes, best kept")


def _cnr(b: Bench, model: Any, shards: list[LocalShard], key: tuple[measure.Policy, str, float],
         rows: Rows, check: Rows) -> dict[str, Any]:  # fmt: skip
    """A baseline, then ``--repeats`` timed saves of the modified ``rows``; cold restores."""
    policy, quant, frac = key
    root = b.scratch / f"cnr_{_key(*key)}"
    cfg = CheckpointConfig(str(root), policy=policy, on_busy="wait", quantize=measure.QUANTS[quant])
    # Peak memory: a manager over the model's own (its staging buffers), and over that its
    # first save and commit, the later ones, and a restore by a fresh manager.
    ckpt, peak_manager = _peak(lambda: CheckpointManager(model, cfg))
    with ckpt:
        (base_stall, _), peak_first = _peak(lambda: measure.timed_save(ckpt, 1))
        saving = measure.Peak(lambda step: measure.timed_save(ckpt, step))
        saves = []
        for rep in range(b.args.repeats):
            modify(shards, rows)
            saves.append(saving(2 + rep))
    infos = measure.from_rank0(lambda: list_checkpoints(str(root)))
    # Rank 0's staged bytes: table-wise tables spread evenly, every rank stages as much.
    memcpy = measure.memcpy_s(infos[-1].staged_bytes)
    gc.collect()

    with CheckpointManager(model, cfg) as restorer:
        watched = measure.Peak(restorer.restore)
        repeats = range(b.args.restore_repeats)
        restores = [measure.timed_restore(watched, root, shards, check) for _ in repeats]
    peak_restore = watched.over_ranks()
    measure.rmtree(root)
    gc.collect()
    stall = statistics.median(s for s, _ in saves)
    row = {
        "policy": policy, "quant": quant, "fraction": frac,
        "stall_s": stall, "commit_s": statistics.median(c for _, c in saves),
        "bytes": statistics.median(i.bytes for i in infos[1:]),
        "staged_bytes": infos[-1].staged_bytes, "memcpy_s": memcpy,
        "stall_over_memcpy": stall / memcpy,
        "restore_s": statistics.median(t for t, _ in restores),
        "restore_chain_len": len(infos[-1].chain),
        "restore_max_abs_err": max(e for _, e in restores),
        "baseline": {"stall_s": base_stall, "bytes": infos[0].bytes},
        "peak_mb": {"manager": peak_manager, "first_save": peak_first, "saves": saving.over_ranks(),
                    "restore": peak_restore},
    }  # fmt: skip
    b.log_row(row)
    return row


PAGE_CACHE = " page cache"
"""The side-by-side arms that read or write through the page cache (the default is ``O_DIRECT``)."""
BUDGETED = " budget"  # the side-by-side restore arm within :data:`RESTORE_BUDGET`


def _side_by_side(b: Bench, model: Any, shards: list[LocalShard], sels: dict[float, Rows],
                  check: Rows) -> dict[str, Any]:  # fmt: skip
    """The figures the side-by-side targets compare, in interleaved rounds."""
    ts_path, full = b.scratch / "sbs_torchsnapshot", {}

    def root_of(arm: str) -> Path:
        name = arm.replace(" ", "_")
        return ts_path if arm == "torchsnapshot" else b.scratch / f"sbs_full_{name}"

    def full_config(quant: str) -> CheckpointConfig:
        return CheckpointConfig(path=str(root_of(quant)), policy="full", quantize=FORMATS[quant])

    def commit(arm: str) -> float:
        if arm == "torchsnapshot":
            return torchsnapshot_take_durable(model, ts_path)
        quant, root = arm.removesuffix(PAGE_CACHE), root_of(arm)
        config = dataclasses.replace(full_config(quant), path=str(root))
        storage = FsStorage(root, direct_writes=arm == quant)
        with CheckpointManager(model, config, storage=storage) as ckpt:
            _, took = measure.timed_save(ckpt, 1)
        full[arm] = measure.from_rank0(lambda: checkpoint_info(str(root)))
        return took

    arms = ["torchsnapshot", *FORMATS, f"fp32{PAGE_CACHE}"]
    # Each method starts from a settled disk with its previous output deleted.
    commits = b.interleaved(b.args.rounds, arms, commit, lambda n: measure.rmtree(root_of(n)),
                            label="durable commit")  # fmt: skip
    # Chains to restore: intermittent at each fraction (baseline + one delta), and a
    # consecutive chain of 4 at the smaller one.
    small = min(sels)
    plan: list[tuple[str, measure.Policy, float, int]] = [
        *((f"intermittent_{f:.0%}".rstrip("%"), "intermittent", f, 1) for f in sorted(sels)),
        (f"consecutive_{small:.0%}_chain_of_4".replace("%", ""), "consecutive", small, 3),
    ]
    chains = {}
    for name, policy, frac, deltas in plan:
        chains[name] = CheckpointConfig(path=str(b.scratch / f"sbs_{name}"), policy=policy)
        with CheckpointManager(model, chains[name]) as ckpt:
            for step in range(1, deltas + 2):
                if step > 1:
                    modify(shards, sels[frac])
                measure.timed_save(ckpt, step)
    # The last commit round's full checkpoints, as they stand: fp32 and 4-bit; and the
    # first chain again within a memory budget, and through the page cache.
    first = next(iter(chains))
    rows_mb = sum(s.weight.numel() * s.weight.element_size() for s in shards) / 2**20
    budget_mb = measure.max_over_ranks(rows_mb * RESTORE_BUDGET)[0]
    setups: dict[str, tuple[CheckpointConfig, bool]] = {
        **{name: (config, True) for name, config in chains.items()},
        **{f"full_{q.replace('-', '')}": (full_config(q), True) for q in measure.QUANTS},
        f"{first}{BUDGETED}": (dataclasses.replace(chains[first], staging_memory_mb=budget_mb),
                               True),
        f"{first}{PAGE_CACHE}": (chains[first], False),
    }  # fmt: skip
    errors: dict[str, float] = {}
    peaks: dict[str, float] = {}

    def restore(name: str) -> float:
        if name == "torchsnapshot":  # the snapshot of the last commit round
            watched = measure.Peak(torchsnapshot_restore(model, ts_path))
            took, errors[name] = measure.timed_restore(watched, ts_path, shards, check)
        else:
            config, direct = setups[name]
            path = Path(config.path)
            storage = FsStorage(path, direct_reads=direct)
            with CheckpointManager(model, config, storage=storage) as restorer:
                watched = measure.Peak(restorer.restore)
                took, errors[name] = measure.timed_restore(watched, path, shards, check)
        peaks[name] = max(peaks.get(name, 0.0), watched.over_ranks())
        return took

    restores = b.interleaved(b.args.rounds, ["torchsnapshot", *setups], restore, label="restore")
    for path in [*map(root_of, arms), *(Path(c.path) for c in chains.values())]:
        measure.rmtree(path)
    commit_s = {k: statistics.median(v) for k, v in commits.items()}
    return {
        "rounds": b.args.rounds,
        "full_fp32_bytes": full["fp32"].bytes, "full_fp32_staged_bytes": full["fp32"].staged_bytes,
        "full_fp32_gb_s": full["fp32"].bytes / commit_s["fp32"] / measure.GB,
        "commit_s": commit_s, "commits": commits,
        "restore_s": {k: statistics.median(v) for k, v in restores.items()}, "restores": restores,
        "restore_max_abs_err": errors, "restore_peak_mb": peaks,
        "rows_mb_per_rank": rows_mb, "restore_budget_mb": budget_mb,
        "bytes": {name: info.bytes for name, info in full.items()},
    }  # fmt: skip


def targets(fracs: list[float], policies: list[measure.Policy]) -> list[Goal]:
    """The targets of a run at ``fracs`` (two fractions of rows modified) over ``policies``."""
    small, large = (f"{f:.0%}" for f in sorted(fracs))
    cnr = {f"{p} {q} {f:.0%}": f"cnr.{_key(p, q, f)}" for p in measure.POLICIES
           for q in measure.QUANTS for f in fracs}  # fmt: skip
    commit, restore = "side_by_side.commit_s", "side_by_side.restore_s"
    ts, copying = f"{restore}.torchsnapshot", "peers.torchsnapshot_async_take_copy.stall_s"
    return [
        *(Goal(f"intermittent fp32 stall <= async_take (copying) / {n} at {f}",
               f"{cnr[f'intermittent fp32 {f}']}.stall_s", "<=", copying, 1 / n)
          for f, n in ((small, 10), (large, 3))),
        *(Goal(f"{p} fp32 {f} delta stall <= 2 x a memcpy of its staged bytes",
               f"{cnr[f'{p} fp32 {f}']}.stall_over_memcpy", "<=", 2.0)
          for f in (large, small) for p in policies if p != "full"),
        *(Goal(f"a manager's first full stall <= 2 x its later ones ({f} run)",
               f"{cnr[f'full fp32 {f}']}.baseline.stall_s", "<=",
               f"{cnr[f'full fp32 {f}']}.stall_s", 2.0)
          for f in (small, large)),
        Goal("full fp32 durable commit <= torchsnapshot take + fsync (side by side)",
             f"{commit}.fp32", "<=", f"{commit}.torchsnapshot"),
        Goal("full fp32 commit >= 70% of the disk's write bandwidth",
             "side_by_side.full_fp32_gb_s", ">=", "disk.write_gb_s", 0.7),
        Goal("full fp32 commit with O_DIRECT <= through the page cache (side by side)",
             f"{commit}.fp32", "<=", f"{commit}.fp32{PAGE_CACHE}"),
        Goal(f"intermittent {small} restore with O_DIRECT <= through the page cache",
             f"{restore}.intermittent_{small[:-1]}", "<=",
             f"{restore}.intermittent_{small[:-1]}{PAGE_CACHE}"),
        *(Goal(f"{q} full commit <= fp32 full commit (side by side)",
               f"{commit}.{q}", "<=", f"{commit}.fp32")
          for q in FORMATS if q != "fp32"),
        Goal("4-bit full restore <= fp32 full restore (side by side)",
             f"{restore}.full_4bit", "<=", f"{restore}.full_fp32"),
        *(Goal(f"intermittent {f} restore <= torchsnapshot's restore",
               f"{restore}.intermittent_{f[:-1]}", "<=", ts)
          for f in (small, large)),
        Goal("consecutive chain of 4 restore <= 1.5 x torchsnapshot's restore",
             f"{restore}.consecutive_{small[:-1]}_chain_of_4", "<=", ts, 1.5),
    ]  # fmt: skip


def _commit(p: dict[str, Any]) -> str:
    fsync = f" (+{p['fsync_after_s']:.2f} fsync)" if "fsync_after_s" in p else ""
    return f"{p['commit_s']:.2f}{fsync}"


def tables(m: dict[str, Any]) -> list[Table]:
    mem, sbs, GB = m["memcpy_full"], m["side_by_side"], measure.GB
    limits = Table.of("Limits measured in the same run", [m["disk"]], {
        "disk write GB/s": "write_gb_s", "disk read GB/s": "read_gb_s",
        "memcpy GB/s per rank": lambda _: mem["bytes"] / mem["s"] / GB,
        "disk test": lambda d: f"{d['bytes'] / GB:.2f} GB, best of {len(d['passes'])} passes",
        "quantized GB/s of fp32 rows per thread": lambda _: ", ".join(
            f"{k} {v:.2f}" for k, v in m["encode_gb_s_per_thread"].items()),
    })  # fmt: skip
    ok = [p for p in m["peers"].values() if "error" not in p]
    failed = [[p["method"], "full", f"fails: {p['error'][:160]}", "", "", ""]
              for p in m["peers"].values() if p not in ok]  # fmt: skip
    peers = Table.of("", ok, {
        "method": "method", "modified": lambda _: "full", "stall s": "stall_s",
        "commit s": _commit, "written GB": lambda p: p["bytes"] / GB, "restore s": "restore_s",
    })  # fmt: skip
    which: dict[str, Column] = {
        "method": lambda r: f"torchrec_cnr {r['policy']} {r['quant']}",
        "modified": lambda r: "–" if r["policy"] == "full" else f"{r['fraction']:.0%}",
    }
    ours = Table.of("", m["cnr"].values(), {
        **which, "stall s": "stall_s", "commit s": "commit_s",
        "written GB": lambda r: r["bytes"] / GB,
        "restore s": lambda r: f"{r['restore_s']:.2f} (chain of {r['restore_chain_len']})",
    })  # fmt: skip
    side = [{"figure": figure, "method": k, "v": v}
            for figure, runs in (("durable full commit", sbs["commits"]),
                                 ("cold restore", sbs["restores"]))
            for k, v in runs.items()]  # fmt: skip
    rows_mb = sbs["rows_mb_per_rank"]

    def peak(k: str) -> Column:
        return lambda r: r["peak_mb"][k]

    return [
        limits,
        Table("One checkpoint of the same model", peers.columns, peers.rows + failed + ours.rows,
              "torchrec_cnr and DCP commits include fsync; torchrec_cnr restores verify checksums."),
        Table.of(f"Side by side: median of {sbs['rounds']} interleaved rounds", side, {
            "figure": "figure", "method": "method",
            "median s": lambda r: statistics.median(r["v"]),
            "rounds s": lambda r: ", ".join(f"{x:.2f}" for x in r["v"]),
        }),
        Table.of(
            f"Peak resident memory over the model's, MB, largest rank ({rows_mb:.0f} MB of rows "
            "per rank)", m["cnr"].values(),
            {**which, "manager": peak("manager"), "first save + commit": peak("first_save"),
             "later saves + commits": peak("saves"), "restore": peak("restore")},
            "A manager's staging buffers (a full checkpoint's, faulted in when it is built) are "
            "reused by every save and by a restore; each later column is what its calls added "
            "over the manager's.",
        ),
        Table.of(
            "Cold restores side by side: resident memory the restore call added at its peak, "
            "MB, largest rank (over the model and, for torchrec_cnr, its manager's staging "
            "buffers: the manager column above, or the budget)",
            [{"method": k, "mb": v} for k, v in sbs["restore_peak_mb"].items()],
            {"method": "method", "peak MB": "mb", "x rows": lambda r: r["mb"] / rows_mb},
            f"'{BUDGETED.strip()}': staging_memory_mb (and so restore_memory_mb) = "
            f"{sbs['restore_budget_mb']:.0f} MB, 1/8 of the rows.",
        ),
    ]  # fmt: skip


def run(b: Bench) -> Outcome:
    a = b.args
    disk = measure.disk_bandwidth(b.scratch, a.disk_mb << 20, passes=a.disk_passes)
    model = measure.StepLoop.warm(a, 512, a.warmup_steps).work.model
    shards = local_shards(model)
    sels = measure.random_rows(shards, a.fractions)
    check = sels[max(a.fractions)]
    encode = encode_rates(shards)
    side_by_side = _side_by_side(b, model, shards, sels, check)
    peers = run_peers(model, b.scratch, shards, check)
    keys = [(p, q, f) for p in a.policies for q in measure.QUANTS for f in a.fractions]
    cnr = {_key(*k): _cnr(b, model, shards, k, sels[k[2]], check) for k in keys}
    staged = side_by_side["full_fp32_staged_bytes"]
    m = {"model": {"tables": a.tables, "rows": a.rows, "dim": a.dim}, "disk": disk,
         "memcpy_full": {"bytes": staged, "s": measure.memcpy_s(staged)},
         "encode_gb_s_per_thread": encode, "peers": peers, "cnr": cnr,
         "side_by_side": side_by_side}  # fmt: skip
    return Outcome(m, tables(m), targets(a.fractions, a.policies))


CASE = Case("checkpoint", "Checkpoint stall, commit, bytes and restore against torchsnapshot and "
            "DCP", _arguments, "--tables 2 --rows 4000 --dim 16 --repeats 1 --restore-repeats 1 "
            "--rounds 1 --warmup-steps 1 --disk-mb 8 --disk-passes 1", run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
