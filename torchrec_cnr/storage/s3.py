"""A checkpoint root in an S3-compatible object store: ``s3://bucket/prefix``.

Credentials, region and endpoint come from boto3's usual chain (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL`` for a store other
than AWS, ``~/.aws``).

A PUT is atomic and durable when it returns, so :meth:`S3Storage.make_durable` has
nothing to do. Conditional writes use S3's ``If-Match`` (compare-and-swap on the ETag) and
``If-None-Match: *`` (create only), which AWS S3 and most compatible stores honour; a
store that does not would return an error rather than overwrite silently.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from torchrec_cnr.storage.backend import ANY, PreconditionFailed, Storage, _Any, truncated

__all__ = ["S3Storage", "shared_client", "split_url"]

POOL_CONNECTIONS = 64
"""Connections the shared client keeps open: more than the I/O threads of the few I/O
contexts a process runs at once (8 each by default), so that none is dropped after use."""

KEPT_CLIENTS = 4
"""Clients kept for settings no longer current (their connections open): the oldest go."""

_clients: dict[tuple[object, ...], Any] = {}
_clients_lock = threading.Lock()


def shared_client() -> Any:
    """This process's S3 client for the environment's settings (the ``AWS_*`` variables),
    shared by every thread and root: boto3's clients are thread-safe, but building one
    costs some 5-100 ms of CPU (its service model, endpoint rules and credentials), which
    a client per thread and root paid again for each new reader, writer and follower
    update. A variable that changes (another endpoint, other credentials) gets a client of
    its own, and a forked child builds its own.

    Raises:
        RuntimeError: boto3 is not installed (``pip install torchrec_cnr[s3]``).
    """
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    key = (os.getpid(), env)
    client = _clients.get(key)
    if client is not None:
        return client
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise RuntimeError(
            "s3:// checkpoint roots need boto3: pip install 'torchrec_cnr[s3]'"
        ) from e
    with _clients_lock:  # boto3's sessions, which build clients, are not thread-safe
        client = _clients.get(key)
        if client is None:
            forked = [k for k in _clients if k[0] != key[0]]  # the parent's, before a fork
            for old in forked + list(_clients)[: max(0, len(_clients) - KEPT_CLIENTS)]:
                _clients.pop(old, None)
            config = Config(max_pool_connections=POOL_CONNECTIONS)
            client = _clients[key] = boto3.session.Session().client("s3", config=config)
    return client


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> ``(bucket, prefix)``.

    Raises:
        ValueError: no bucket or no prefix.
    """
    bucket, _, prefix = url.removeprefix("s3://").strip("/").partition("/")
    if not bucket or not prefix:
        raise ValueError(f"checkpoint path {url!r} must look like s3://bucket/prefix")
    return bucket, prefix


class S3Storage(Storage):
    """A prefix in an S3 bucket.

    Raises:
        ValueError: the URL has no bucket or no prefix.
        RuntimeError: boto3 is not installed (``pip install torchrec_cnr[s3]``).
    """

    request_bytes = 2 * 2**20
    """A GET costs milliseconds: 2 MB of gap is cheaper than another request."""
    many_requests = 32
    """About 0.1 s of GETs."""

    def __init__(self, url: str) -> None:
        bucket, prefix = split_url(url)
        self.url = url
        self.bucket = bucket
        self.prefix = prefix

    @property
    def _client(self) -> Any:
        return shared_client()

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if name else self.prefix

    def path(self, name: str) -> str:
        return f"s3://{self.bucket}/{self._key(name)}"

    def read(self, name: str) -> tuple[bytes, str] | None:
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self._key(name))
        except self._client.exceptions.NoSuchKey:
            return None
        with response["Body"] as body:
            return body.read(), response["ETag"]

    def read_into(self, name: str, offset: int, out: memoryview, cached: bool = False) -> None:
        if not len(out):
            return
        end = offset + len(out)
        try:
            response = self._client.get_object(
                Bucket=self.bucket, Key=self._key(name), Range=f"bytes={offset}-{end - 1}"
            )
        except self._client.exceptions.NoSuchKey as e:
            raise FileNotFoundError(f"{self.path(name)} does not exist") from e
        except self._client.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") != "InvalidRange":
                raise
            size = self._client.head_object(Bucket=self.bucket, Key=self._key(name))
            raise truncated(self.path(name), size["ContentLength"], offset, end) from e
        with response["Body"] as body:
            data = body.read()
        if len(data) != len(out):
            size = int(response.get("ContentRange", "/-1").rpartition("/")[2])
            raise truncated(self.path(name), size, offset, end)
        out[:] = data

    def write(self, name: str, data: bytes, expect: str | None | _Any = ANY) -> str:
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(name), "Body": data}
        if expect is None:
            args["IfNoneMatch"] = "*"
        elif expect is not ANY:
            args["IfMatch"] = expect
        try:
            response = self._client.put_object(**args)
        except self._client.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            # 412: the precondition failed; 404 with If-Match: the object is gone.
            if code in ("PreconditionFailed", "NoSuchKey") or status in (404, 412):
                raise PreconditionFailed(
                    f"{self.path(name)}: expected version {expect}, the store has another"
                ) from e
            raise
        return str(response["ETag"])

    def write_object(self, name: str, data: memoryview) -> None:
        self._client.put_object(Bucket=self.bucket, Key=self._key(name), Body=bytes(data))

    def stamp(self, name: str) -> str | None:
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self._key(name))
        except self._client.exceptions.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            raise
        return str(head["ETag"])

    def exists(self, name: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(name))
        except self._client.exceptions.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise
        return True

    def _list(self, prefix: str, delimiter: str | None = None) -> list[dict[str, Any]]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix, **({"Delimiter": delimiter} if delimiter else {})
        )
        return list(pages)

    def children(self) -> list[str]:
        start = f"{self.prefix}/"
        names = [
            p["Prefix"][len(start) :].rstrip("/")
            for page in self._list(start, "/")
            for p in page.get("CommonPrefixes", [])
        ]
        return sorted(names)

    def _objects(self, name: str) -> list[dict[str, Any]]:
        prefix = f"{self._key(name)}/" if name else f"{self.prefix}/"
        return [o for page in self._list(prefix) for o in page.get("Contents", [])]

    def delete(self, name: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=self._key(name))

    def delete_tree(self, name: str) -> None:
        keys = [{"Key": o["Key"]} for o in self._objects(name)]
        for i in range(0, len(keys), 1000):  # the most one request may delete
            self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[i : i + 1000]})

    def clear(self) -> None:
        self.delete_tree("")

    def tree_bytes(self, name: str) -> int:
        return sum(int(o["Size"]) for o in self._objects(name))

    def make_durable(self, name: str) -> None:
        return None  # a PUT is durable once it returns
