"""``scripts/gpu_check.py``, the full-stack check a lent GPU machine runs, tried on CPU:
the same cases (``--device cpu``), so that the script is known to work before GPU time is
spent on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_check_passes_on_cpu_and_records_what_it_ran(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    cases = ["base", "optimizer=exact_sgd", "policy=consecutive", "staging=eager", "bits=4"]
    cmd = [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--no-pytest",
           "--rows", "3000", "--batch", "256", "--out", str(out), "--cases", *cases]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["ok"] and record["device"] == "cpu" and record["pytest"] is None
    assert {"torch", "torchrec", "fbgemm_gpu"} <= record["versions"].keys()
    ran = {r["name"]: r for r in record["cases"]}
    assert list(ran) == [*cases, "follower (fp32, FloatTarget)"]
    for name in cases:
        assert ran[name]["problems"] == [] and ran[name]["checkpoints"] == [2, 4, 6, 8, 10, 12]
