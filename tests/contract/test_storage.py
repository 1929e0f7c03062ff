"""Every storage backend keeps the same promises: a conditional write replaces exactly
the version it expects, once; an object's stamp changes when it is replaced and only then;
folders list, measure and delete alike."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from torchrec_cnr import CheckpointConfig
from torchrec_cnr.storage import PreconditionFailed, open_storage


def test_a_conditional_write_replaces_only_the_version_it_expects(every_root: str) -> None:
    storage = open_storage(every_root)
    storage.create()
    assert storage.read("m.json") is None and not storage.exists("m.json")
    first = storage.write("m.json", b"one", expect=None)
    with pytest.raises(PreconditionFailed):
        storage.write("m.json", b"again", expect=None)
    second = storage.write("m.json", b"two", expect=first)
    assert second != first
    with pytest.raises(PreconditionFailed):
        storage.write("m.json", b"stale", expect=first)
    assert storage.read("m.json") == (b"two", second)
    storage.write("m.json", b"whatever")  # no precondition
    assert storage.read("m.json") is not None and storage.exists("m.json")
    storage.delete("m.json")
    assert storage.read("m.json") is None


def test_a_stamp_changes_when_the_object_is_replaced_and_only_then(every_root: str) -> None:
    storage = open_storage(every_root)
    storage.create()
    assert storage.stamp("m.json") is None
    storage.write("m.json", b"one")
    first = storage.stamp("m.json")
    assert first is not None and storage.stamp("m.json") == first
    storage.read("m.json")
    assert storage.stamp("m.json") == first, "a read changes nothing"
    storage.write("m.json", b"two, longer")
    assert storage.stamp("m.json") not in (None, first)
    storage.delete("m.json")
    assert storage.stamp("m.json") is None


def test_of_many_concurrent_conditional_writers_exactly_one_wins(every_root: str) -> None:
    storage = open_storage(every_root)
    storage.create()
    base = storage.write("lease.json", b"0", expect=None)

    def attempt(i: int) -> bool:
        try:
            storage.write("lease.json", str(i + 1).encode(), expect=base)
        except PreconditionFailed:
            return False
        return True

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(attempt, range(16)))
    assert sum(won) == 1
    data, _ = storage.read("lease.json") or (b"", "")
    assert data == str(won.index(True) + 1).encode()


def test_folders_list_measure_and_delete(every_root: str) -> None:
    storage = open_storage(every_root)
    storage.create()
    storage.write("a/x", b"12345")
    storage.write("a/y/z", b"123")
    storage.write("b/w", b"1")
    storage.write("top", b"file, not a folder")
    assert storage.children() == ["a", "b"]
    assert storage.tree_bytes("a") == 8 and storage.tree_bytes("b") == 1
    storage.make_durable("a")
    storage.delete_tree("a")
    assert storage.children() == ["b"] and storage.read("a/x") is None
    storage.clear()
    assert storage.children() == [] and storage.read("top") is None


def test_a_folder_another_deleter_empties_meanwhile_is_deleted_without_an_error(
    fsspec_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A taken-over job removes its failed checkpoint while the new writer sweeps it.
    storage, other = open_storage(fsspec_root), open_storage(fsspec_root)
    storage.create()
    for i in range(3):
        storage.write(f"a/{i}", b"x")
    listed = storage._files  # type: ignore[attr-defined]

    def listed_then_deleted_by_the_other(name: str) -> dict[str, object]:
        found = listed(name)
        other.delete_tree(name)  # another deleter gets there first
        return found  # type: ignore[no-any-return]

    monkeypatch.setattr(storage, "_files", listed_then_deleted_by_the_other)
    storage.write("b/0", b"x")
    storage.delete_tree("a")
    assert storage.children() == ["b"] and storage.read("a/1") is None


def test_a_read_past_an_objects_end_names_its_real_length(every_root: str) -> None:
    storage = open_storage(every_root)
    storage.create()
    storage.write("o", bytes(1000))
    out = memoryview(bytearray(100))
    for offset in (950, 2000):  # ending past it, and starting past it
        with pytest.raises(OSError, match=rf"holds 1000 bytes, fewer than the {offset + 100}"):
            storage.read_into("o", offset, out)


def test_unsupported_roots_are_refused_naming_what_works() -> None:
    with pytest.raises(ValueError, match="fsspec cannot open nosuch://"):
        open_storage("nosuch://bucket/run")
    for url in ("s3://bucket-only", "gs://bucket-only/", "az://container"):
        scheme = url.partition(":")[0]
        with pytest.raises(ValueError, match=f"must look like {scheme}://bucket/prefix"):
            open_storage(url)
    with pytest.raises(ValueError, match="a file system path takes none"):
        open_storage("/ckpt/run", storage_options={"key": "x"})
    # A config is checked as it is built, not when a manager opens its root; a protocol
    # whose package is missing names the extra that installs it (pyarrow is not installed).
    with pytest.raises(ValueError, match=r"pip install 'torchrec_cnr\[hdfs\]'"):
        CheckpointConfig(path="hdfs://namenode/run")
    with pytest.raises(ValueError, match="storage_options must be a dict"):
        CheckpointConfig(path="gs://bucket/run", storage_options="key=x")  # type: ignore[arg-type]


def test_s3_roots_share_one_client_per_process_until_the_settings_change(
    s3_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """boto3's clients are thread-safe and cost milliseconds of CPU to build: every thread
    and root of a process uses one, and other ``AWS_*`` settings get one of their own."""
    from torchrec_cnr.storage.s3 import shared_client

    a, b = open_storage(s3_root), open_storage(s3_root)
    a.create()
    a.write("x", b"1")
    with ThreadPoolExecutor(16) as pool:
        clients = set(pool.map(lambda _: id(shared_client()), range(64)))
        reads = list(pool.map(lambda i: (a if i % 2 else b).read("x"), range(64)))
    assert len(clients) == 1
    assert [r[0] for r in reads if r is not None] == [b"1"] * 64
    first = shared_client()
    key = os.environ["AWS_ACCESS_KEY_ID"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone-else")
    assert shared_client() is not first
    assert (a.read("x") or (b"",))[0] == b"1"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    assert shared_client() is first
