"""Bytes written and stored at each interval, per policy (Check-N-Run Figs. 15, 16): each
policy trains the same model on the same batches with ``keep_last=1``, relative to one full
checkpoint. ``--figure`` also plots them (``fig15_16.png``) and writes ``results.csv``.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks import measure
from benchmarks.harness import Bench, Case, Outcome, cli, pyplot, save_figure, write_csv
from benchmarks.results import Table
from cnr_train.workload import ZipfBatches, train_step
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.offline import checkpoint_info
from torchrec_cnr.storage.fs import tree_bytes


def arguments(p: argparse.ArgumentParser) -> None:
    measure.model_arguments(p, rows=100_000)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--pooling", type=int, default=2)
    p.add_argument("--alpha", type=float, default=1.1)
    p.add_argument("--intervals", type=int, default=12)
    p.add_argument("--steps-per-interval", type=int, default=20)
    p.add_argument("--figure", action="store_true",
                   help="plot Figs. 15 and 16 and write a CSV beside")  # fmt: skip


def _policy(b: Bench, policy: measure.Policy) -> list[dict[str, Any]]:
    a = b.args
    root = b.scratch / policy
    model, opt, tables = measure.uniform_model(a)
    data = ZipfBatches(tables, a.batch_size, alpha=a.alpha, pooling=a.pooling, seed=0)
    cfg = CheckpointConfig(path=str(root), policy=policy, keep_last=1)
    rows: list[dict[str, Any]] = []
    with CheckpointManager(model, cfg, {"reader": data, "dense_opt": opt}) as ckpt:
        for interval in range(1, a.intervals + 1):
            for _ in range(a.steps_per_interval):
                train_step(model, opt, data.next(b.rank))
            ckpt.save(interval * a.steps_per_interval)
            ckpt.wait()
            info, stored = measure.from_rank0(
                lambda: (checkpoint_info(str(root)), tree_bytes(root))
            )
            rows.append({"policy": policy, "interval": interval, "kind": info.kind,
                         "rows_saved_frac": info.saved_fraction, "written_bytes": info.bytes,
                         "stored_bytes": stored, "chain_len": len(info.chain)})  # fmt: skip
    measure.rmtree(root)
    return rows


def summarize(per: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The measurements of every policy's intervals: relative bytes and totals."""
    full = per["full"][0]["written_bytes"]
    for rows in per.values():
        for r in rows:
            r["written_rel"] = r["written_bytes"] / full
            r["stored_rel"] = r["stored_bytes"] / full
    totals = {p: {"written_bytes": sum(r["written_bytes"] for r in rows),
                  "peak_stored_rel": max(r["stored_rel"] for r in rows)}
              for p, rows in per.items()}  # fmt: skip
    for t in totals.values():
        t["written_less_than_full"] = totals["full"]["written_bytes"] / t["written_bytes"]
    return {"full_bytes": full, "intervals": per, "totals": totals}


def tables(m: dict[str, Any]) -> list[Table]:
    per, totals = m["intervals"], m["totals"]
    policies, count = list(per), len(per["full"])

    def written(p: str, i: int) -> str:
        return f"{per[p][i]['written_rel']:.3f} {'F' if per[p][i]['kind'] == 'full' else 'd'}"

    rows: list[list[Any]] = [
        [i + 1, f"{per['consecutive'][i]['rows_saved_frac']:.1%}", *(written(p, i) for p in policies)]
        for i in range(count)
    ]  # fmt: skip
    rows.append(["**written, all intervals**", ""] + [
        f"{t['written_bytes'] / 1e6:.0f} MB ({t['written_less_than_full']:.2f}x less)"
        for t in totals.values()
    ])  # fmt: skip
    rows.append(["**peak stored**", ""] + [f"{t['peak_stored_rel']:.2f}" for t in totals.values()])
    stored = [[i + 1, *(per[p][i]["stored_rel"] for p in policies)] for i in range(count)]
    return [
        Table("Written per interval, x one full checkpoint (F full, d delta)",
              ["interval", "rows modified", *policies], rows,
              note=f"One full checkpoint = {m['full_bytes'] / 1e6:.1f} MB."),
        Table("Stored after each interval, x one full checkpoint", ["interval", *policies], stored),
    ]  # fmt: skip


def _figure(b: Bench, m: dict[str, Any]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for policy, rows in m["intervals"].items():
        xs = [r["interval"] for r in rows]
        axes[0].plot(xs, [r["written_rel"] for r in rows], marker="o", label=policy)
        axes[1].plot(xs, [r["stored_rel"] for r in rows], marker="o", label=policy)
    axes[0].set_title("Fig. 15: written per interval")
    axes[1].set_title("Fig. 16: stored after each interval")
    for ax in axes:
        ax.set(xlabel="interval", ylabel="x one full checkpoint")
        ax.legend()
    save_figure(fig, b.artifacts / "fig15_16.png")


def run(b: Bench) -> Outcome:
    m = summarize({p: _policy(b, p) for p in measure.POLICIES})
    if b.args.figure and b.rank == 0:
        write_csv(b.artifacts / "results.csv", [r for per in m["intervals"].values() for r in per])
        _figure(b, m)
    return Outcome(m, tables(m))


CASE = Case("policies", "Bytes written and stored per policy (Check-N-Run Figs. 15 and 16)",
            arguments, "--tables 2 --rows 2000 --dim 16 --batch-size 64 --intervals 4 "
            "--steps-per-interval 2", run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
