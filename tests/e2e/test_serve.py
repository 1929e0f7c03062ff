"""scripts/serve.py beside scripts/train.py under a real torchrun: the serving process
follows the job's checkpoints while it trains, answers requests, and ends at the job's
last committed step with the trained model's AUC, up to INT4 rounding."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cnr_train import config_file
from cnr_train.config import JobConfig
from cnr_train.job import DONE_MARKER
from cnr_train.serve import Server
from tests import REPO, TORCHRUN
from torchrec_cnr import FollowerOptions
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.storage import open_storage

# 20,000 rows per table: an interval changes a small part of the Zipf-drawn rows, as in
# the demo (with 2,000, most rows change every interval). fp32 checkpoints, so the
# served model differs from the trained one by INT4 rounding only.
SMALL = (
    "model.max_rows=20000",
    "model.dim=16",
    "train.steps=80",
    "checkpoint.interval_steps=10",
    "checkpoint.quantize.method=none",
    "eval.batches=4",
    "failure.steps=[]",
    "train.figure_path=null",
    "train.verify_restore=false",
)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_serving_beside_training_follows_every_commit_and_matches_the_trained_auc(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    overrides = [
        f"checkpoint.path={root}",
        *SMALL,
        f"train.metrics_path={tmp_path / 'train.json'}",
        f"serve.metrics_path={tmp_path / 'serve.json'}",
        "serve.timeout_s=150",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    config = ("--config", "configs/demo.yaml", *overrides)
    # Started first, as `make demo` does, at a lower priority than the job it shares
    # the cores with; its log goes to a file, which no pipe buffer limits.
    log = tmp_path / "serve.log"
    with open(log, "w") as stderr:
        serve = subprocess.Popen(
            ["nice", "-n", "10", sys.executable, "scripts/serve.py", *config],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        # The job starts once the serving process follows the root, so it sees every commit.
        while "serving: following" not in log.read_text():
            assert serve.poll() is None, "serving ended before following:\n" + log.read_text()
            time.sleep(0.1)
        train = subprocess.run(
            [str(TORCHRUN), "--standalone", "--nproc_per_node=2", "scripts/train.py", *config],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert train.returncode == 0, train.stderr[-3000:]
        out, _ = serve.communicate(timeout=120)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.communicate()
    assert serve.returncode == 0, log.read_text()[-3000:]
    assert "AUC: served model" in out, out

    served = json.loads((tmp_path / "serve.json").read_text())
    trained = json.loads((tmp_path / "train.json").read_text())
    manifest = Manifest.load(root)
    latest = manifest.latest()
    assert latest is not None and latest.step == 80
    assert served["served_step"] == served["job_step"] == latest.step

    # However the cores were shared, the first update is cold and any after it are not
    # (that a follower reads only the changed rows is the follower's contract tests').
    reports = served["update_reports"]
    assert len(reports) == served["updates"] >= 1
    assert reports[0]["cold"] and not any(r["cold"] for r in reports[1:])
    assert all(r["lag_s"] >= 0 and r["bytes_read"] > 0 and r["rows"] > 0 for r in reports)
    assert 0 <= served["lag_median_s"] <= served["lag_max_s"]
    assert served["blocked_max_s"] > 0
    full = served["full_reload_bytes"]
    record = manifest.record(latest)
    tables = sum(4 * t.num_embeddings * t.embedding_dim for t in record.tables.values())
    assert full == tables + sum(4 * math.prod(d.shape) for d in record.dense.values())
    # Every update after the cold first reads only the rows changed since the served step.
    assert all(r["bytes_read"] < full for r in reports[1:]), [r["bytes_read"] for r in reports]
    assert served["bytes_total"] == sum(r["bytes_read"] for r in reports)

    # Requests were answered from the first commit served on, each at a committed step
    # (one at least: at the last step if the job ended before the first was served).
    assert served["requests"] > 0 and served["request_steps"] >= 1

    assert served["trained_auc"] == trained["auc"]
    assert abs(served["auc"] - trained["auc"]) < 0.02, (served["auc"], trained["auc"])
    storage = open_storage(str(root))
    assert storage.exists(DONE_MARKER)

    # A job that ends before its serving process first serves (its marker rewritten as if
    # it ended after the process started): the last step is served, one request answered.
    done = {"step": latest.step, "finished_at": time.time() + 60}
    storage.write(DONE_MARKER, json.dumps(done).encode())
    again = [o for o in overrides if not o.startswith("serve.metrics_path")]
    server = Server(config_file.load(JobConfig, REPO / "configs/demo.yaml", again))
    try:
        late = server.run()
    finally:
        server.close()
    assert late["served_step"] == latest.step and late["updates"] == 1
    assert late["requests"] == late["request_steps"] == 1
    assert late["auc"] == served["auc"]


def test_serve_dtype_names_the_allowed_types() -> None:
    with pytest.raises(config_file.ConfigError, match=r"serve\.dtype must be one of"):
        config_file.load(JobConfig, REPO / "configs/demo.yaml", ["serve.dtype=int3"])
    with pytest.raises(config_file.ConfigError, match=r"serve\.interval_s must be > 0"):
        config_file.load(JobConfig, REPO / "configs/demo.yaml", ["serve.interval_s=0"])
    with pytest.raises(
        config_file.ConfigError, match=r"serve\.follower\.memory_budget_mb must be > 0"
    ):
        config_file.load(
            JobConfig, REPO / "configs/demo.yaml", ["serve.follower.memory_budget_mb=0"]
        )
    with pytest.raises(config_file.ConfigError, match=r"serve\.follower\.io must be null"):
        config_file.load(JobConfig, REPO / "configs/demo.yaml", ["serve.follower.io={threads: 4}"])
    # The section is the library's options, one key a field.
    config = config_file.load(
        JobConfig,
        REPO / "configs/demo.yaml",
        ["serve.follower.memory_budget_mb=8", "serve.follower.spill_dir=/tmp"],
    )
    assert config.serve.follower == FollowerOptions(memory_budget_mb=8.0, spill_dir="/tmp")
    assert config.serve.follower.memory_budget_bytes == 8 << 20
    with pytest.raises(config_file.ConfigError, match=r"bounds copy mode"):
        config_file.load(
            JobConfig,
            REPO / "configs/demo.yaml",
            ["serve.follower.memory_budget_mb=8", "serve.follower.swap=true"],
        )


def test_a_done_marker_older_than_the_serving_process_is_an_earlier_runs(tmp_path: Path) -> None:
    from cnr_train.serve import _done

    storage = open_storage(str(tmp_path / "ckpt"))
    storage.create()
    storage.write(DONE_MARKER, json.dumps({"step": 40, "finished_at": 100.0}).encode())
    assert _done(storage, since=200.0) is None
    assert _done(storage, since=50.0) == {"step": 40, "finished_at": 100.0}
