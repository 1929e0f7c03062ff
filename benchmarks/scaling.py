"""The scaling curve: stall, commit, restore and peak host memory per rank against the
embedding bytes each rank holds (``--gb-per-rank``), full saves and 5%/25% deltas, fp32
and 4-bit, each restored cold; the disk and a memcpy beside, extrapolated to
``--extrapolate`` GB per rank. Writes ``scaling.csv`` and ``scaling.png``.
"""

from __future__ import annotations

import argparse
import functools
import gc
from typing import Any

from benchmarks import measure
from benchmarks.harness import Bench, Case, Outcome, cli, pyplot, save_figure, write_csv
from benchmarks.results import Table
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.testing.memory import proc_status_mb, reset_peak_rss
from torchrec_cnr.testing.rows import modify
from torchrec_cnr.tracking.model_state import local_shards

FIGURES = {"stall_s": "stall (s)", "commit_s": "commit (s)", "restore_s": "restore, cold (s)",
           "peak_mb": "peak host memory above the model (MB)"}  # fmt: skip
SAVED = (1.0, 0.05, 0.25)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gb-per-rank", type=float, nargs="+", default=[0.25, 0.5, 1, 2, 4])
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table (dim 64)")
    p.add_argument("--extrapolate", type=float, default=100.0, help="GB per rank")
    p.add_argument("--disk-mb", type=int, default=2048, help="size of the disk test")
    p.add_argument("--memcpy-mb", type=int, default=1000, help="size of the memory copy test")


def _size(b: Bench, gb: float) -> list[dict[str, Any]]:
    a = b.args
    tables = max(1, round(gb * measure.GB / (a.rows * 64 * 4))) * b.world
    model = measure.uniform_model(argparse.Namespace(tables=tables, rows=a.rows, dim=64)).model
    shards = local_shards(model)
    (local_gb,) = measure.max_over_ranks(sum(s.weight.numel() * 4 for s in shards) / measure.GB)
    sels = measure.random_rows(shards, SAVED[1:])
    rows: list[dict[str, Any]] = []
    for quant, qcfg in measure.QUANTS.items():
        root = b.scratch / f"{gb}_{quant}"
        gc.collect()
        base = reset_peak_rss()
        cfg = CheckpointConfig(path=str(root), policy="intermittent", quantize=qcfg)
        with CheckpointManager(model, cfg) as ckpt:
            for step, saved in enumerate(SAVED, start=1):
                if saved < 1:
                    modify(shards, sels[saved])
                stall, commit = measure.timed_save(ckpt, step)
                (save_peak,) = measure.max_over_ranks(proc_status_mb("VmHWM") - base)
                measure.drop_cache(root)
                restore, _ = measure.timed(functools.partial(ckpt.restore, step=step))
                (peak,) = measure.max_over_ranks(proc_status_mb("VmHWM") - base)
                got = [stall, commit, restore, max(save_peak, peak)]
                rows.append({"gb_per_rank": local_gb, "quant": quant, "saved": saved,
                             **dict(zip(FIGURES, got))})  # fmt: skip
                b.log_row(rows[-1])
        del ckpt  # its staging buffers go before the next manager takes its own
        measure.rmtree(root)
    del model, shards, sels
    gc.collect()
    return rows


def _what(r: dict[str, Any]) -> str:
    return f"{r['quant']} {'full' if r['saved'] == 1 else format(r['saved'], '.0%')}"


def tables(m: dict[str, Any], target_gb: float) -> list[Table]:
    rows, limits = m["rows"], m["limits"]
    top = max(r["gb_per_rank"] for r in rows)
    scale = target_gb / top
    bound = {
        "stall_s": f"memory copy, {limits['memcpy_gb_s']:.1f} GB/s per rank",
        "commit_s": f"disk write, {limits['write_gb_s']:.2f} GB/s for the whole machine",
        "restore_s": f"disk read, {limits['read_gb_s']:.2f} GB/s for the whole machine",
        "peak_mb": "the staging pool (a full checkpoint; staging_memory_mb caps it)",
    }
    limits_text = (f"Disk write {limits['write_gb_s']:.2f} GB/s, read {limits['read_gb_s']:.2f} "
                   f"GB/s; memory copy {limits['memcpy_gb_s']:.1f} GB/s per rank.")  # fmt: skip
    return [
        Table("Per rank, slowest rank", ["GB/rank", "checkpoint", *FIGURES.values()],
              [[r["gb_per_rank"], _what(r), *(r[k] for k in FIGURES)] for r in rows], limits_text),
        Table(f"Extrapolated to {target_gb:g} GB per rank from the {top:.2f} GB/rank rates (linear)",
              ["checkpoint", *FIGURES.values()],
              [[_what(r), *(r[k] * scale for k in FIGURES)] for r in rows if r["gb_per_rank"] == top],
              "Bounded by: " + "; ".join(f"{FIGURES[k]}: {v}" for k, v in bound.items())),
    ]  # fmt: skip


def _plot(b: Bench, rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, (key, title) in zip(axes, FIGURES.items()):
        for quant, style in (("fp32", "-"), ("4-bit", "--")):
            for saved, color in ((1.0, "C0"), (0.25, "C1"), (0.05, "C2")):
                pts = [r for r in rows if r["quant"] == quant and r["saved"] == saved]
                label = f"{quant} {'full' if saved == 1 else f'{saved:.0%} delta'}"
                xs, ys = [r["gb_per_rank"] for r in pts], [r[key] for r in pts]
                ax.plot(xs, ys, style, color=color, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="embedding GB per rank", title=title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"torchrec_cnr scaling, {b.world} ranks (intermittent policy)")
    save_figure(fig, b.artifacts / "scaling.png")


def run(b: Bench) -> Outcome:
    a = b.args
    disk = measure.disk_bandwidth(b.scratch, a.disk_mb << 20)
    limits = {"write_gb_s": disk["write_gb_s"], "read_gb_s": disk["read_gb_s"],
              "memcpy_gb_s": a.memcpy_mb / 1e3 / measure.memcpy_s(a.memcpy_mb * 10**6)}  # fmt: skip
    b.log(", ".join(f"{k} {v:.2f}" for k, v in limits.items()))
    rows = [r for gb in a.gb_per_rank for r in _size(b, gb)]
    m = {"limits": limits, "disk": disk, "rows": rows}
    if b.rank == 0:
        write_csv(b.artifacts / "scaling.csv", rows)
        _plot(b, rows)
    return Outcome(m, tables(m, a.extrapolate))


CASE = Case("scaling", "Scaling: 0.25 to 4 GB per rank", _arguments,
            "--gb-per-rank 0.002 --rows 2000 --disk-mb 8 --memcpy-mb 16", run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
