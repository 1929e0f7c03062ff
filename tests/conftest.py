"""Shared fixtures: checkpoint roots on a file system and on a real S3 server.

Every test writes checkpoint objects of 64 KB (see ``small_objects``).

The S3 server is moto's, started as a separate HTTP server process on a free loopback
port for the whole session; each test gets a bucket of its own. Clients find it through
``AWS_ENDPOINT_URL``, as they would a real store; the rank workers of
:mod:`tests.multiprocess` see the test's environment.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def small_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoint objects of 64 KiB instead of 64 MB (``IOOptions.object_mb``'s default
    comes from this variable): the test models' tensors are then written and read in
    several pieces each, in parallel, as production-sized tensors are. The rank workers
    of :mod:`tests.multiprocess` run each call with the test's environment."""
    if "TORCHREC_CNR_OBJECT_MB" not in os.environ:
        monkeypatch.setenv("TORCHREC_CNR_OBJECT_MB", "0.0625")


@pytest.fixture
def root(tmp_path: Path) -> str:
    """A fresh checkpoint root on the local file system (not created: the manager does)."""
    return str(tmp_path / "ckpt")


@pytest.fixture
def refs(tmp_path: Path) -> Path:
    """A folder for :mod:`tests.reference` copies of the model at saved steps."""
    path = tmp_path / "refs"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The URL of a moto S3 server running in its own process on loopback, started as the
    benchmarks start theirs."""
    from benchmarks.measure import moto_server  # torchrec's import only where S3 is used

    with moto_server() as url:
        yield url


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The environment pointing at the moto server; returns its URL."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)  # never a real profile or endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return s3_endpoint


@pytest.fixture
def s3_root(s3_env: str) -> str:
    """``s3://<fresh bucket>/ckpt`` on the moto server, with the environment pointing at it."""
    import boto3

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/ckpt"


@pytest.fixture(params=["fs", "s3"])
def any_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh checkpoint root on each storage backend in turn."""
    if request.param == "fs":
        return str(tmp_path / "ckpt")
    return str(request.getfixturevalue("s3_root"))
