"""The stall of one save, eager against lazy (copy-on-write) staging, as the delta grows.

Per staging and share of rows modified: a baseline, then ``--repeats`` saves timed inside
``save()`` and to ``wait()``, beside a memcpy of the staged bytes and the dense state's
copy. Targets: lazy ``save()`` <= 2 ms (and 5 ms) + the dense copy, <= eager's / 10 and <= a
memcpy of the delta.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from typing import Any

from benchmarks import measure
from benchmarks.harness import Bench, Case, Outcome, cli
from benchmarks.results import Goal, Table
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.config import Staging
from torchrec_cnr.offline import list_checkpoints
from torchrec_cnr.testing.rows import modify
from torchrec_cnr.tracking import model_state

MODES: tuple[Staging, ...] = ("eager", "lazy")


def _arguments(p: argparse.ArgumentParser) -> None:
    measure.model_arguments(p, rows=1_000_000)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.25])
    p.add_argument("--policy", default="intermittent")
    p.add_argument("--repeats", type=int, default=9, help="timed saves per case, median")


def _key(mode: str, frac: float) -> str:
    return f"{mode}_{round(frac * 100)}"


def _case(b: Bench, w: Any, shards: list[Any], mode: Staging, frac: float, rows: Any) -> dict:
    root = b.scratch / _key(mode, frac)
    cfg = CheckpointConfig(path=str(root), policy=b.args.policy, staging=mode)
    saves, hook = [], []
    with CheckpointManager(w.model, cfg) as ckpt:
        measure.timed_save(ckpt, 1)
        for rep in range(b.args.repeats):
            modify(shards, rows)
            saves.append(measure.timed_save(ckpt, 2 + rep))
            lazy = ckpt.lazy_staging
            hook.append(0.0 if lazy is None else lazy.background_s)
    info = list_checkpoints(str(root))[-1]
    measure.rmtree(root)
    gc.collect()
    row = {"staging": mode, "fraction": frac, "stall_s": statistics.median(s for s, _ in saves),
           "stalls_s": [s for s, _ in saves], "commit_s": statistics.median(c for _, c in saves),
           "staged_bytes": info.staged_bytes, "memcpy_s": measure.memcpy_s(info.staged_bytes),
           "background_copy_s": statistics.median(hook)}  # fmt: skip
    b.log_row(row)
    return row


def targets(fractions: list[float]) -> list[Goal]:
    """The targets of a run at ``fractions`` of rows modified."""
    out = []
    for f in fractions:
        lazy, eager = f"cases.{_key('lazy', f)}", f"cases.{_key('eager', f)}"
        out += [
            Goal(f"lazy save() <= 2 ms + the dense copy at {f:.0%}", f"{lazy}.stall_s", "<=",
                 "flat_budget_s"),
            Goal(f"lazy save() <= 5 ms + the dense copy at {f:.0%}", f"{lazy}.stall_s", "<=",
                 "lazy_budget_s"),
            Goal(f"lazy save() <= eager's / 10 at {f:.0%}", f"{lazy}.stall_s", "<=",
                 f"{eager}.stall_s", 0.1),
            Goal(f"lazy save() <= a memcpy of the delta at {f:.0%}", f"{lazy}.stall_s", "<=",
                 f"{lazy}.memcpy_s"),
        ]  # fmt: skip
    return out


def run(b: Bench) -> Outcome:
    a = b.args
    w = measure.StepLoop.warm(a, 512, 2).work
    shards = model_state.local_shards(w.model)
    sels = measure.random_rows(shards, a.fractions)
    dense = model_state.dense_state(w.model)
    copies = [measure.timed(lambda: {k: v.detach().clone() for k, v in dense.items()})[0]
              for _ in range(5)]  # fmt: skip
    dense_s = measure.max_over_ranks(statistics.median(copies))[0]
    cases = {_key(m, f): _case(b, w, shards, m, f, sels[f]) for f in a.fractions for m in MODES}
    m = {"model": {"tables": a.tables, "rows": a.rows, "dim": a.dim, "policy": a.policy},
         "dense_copy_s": dense_s, "lazy_budget_s": 0.005 + dense_s,
         "flat_budget_s": 0.002 + dense_s, "cases": cases}  # fmt: skip
    title = f"One {a.policy} fp32 save, eager and lazy staging (median of {a.repeats})"
    table = Table.of(title, list(cases.values()), {
        "staging": "staging", "modified": lambda r: f"{r['fraction']:.0%}",
        "save() returns in ms": lambda r: r["stall_s"] * 1e3,
        "slowest save ms": lambda r: max(r["stalls_s"]) * 1e3,
        "memcpy of the delta ms": lambda r: r["memcpy_s"] * 1e3,
        "background copy ms": lambda r: r["background_copy_s"] * 1e3,
        "commit s": "commit_s", "staged MB": lambda r: r["staged_bytes"] / 2**20,
    })  # fmt: skip
    return Outcome(m, [table], targets(a.fractions))


CASE = Case("stall", "The stall of a save: eager against lazy (copy-on-write) staging",
            _arguments, "--tables 2 --rows 4000 --dim 16 --repeats 1", run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
