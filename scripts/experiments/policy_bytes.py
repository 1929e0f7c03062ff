"""Check-N-Run Figs. 15 and 16: bytes written and stored per interval, per policy.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 \
        scripts/experiments/policy_bytes.py --out out/experiments/policy_bytes

Runs ``scripts/bench_policies.py`` (see its docstring for the workload) and
writes results.csv, fig15_16.png and summary.md into ``--out``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench_policies.py"))
    sys.exit(bench["main"](sys.argv[1:]))
