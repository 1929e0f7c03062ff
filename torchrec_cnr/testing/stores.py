"""Local servers of the object stores a root may live in, each in a process of its own on a
free loopback port: moto's S3, ``gcp-storage-emulator``'s GCS and Azurite's Azure Blob
Storage. The tests' store fixtures and the benchmarks start theirs here.

Each is a context manager that yields its URL once the server answers, and stops it after.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "AZURITE_ACCOUNT",
    "STARTED",
    "azurite_binary",
    "azurite_connection_string",
    "azurite_server",
    "gcs_server",
    "moto_server",
]

STARTED: dict[str, int] = {}
"""URL -> process of each server this process runs."""

AZURITE_ACCOUNT = (
    "devstoreaccount1",
    # Azurite's published development key (the same in every Azurite): not a secret.
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _serve(name: str, command: Callable[[int], list[str]], probe: str = "/") -> Iterator[str]:
    """Runs ``command(port)`` and yields ``http://127.0.0.1:port`` once a GET of ``probe``
    gets any HTTP answer.

    Raises:
        RuntimeError: it exited, or did not answer within 60 s.
    """
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix=f"cnr-{name}-") as cwd:
        server = subprocess.Popen(
            command(port), cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        STARTED[url] = server.pid
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(url + probe, timeout=1).close()
                    break
                except urllib.error.HTTPError:
                    break  # it answers
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        why = f"the {name} server at {url} did not start (exit {server.poll()})"
                        raise RuntimeError(why) from None
                    time.sleep(0.05)
            yield url
        finally:
            del STARTED[url]
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def moto_server() -> contextlib.AbstractContextManager[str]:
    """moto's S3 server (objects in memory, any credentials), lighter per request
    (:mod:`.moto_s3`)."""
    program = [sys.executable, str(Path(__file__).with_name("moto_s3.py"))]
    return _serve(
        "moto S3",
        lambda port: [*program, "-H", "127.0.0.1", "-p", str(port)],
        "/moto-api/",
    )


def gcs_server(preconditions: bool = True) -> contextlib.AbstractContextManager[str]:
    """``gcp-storage-emulator``'s GCS JSON API (objects in memory, no credentials), which
    refuses an upload whose ``ifGenerationMatch`` does not hold, as GCS does (see
    :mod:`.gcs_emulator`); with ``preconditions=False``, the stock emulator, which ignores it.

    gcsfs reaches it with ``endpoint_url=URL, token="anon"``, and with
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` set before gcsfs is imported (its default
    file system asks a gRPC API the emulator lacks what kind each bucket is).
    """
    if preconditions:  # by path: it needs nothing of this package
        program = [sys.executable, str(Path(__file__).with_name("gcs_emulator.py"))]
    else:
        program = [str(Path(sys.executable).with_name("gcp-storage-emulator"))]
    return _serve(
        "GCS emulator",
        lambda port: [*program, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
    )


def azurite_binary() -> str | None:
    """Azurite's blob server: the one ``scripts/setup_env.sh`` installs beside the virtual
    environment's Python, or one on ``PATH``; ``None`` if there is neither."""
    local = Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    return str(local) if local.exists() else shutil.which("azurite-blob")


def azurite_connection_string(url: str) -> str:
    """The connection string of the Azurite server at ``url`` (adlfs's ``connection_string``)."""
    account, key = AZURITE_ACCOUNT
    return (
        f"DefaultEndpointsProtocol=http;AccountName={account};AccountKey={key};"
        f"BlobEndpoint={url}/{account};"
    )


def azurite_server() -> contextlib.AbstractContextManager[str]:
    """Azurite's Azure Blob Storage (objects in memory, the development account).

    Raises:
        RuntimeError: Azurite is not installed (``scripts/setup_env.sh`` installs it where
            npm is).
    """
    binary = azurite_binary()
    if binary is None:
        raise RuntimeError("Azurite is not installed: run make setup where npm is")
    return _serve(
        "Azurite",
        lambda port: [
            binary,
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--inMemoryPersistence",
            "--silent",
            "--skipApiVersionCheck",
            "--loose",
        ],  # fmt: skip
    )
