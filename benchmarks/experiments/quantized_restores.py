"""Check-N-Run Figs. 14 and 17 on the synthetic Criteo-like DLRM: accuracy after L
restores from quantized checkpoints, and the write and capacity reductions.

Every run trains the same model (26 Criteo tables capped at ``--max-rows``, dim ``--dim``)
on the same batches for ``--steps`` steps, an intermittent checkpoint every ``--interval``.
A run with L restores restores its latest checkpoint after L evenly spaced ones, as a
failure would, so its quality shows the error quantization adds; the reference never
restores. Reductions are against full fp32 checkpoints: bytes written, and the peak bytes
kept to restore. The grid is ``--bits`` x ``--restores`` (``fig14_auc.png``,
``fig17_reduction.png``); the targets, ``bits="auto"`` for each L of ``--targets``: AUC drop
<= 0.001. ``--bits --restores`` with no values runs the targets alone::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=2 \\
        -m benchmarks.experiments.quantized_restores --steps 4800 --bits --restores \\
        --targets 20 --out out/bench/experiments/quantized_restores_4800.json
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.harness import Bench, Case, Outcome, cli, pyplot, save_figure, write_csv
from benchmarks.measure import Policy, from_rank0, rmtree
from benchmarks.results import Column, Goal, Table
from cnr_train.config import JobConfig, ModelConfig
from cnr_train.job import Trainer, evaluate
from cnr_train.workload import train_step
from torchrec_cnr import CheckpointConfig, QuantizeConfig
from torchrec_cnr.offline import checkpoint_info
from torchrec_cnr.quantization import select_bits

AUC_DROP = 0.001  # Check-N-Run's bound on the AUC a quantized restore may cost


def targets(restores: list[int]) -> list[Goal]:
    return [Goal(f"bits='auto' for L={n}: AUC drop <= {AUC_DROP}", f"runs.auto-L{n}.auc_drop", "<=",
                 AUC_DROP) for n in restores]  # fmt: skip


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--interval", type=int, default=15)
    p.add_argument("--max-rows", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--eval-batches", type=int, default=40)
    p.add_argument("--bits", type=int, nargs="*", default=[2, 3, 4, 8])
    p.add_argument("--restores", type=int, nargs="*", default=[1, 2, 5, 10])
    p.add_argument("--targets", type=int, nargs="*", default=[1, 3, 20], help="L for bits='auto'")


def _run(b: Bench, name: str, policy: Policy, quant: QuantizeConfig, bits: int,
         restores: int) -> dict[str, Any]:  # fmt: skip
    """One run of ``restores`` evenly spaced restores: quality, bytes written and stored."""
    a, root = b.args, str(b.scratch / name)
    cfg = CheckpointConfig(path=root, policy=policy, interval_steps=a.interval, quantize=quant,
                           keep_last=1)  # fmt: skip
    t = Trainer.build(JobConfig(checkpoint=cfg, model=ModelConfig(
        tables="criteo", max_rows=a.max_rows, dim=a.dim)), seed=0)  # fmt: skip
    checkpoints = a.steps // a.interval
    restore_at = {round((k + 1) * checkpoints / (restores + 1)) * a.interval
                  for k in range(restores)}  # fmt: skip
    written = peak_stored = done = 0
    rows_saved = 0.0  # embedding rows written; a column shard counts as its share of a row
    one_interval: list[float] = []  # share of rows in each first delta after a baseline
    for step in range(1, a.steps + 1):
        train_step(t.model, t.opt, t.data.next(b.rank))
        if not t.ckpt.maybe_save(step):
            continue
        t.ckpt.wait()
        # keep_last=1 drops older checkpoints: count each commit as it lands.
        info = from_rank0(lambda: checkpoint_info(root))
        all_rows = sum(table.num_embeddings for table in info.tables.values())
        written += info.bytes
        peak_stored = max(peak_stored, info.restore_bytes)
        rows_saved += info.saved_fraction * all_rows
        if info.kind == "delta" and len(info.chain) == 2:
            one_interval.append(info.saved_fraction)  # the rows modified in one interval
        if step in restore_at:
            assert t.ckpt.restore() == step
            done += 1
    metrics = evaluate(t.model, t.data, a.eval_batches)
    t.ckpt.close()
    rmtree(b.scratch / name)
    row = {"run": name, "policy": policy, "method": quant.method, "bits": bits, "L": restores,
           **metrics, "written": written, "peak_stored": peak_stored, "restores": done,
           "checkpoints": checkpoints, "bytes_per_row": written / max(rows_saved, 1),
           "rows_per_interval": sum(one_interval) / len(one_interval) if one_interval else None}  # fmt: skip
    b.log(f"{name}: AUC {row['auc']:.4f}, log loss {row['logloss']:.4f}, "
          f"written {written / 1e6:.1f} MB")  # fmt: skip
    return row


def _compare(runs: dict[str, dict[str, Any]]) -> None:
    """Each run against the reference (quality) and full fp32 checkpoints (bytes)."""
    full, ref = runs["full-fp32"], runs["intermittent-fp32-L0"]
    full_each = full["written"] / full["checkpoints"]
    for r in runs.values():
        r["auc_drop"] = ref["auc"] - r["auc"]
        r["logloss_rise"] = r["logloss"] - ref["logloss"]
        r["write_reduction"] = full["written"] / r["written"]
        r["capacity_reduction"] = full_each / r["peak_stored"]


def tables(m: dict[str, Any]) -> list[Table]:
    runs, steps = m["runs"], m["steps"]
    ref, full = runs["intermittent-fp32-L0"], runs["full-fp32"]
    quality: dict[str, Column] = {
        "AUC drop": lambda r: f"{r['auc_drop']:+.4f}",
        "log-loss rise": lambda r: f"{r['logloss_rise']:+.4f}",
        "write reduction": lambda r: f"{r['write_reduction']:.2f}x",
        "capacity reduction": lambda r: f"{r['capacity_reduction']:.2f}x",
    }
    auto = [r for k, r in runs.items() if k.startswith("auto")]
    note = f"Reference (intermittent fp32, no restore): AUC {ref['auc']:.4f}, log loss "
    note += f"{ref['logloss']:.4f}; one full fp32 checkpoint {full['written'] / full['checkpoints'] / 1e6:.1f} MB."
    out = [Table.of("Targets: bits='auto' for L expected restores", auto, {
        "L": "L", "bits": "bits", "~steps between restores": lambda r: steps // (r["L"] + 1),
        **quality}, note)]  # fmt: skip
    why = [r for k, r in runs.items() if not k.startswith("adaptive") and "bytes_per_row" in r]
    if why:
        out.append(Table.of("Where the reductions come from", why, {
            "run": "run",
            "rows modified per interval": lambda r: "–" if r["rows_per_interval"] is None
            else f"{100 * r['rows_per_interval']:.1f}%",
            "bytes per row written": "bytes_per_row",
        }))  # fmt: skip
    grid = [r for k, r in runs.items() if k.startswith("adaptive")]
    if grid:
        columns = {"bits": "bits", "L": "L", **quality}
        out.append(Table.of("Fig. 14 grid (adaptive, intermittent)", grid, columns))
    return out


def _figures(b: Bench, runs: dict[str, dict[str, Any]]) -> None:
    plt = pyplot()
    grid = [r for k, r in runs.items() if k.startswith("adaptive")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for bits in b.args.bits:
        pts = sorted((r["L"], r["auc_drop"], r["logloss_rise"]) for r in grid if r["bits"] == bits)
        for ax, i in zip(axes, (1, 2)):
            ax.plot([p[0] for p in pts], [p[i] for p in pts], marker="o", label=f"{bits}-bit")
    for ax, title in zip(axes, ("AUC degradation", "log-loss increase")):
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xlabel("restores L")
        ax.set_title(title)
        ax.legend()
    fig.suptitle("Fig. 14: quality after L restores from adaptive-quantized checkpoints")
    save_figure(fig, b.artifacts / "fig14_auc.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ref = runs["intermittent-fp32-L0"]
    shown = [ref, *[r for r in grid if r["L"] == b.args.restores[0]]]
    xs = range(len(shown))
    ax.bar([x - 0.2 for x in xs], [r["write_reduction"] for r in shown], 0.4,
           label="write bandwidth")  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [r["capacity_reduction"] for r in shown], 0.4, label="capacity")
    ax.set_xticks(list(xs), ["fp32" if r is ref else f"{r['bits']}-bit" for r in shown])
    ax.set_ylabel("x less than full fp32 checkpoints")
    ax.set_title("Fig. 17: intermittent policy, reduction by bit width")
    ax.legend()
    save_figure(fig, b.artifacts / "fig17_reduction.png")


def run(b: Bench) -> Outcome:
    a = b.args
    plan: list[tuple[str, Policy, QuantizeConfig, int, int]] = [
        ("full-fp32", "full", QuantizeConfig(), 32, 0),
        ("intermittent-fp32-L0", "intermittent", QuantizeConfig(), 32, 0),
        *((f"adaptive{bits}-L{n}", "intermittent",
           QuantizeConfig(method="adaptive", bits=bits, min_rows=0), bits, n)
          for bits in a.bits for n in a.restores),
        *((f"auto-L{n}", "intermittent",
           QuantizeConfig(method="adaptive", bits="auto", expected_restores=n, min_rows=0),
           select_bits(n), n) for n in a.targets),
    ]  # fmt: skip
    runs = {p[0]: _run(b, *p) for p in plan}
    _compare(runs)
    if b.rank == 0:
        write_csv(b.artifacts / "results.csv", list(runs.values()))
        if any(k.startswith("adaptive") for k in runs):
            _figures(b, runs)
    m = {"steps": a.steps, "interval": a.interval, "runs": runs}
    return Outcome(m, tables(m), targets(a.targets))


CASE = Case("experiments.quantized_restores", "Quantized restores (Check-N-Run Figs. 14 and 17)",
            _arguments, "--steps 8 --interval 2 --max-rows 2000 --dim 8 --eval-batches 2 "
            "--bits 4 --restores 1 --targets 1", run, kind="experiment")  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
