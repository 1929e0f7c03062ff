"""Shared fixtures: checkpoint roots on a file system and on real object store servers.

Every test writes checkpoint objects of 64 KB (see ``small_objects``).

The S3 server is moto's, started as a separate HTTP server process on a free loopback
port for the whole session; each test gets a bucket of its own. Clients find it through
``AWS_ENDPOINT_URL``, as they would a real store; the rank workers of
:mod:`tests.multiprocess` see the test's environment. ``every_root`` adds the fsspec
roots: S3 through s3fs (``s3a://``) on the same server, GCS through gcsfs on
``gcp-storage-emulator`` (refusing uploads whose ``ifGenerationMatch`` fails, as GCS
does), Azure Blob Storage through adlfs on Azurite; their options reach
every process through ``TORCHREC_CNR_STORAGE_OPTIONS``, as a job's would.
"""

from __future__ import annotations

import gc
import json
import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

# The GCS emulator speaks only the JSON API; gcsfs's default file system also asks a
# gRPC API what kind each bucket is (read when gcsfs is imported, in every process).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


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
    benchmarks start theirs (:mod:`torchrec_cnr.testing.stores`)."""
    from torchrec_cnr.testing.stores import moto_server

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


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    """The URL of a ``gcp-storage-emulator`` GCS server in its own process on loopback."""
    from torchrec_cnr.testing.stores import gcs_server

    with gcs_server() as url:
        yield url


@pytest.fixture(scope="session")
def lax_gcs_endpoint() -> Iterator[str]:
    """The URL of the stock ``gcp-storage-emulator``, which ignores ``ifGenerationMatch``."""
    from torchrec_cnr.testing.stores import gcs_server

    with gcs_server(preconditions=False) as url:
        yield url


@pytest.fixture(scope="session")
def azurite_endpoint() -> Iterator[str]:
    """The URL of an Azurite blob server in its own process on loopback."""
    from torchrec_cnr.testing.stores import azurite_binary, azurite_server

    if azurite_binary() is None:
        pytest.skip("Azurite is not installed (make setup installs it where npm is)")
    with azurite_server() as url:
        yield url


def _fsspec_root(
    protocol: str, options: Mapping[str, object], monkeypatch: pytest.MonkeyPatch
) -> str:
    """A fresh bucket (container) of an fsspec store, and the environment that opens it."""
    import fsspec

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem(protocol, **options).mkdir(bucket)
    monkeypatch.setenv("TORCHREC_CNR_STORAGE_OPTIONS", json.dumps(dict(options)))
    return f"{protocol}://{bucket}/ckpt"


def _root(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    monkeypatch = request.getfixturevalue("monkeypatch")
    if kind == "fs":
        return str(tmp_path / "ckpt")
    if kind == "s3":
        return str(request.getfixturevalue("s3_root"))
    if kind == "s3fs":  # the moto bucket, through s3fs; the endpoint from the environment
        return "s3a" + str(request.getfixturevalue("s3_root")).removeprefix("s3")
    if kind == "azure":
        from torchrec_cnr.testing.stores import azurite_connection_string

        url = request.getfixturevalue("azurite_endpoint")
        options = {"connection_string": azurite_connection_string(url)}
        return _fsspec_root("az", options, monkeypatch)
    url = request.getfixturevalue("lax_gcs_endpoint" if kind == "lax_gcs" else "gcs_endpoint")
    options = {"endpoint_url": url, "token": "anon", "project": "test"}
    return _fsspec_root("gs", options, monkeypatch)


@pytest.fixture(params=["fs", "s3"])
def any_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh checkpoint root on each storage backend in turn."""
    return _root(request.param, request, tmp_path)


@pytest.fixture(params=["s3fs", "azure", "gcs"])
def fsspec_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh checkpoint root on each fsspec store with a local server in turn."""
    return _root(request.param, request, tmp_path)


@pytest.fixture(params=["fs", "s3", "s3fs", "azure", "gcs"])
def every_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh checkpoint root on each backend and each fsspec store with a local server
    in turn: the fault tests' roots."""
    return _root(request.param, request, tmp_path)


def pytest_collectstart(collector: pytest.Collector) -> None:
    """Collections off while the test modules import TorchRec and the rest (see
    :func:`pytest_collection_finish`), where tests are collected (not in xdist's
    controller)."""
    gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collecting imported is frozen, then collections are on again: those objects
    live as long as the session, and collections while they were made would have found
    almost nothing to free."""
    gc.freeze()
    gc.enable()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """What a test left is collected once and the survivors (modules, session fixtures)
    frozen out of later collections: with TorchRec imported, each automatic full
    collection would walk them all again (as :mod:`tests.multiprocess`'s ranks do after
    each call, and the app before its loop: ``cnr_train.job.freeze_heap``)."""
    gc.collect()
    gc.freeze()
