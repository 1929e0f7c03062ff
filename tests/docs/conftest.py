"""The docs tests' fixtures: the trained models the pages' stand-ins read, and the S3
server their ``s3://bucket`` lives on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from filelock import FileLock

from tests.docs import standins
from tests.multiprocess import run_ranks


@pytest.fixture(scope="session")
def docs_fixtures(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """Trained roots, DCP checkpoints and snapshots of each model (read-only), built once
    for the run: under xdist, by the first worker that asks, in the folder they share."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent
    folder = shared / "docs_fixtures"
    with FileLock(str(shared / "docs_fixtures.lock")):
        if not (folder / "built").exists():
            for kind in ("testsparsenn", "dlrm"):
                run_ranks(2, standins.make_trained, str(folder / kind), kind)
            (folder / "built").touch()
    return folder


@pytest.fixture
def docs_env(s3_env: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment the blocks run in: moto's S3 server, with ``s3://bucket``."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import boto3

    client = boto3.client("s3")
    if standins.BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=standins.BUCKET)
    return dict(os.environ)
