"""The checkpoint directory format: written by our parallel writer, read by torchsnapshot's
own reader and by ours, with whole-tensor checksums combined from the pieces'."""

from __future__ import annotations

import itertools
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torchsnapshot import Snapshot, StateDict
from torchsnapshot.manifest import ChunkedTensorEntry, SnapshotMetadata, TensorEntry

from tests.faults import SlowReads
from torchrec_cnr.errors import CheckpointReadError, ChecksumError
from torchrec_cnr.snapshot import (
    RankPart,
    SnapshotReader,
    SnapshotWriter,
    app_path,
    crc32,
    crc32_combine,
    dense_path,
    rows_path,
    write_index,
)
from torchrec_cnr.snapshot import reader as snapshot_reader
from torchrec_cnr.snapshot import writer as snapshot_writer
from torchrec_cnr.snapshot.index import ChunkedTensorEntry as IndexChunks
from torchrec_cnr.snapshot.index import OtherEntry, PrimitiveEntry, index_part, parse_index
from torchrec_cnr.snapshot.index import TensorEntry as IndexTensor
from torchrec_cnr.snapshot.reader import _spans, span_bytes
from torchrec_cnr.storage import CountingStorage, Storage, open_storage

IO = ThreadPoolExecutor(4, thread_name_prefix="test-io")
PIECE = 32 << 10  # bytes per object and per read: the tensors below span several


@pytest.mark.parametrize("sizes", [(0, 5), (5, 0), (1, 1), (1000, 3333), (7, 1 << 20)])
def test_combined_crc32_is_the_crc32_of_the_concatenation(sizes: tuple[int, int]) -> None:
    a, b = os.urandom(sizes[0]), os.urandom(sizes[1])
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        rows_path(0, "s0.w"): torch.randn(3000, 16, generator=g),  # 192 KB: several objects
        rows_path(0, "s0.ids"): torch.arange(7, 3007, dtype=torch.int32),
        rows_path(1, "s1.w"): torch.randn(500, 8, generator=g).to(torch.bfloat16),
        rows_path(1, "s1.momentum1"): torch.rand(500, generator=g),
        dense_path("over.weight"): torch.randn(4, 3, generator=g),
        dense_path("steps"): torch.tensor(12, dtype=torch.int64),  # 0-d
    }


def _write(root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, int], str]:
    """Two writers (ranks) of one directory; rank 1's momentum arrives in chunks, backwards."""
    storage = open_storage(str(root))
    storage.create()
    tensors = _tensors()
    parts, checksums = [], {}
    for rank in (0, 1):
        writer = SnapshotWriter(storage, "ckpt", str(rank), IO, PIECE)
        for logical, t in tensors.items():
            if not logical.startswith(f"{rank}/") or logical.startswith("0/dense") and rank:
                continue
            if logical.endswith("momentum1"):
                for row0 in (400, 200, 0):  # chunks staged one after another, any order
                    writer.write(logical, t[row0 : row0 + 200], row0, total_rows=500)
            else:
                writer.write(logical, t, replicated=logical.startswith("0/dense"))
        writer.add_bytes(app_path(rank), f"app of rank {rank}".encode())
        part = writer.finish()
        parts.append(part.index)
        checksums.update(part.checksums)
    write_index(storage, "ckpt", parts, world_size=2)
    return checksums, str(root / "ckpt")


def test_what_the_writer_writes_torchsnapshot_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checksums, path = _write(tmp_path, monkeypatch)
    tensors = _tensors()
    snapshot = Snapshot(path)
    for logical, t in tensors.items():
        got: torch.Tensor = snapshot.read_object(logical)
        assert got.dtype == t.dtype and torch.equal(got, t), logical
        assert checksums[logical] == crc32(t), logical
    assert snapshot.read_object(app_path(1)) == b"app of rank 1"
    # Rank 0's big tensor went into several objects; small ones were packed together.
    entry = snapshot.get_manifest()[rows_path(0, "s0.w")]
    assert isinstance(entry, ChunkedTensorEntry) and len(entry.chunks) >= 6
    locations = {e.location for e in snapshot.get_manifest().values() if isinstance(e, TensorEntry)}
    assert len(locations) < len(tensors)


def test_our_index_reads_torchsnapshots_own_and_writes_each_entry_back_as_it_was(
    tmp_path: Path,
) -> None:
    # torchsnapshot's package is not imported to read or write an index
    # (torchrec_cnr.snapshot.index): its own snapshot, read by both, entry by entry.
    values = {"n": 3, "s": "x", "f": 1.5, "b": True, "raw": b"\x00\x01"}
    state = StateDict(
        t=torch.randn(5, 3), big=torch.randn(4096, 64), obj={"k": [1, 2]}, pickled={1, 2}, **values
    )
    Snapshot.take(str(tmp_path / "snap"), {"app": state})
    data = (tmp_path / "snap" / ".snapshot_metadata").read_bytes()
    raw = json.loads(data)["manifest"]
    theirs = SnapshotMetadata.from_yaml(data.decode()).manifest
    ours = parse_index(data)
    assert ours.keys() == theirs.keys() == raw.keys()
    for path, entry in ours.items():
        assert entry.type == theirs[path].type, path
        if not isinstance(entry, OtherEntry):  # an untyped entry keeps its tag alone
            again = json.loads(b"{" + index_part({path: entry}).entries + b"}")[path]
            assert again == raw[path], path
    kinds = {type(e).__name__ for e in ours.values()}
    assert kinds >= {"TensorEntry", "DictEntry", "ObjectEntry", "PrimitiveEntry"}, kinds
    for key, value in values.items():
        entry = ours[f"0/app/{key}"]
        assert isinstance(entry, PrimitiveEntry) and entry.value() == value, key


def test_torchsnapshot_reads_stored_tensors_but_restores_no_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What docs/design.md says torchsnapshot can and cannot do with our checkpoints."""
    _, path = _write(tmp_path, monkeypatch)
    snapshot = Snapshot(path)
    assert torch.equal(snapshot.read_object(rows_path(0, "s0.w")), _tensors()[rows_path(0, "s0.w")])
    model = torch.nn.Linear(4, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(AssertionError, match="model is absent in both manifest and flattened"):
        snapshot.restore({"model": model})
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_our_reader_checks_every_piece_and_reads_rows_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checksums, _ = _write(tmp_path, monkeypatch)
    storage = open_storage(str(tmp_path))
    reader = SnapshotReader(storage, "ckpt", IO, PIECE, checksums)
    tensors = _tensors()
    got = reader.read_many([(0, "s0.w"), (1, "s1.momentum1"), (0, "s0.ids")])
    assert torch.equal(got[(0, "s0.w")], tensors[rows_path(0, "s0.w")])
    assert torch.equal(got[(1, "s1.momentum1")], tensors[rows_path(1, "s1.momentum1")])
    assert torch.equal(reader.dense("steps"), tensors[dense_path("steps")])
    # Rows alone, across object boundaries (runs split where an object ends).
    index = torch.tensor([0, 1, 2, 511, 512, 513, 2047, 2048, 2999])
    assert torch.equal(reader.rows_subset(0, "s0.w", index), tensors[rows_path(0, "s0.w")][index])
    # One flipped byte in one piece of one object.
    chunked = reader._entries[rows_path(0, "s0.w")]
    assert isinstance(chunked, IndexChunks)
    entry = chunked.chunks[3].tensor
    target = tmp_path / "ckpt" / entry.location
    data = bytearray(target.read_bytes())
    assert entry.byte_range is not None
    data[entry.byte_range[0] + 100] ^= 0x40
    target.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"ckpt/0/rows/s0.w is corrupt"):
        SnapshotReader(storage, "ckpt", IO, PIECE, checksums).rows(0, "s0.w")
    assert torch.equal(  # the other tensors are intact
        SnapshotReader(storage, "ckpt", IO, PIECE, checksums).rows(1, "s1.w"),
        tensors[rows_path(1, "s1.w")],
    )


def test_a_damaged_index_is_named_in_a_line_not_with_every_byte_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte of ``.snapshot_metadata`` that is not UTF-8: the error names the file and
    where it failed, not the whole file (which a decoding error carries)."""
    checksums, _ = _write(tmp_path, monkeypatch)
    index = tmp_path / "ckpt" / ".snapshot_metadata"
    data = bytearray(index.read_bytes())
    at = len(data) // 2
    data[at] = 0x87
    index.write_bytes(bytes(data))
    with pytest.raises(CheckpointReadError) as failed:
        SnapshotReader(open_storage(str(tmp_path)), "ckpt", IO, PIECE, checksums)
    message = str(failed.value)
    assert f"ckpt/.snapshot_metadata is damaged: UnicodeDecodeError: not utf-8 at byte {at}" in (
        message
    ), message
    assert len(message) < 400, message


def _in_blocks(root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Storage, RankPart]:
    """Rank 0's ``s0.w`` alone, in checksummed blocks of 128 rows."""
    monkeypatch.setattr(snapshot_writer, "BLOCK_BYTES", 8 << 10)  # 128 rows of s0.w
    storage = open_storage(str(root))
    storage.create()
    writer = SnapshotWriter(storage, "ckpt", "0", IO, PIECE)
    writer.write(rows_path(0, "s0.w"), _tensors()[rows_path(0, "s0.w")])
    part = writer.finish()
    write_index(storage, "ckpt", [part.index], world_size=1)
    return storage, part


def test_rows_in_a_window_are_read_and_checked_in_their_blocks_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, part = _in_blocks(tmp_path, monkeypatch)
    logical = rows_path(0, "s0.w")
    whole = _tensors()[logical]
    assert part.checksums[logical] == crc32(whole)  # combined from the blocks'
    blocks = part.blocks[logical]
    assert blocks[0] == 128 and len(blocks) == 1 + 6 * 4  # 6 objects of 4 blocks (3000 rows)
    counting = CountingStorage(storage)
    reader = SnapshotReader(counting, "ckpt", IO, PIECE, part.checksums)
    row_bytes = 16 * 4
    for lo, hi in [(0, 1), (100, 700), (511, 513), (2999, 3000), (0, 3000)]:
        before = counting.bytes_read
        got = reader.rows_window(0, "s0.w", lo, hi, blocks)
        assert got is not None and torch.equal(got, whole[lo:hi]), (lo, hi)
        assert counting.bytes_read - before <= (hi - lo + 2 * 128) * row_bytes, (lo, hi)
    assert reader.rows_window(0, "s0.w", 0, 10, None) is None  # several blocks, no sums
    # One flipped byte in rows 1024..1151 (the third object's first block).
    chunked = reader._entries[logical]
    assert isinstance(chunked, IndexChunks)
    entry = next(c.tensor for c in chunked.chunks if c.offsets[0] == 1024)
    assert entry.byte_range is not None
    target = tmp_path / "ckpt" / entry.location
    data = bytearray(target.read_bytes())
    data[entry.byte_range[0] + 100] ^= 0x40
    target.write_bytes(bytes(data))
    got = reader.rows_window(0, "s0.w", 900, 1024, blocks)  # beside it: intact
    assert got is not None and torch.equal(got, whole[900:1024])
    with pytest.raises(ChecksumError, match=r"ckpt/0/rows/s0.w is corrupt"):
        reader.rows_window(0, "s0.w", 1100, 1101, blocks)


def test_a_window_read_into_place_fails_only_once_every_block_has_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A restore reads windows straight into the model: no block may be read into it after
    # the window's read failed (the restore then falls back to an older checkpoint).
    storage, part = _in_blocks(tmp_path, monkeypatch)
    reader = SnapshotReader(storage, "ckpt", IO, PIECE, part.checksums)
    chunked = reader._entries[rows_path(0, "s0.w")]
    assert isinstance(chunked, IndexChunks)
    first = next(c.tensor.location for c in chunked.chunks if not c.offsets[0])
    gone = SlowReads(storage, lambda name: name.endswith(first))
    reader = SnapshotReader(gone, "ckpt", IO, PIECE, part.checksums)
    into = torch.zeros(3000, 16)
    finish = reader.begin_window(0, "s0.w", 0, 3000, part.blocks[rows_path(0, "s0.w")], out=into)
    assert finish is not None
    reader.flush()
    with pytest.raises(CheckpointReadError, match="its object is gone"):
        finish()
    gone.assert_none_ends_later()  # none is read into ``into`` after


def test_a_tensor_whose_chunks_leave_a_gap_is_refused(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    storage.create()
    writer = SnapshotWriter(storage, "ckpt", "0", IO, PIECE)
    writer.write("0/rows/s0.w", torch.zeros(10, 4), row0=0, total_rows=30)
    writer.write("0/rows/s0.w", torch.zeros(10, 4), row0=20, total_rows=30)
    with pytest.raises(ValueError, match=r"rows 10..20 were never written"):
        writer.finish()


@pytest.mark.parametrize("extra", [0.0, 0.15, 1.0, 10.0])
def test_rows_read_alone_merge_nearby_runs_within_their_budget_and_stay_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: float
) -> None:
    checksums, _ = _write(tmp_path, monkeypatch)
    storage = open_storage(str(tmp_path))
    reader = SnapshotReader(storage, "ckpt", IO, PIECE, checksums)
    whole = _tensors()[rows_path(0, "s0.w")]
    gen = torch.Generator().manual_seed(5)
    index = torch.unique(torch.randint(0, whole.shape[0], (400,), generator=gen))
    assert torch.equal(reader.rows_subset(0, "s0.w", index, extra), whole[index])
    segment = torch.zeros_like(index)
    spans = _spans(index, segment, extra)
    skipped = sum(int(index[b - 1] - index[a]) + 1 - (b - a) for a, b in spans)
    assert skipped <= extra * index.numel()
    runs = int(((index[1:] != index[:-1] + 1).sum()) + 1)
    if extra == 0.0:
        assert len(spans) == runs  # one request per run of consecutive rows
    else:
        assert len(spans) < runs  # nearby runs merged


@pytest.mark.parametrize("merge_rows", [1, 8, 100])
def test_many_runs_closer_than_a_request_are_merged(merge_rows: int) -> None:
    gen = torch.Generator().manual_seed(6)
    index = torch.unique(torch.randint(0, 50000, (3000,), generator=gen))
    segment = (index >= 25000).to(torch.int64)  # two stored objects
    assert len(_spans(index, segment, 0.0)) > 64
    spans = _spans(index, segment, 0.0, merge_rows, many=64)
    for (_, b), (a, _) in zip(spans, spans[1:]):
        gap = int(index[a] - index[b - 1]) - 1
        assert gap > merge_rows or segment[a] != segment[b - 1], (gap, merge_rows)
    assert all(bool((segment[a:b] == segment[a]).all()) for a, b in spans), "one object each"
    assert sorted(i for a, b in spans for i in range(a, b)) == list(range(index.numel()))


def test_a_few_runs_are_not_merged_beyond_the_byte_budget() -> None:
    index = torch.arange(0, 4000, 40)  # 100 runs, 39 rows apart
    segment = torch.zeros_like(index)
    assert len(_spans(index, segment, 0.0, merge_rows=1000, many=128)) == index.numel()


def test_a_merged_span_is_read_in_pieces_as_large_as_a_request_is_costly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows scattered through a tensor, merged into spans, read exactly whether a span takes
    one read or many; a store whose requests cost more reads it in fewer, larger ones."""
    checksums, _ = _write(tmp_path, monkeypatch)
    monkeypatch.setattr(snapshot_reader, "SPAN_BYTES", 1024)
    whole = _tensors()[rows_path(0, "s0.w")]
    index = torch.arange(0, whole.shape[0], 3)  # every third row: one span per object
    reads = {}
    for request_bytes in (0, 4096):
        storage = CountingStorage(open_storage(str(tmp_path)))
        storage.request_bytes = request_bytes
        assert span_bytes(storage) == max(1024, 16 * request_bytes)
        reader = SnapshotReader(storage, "ckpt", IO, PIECE, checksums)
        before = storage.requests
        assert torch.equal(reader.rows_subset(0, "s0.w", index, extra=10.0), whole[index])
        reads[request_bytes] = storage.requests - before
    # 1 KB pieces, then 64 KB ones: every object of PIECE bytes in one read.
    objects = -(-whole.numel() * whole.element_size() // PIECE)
    assert reads[4096] == objects < reads[0]


def test_a_failed_piece_raises_only_once_every_other_piece_has_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tensor read into the live model must not be written into after its read failed.
    checksums, _ = _write(tmp_path, monkeypatch)
    calls = itertools.count()
    first_fails = SlowReads(open_storage(str(tmp_path)), lambda name: next(calls) == 0)
    reader = SnapshotReader(first_fails, "ckpt", IO, PIECE, checksums)
    with pytest.raises(CheckpointReadError, match="its object is gone"):
        reader.rows(0, "s0.w")
    first_fails.assert_none_ends_later()


def test_read_many_raises_only_once_every_tensor_it_began_has_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A restore reads its baseline into the staging buffers, which the next save stages
    # into: no tensor may still be read into them after the restore failed.
    checksums, _ = _write(tmp_path, monkeypatch)
    entry = SnapshotReader(open_storage(str(tmp_path)), "ckpt", IO, PIECE, checksums)._entries[
        rows_path(1, "s1.momentum1")
    ]
    assert isinstance(entry, IndexChunks)
    failing = {c.tensor.location for c in entry.chunks}
    gone = SlowReads(open_storage(str(tmp_path)), lambda name: any(map(name.endswith, failing)))
    reader = SnapshotReader(gone, "ckpt", IO, PIECE, checksums)
    with pytest.raises(CheckpointReadError, match="its object is gone"):
        reader.read_many([(1, "s1.momentum1"), (0, "s0.w")])
    gone.assert_none_ends_later()


def _small_tables(root: Path) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Twenty small tables of one rank, packed by the writer into a few objects."""
    storage = open_storage(str(root))
    storage.create()
    g = torch.Generator().manual_seed(3)
    tables = {f"t{i}": torch.randn(10 + i, 8, generator=g) for i in range(20)}
    writer = SnapshotWriter(storage, "ckpt", "0", IO, PIECE)
    for name, t in tables.items():
        writer.write(rows_path(0, name), t)
    part = writer.finish()
    write_index(storage, "ckpt", [part.index], world_size=1)
    return tables, part.checksums


def test_small_tensors_of_one_object_are_read_together_and_each_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tables, checksums = _small_tables(tmp_path)
    wanted = [(0, name) for name in tables]
    requests, together = {}, snapshot_reader.SMALL_BYTES
    for small in (together, 0):  # 0: each tensor read alone
        monkeypatch.setattr(snapshot_reader, "SMALL_BYTES", small)
        storage = CountingStorage(open_storage(str(tmp_path)))
        reader = SnapshotReader(storage, "ckpt", IO, PIECE, checksums)
        before = storage.requests
        got = reader.read_many(wanted)
        requests[small] = storage.requests - before
        for name, t in tables.items():
            assert torch.equal(got[(0, name)], t), name
        # A window's blocks and lone tensors too, through the same queue.
        window = reader.rows_window(0, "t7", 2, 9, None)
        assert window is not None and torch.equal(window, tables["t7"][2:9])
        assert torch.equal(reader.rows(0, "t3"), tables["t3"])
    locations = {e.location for e in reader._entries.values() if isinstance(e, IndexTensor)}
    assert requests[0] == len(tables) and requests[together] == len(locations)
    assert len(locations) < len(tables) // 4

    # One flipped byte names its own tensor; those read with it stay intact.
    entry = reader._entries[rows_path(0, "t11")]
    assert isinstance(entry, IndexTensor) and entry.byte_range is not None
    target = tmp_path / "ckpt" / entry.location
    data = bytearray(target.read_bytes())
    data[entry.byte_range[0] + 5] ^= 0x10
    target.write_bytes(bytes(data))
    monkeypatch.setattr(snapshot_reader, "SMALL_BYTES", together)
    reader = SnapshotReader(open_storage(str(tmp_path)), "ckpt", IO, PIECE, checksums)
    with pytest.raises(ChecksumError, match=r"ckpt/0/rows/t11 is corrupt"):
        reader.read_many(wanted)
    others = [key for key in wanted if key != (0, "t11")]
    assert all(torch.equal(v, tables[k[1]]) for k, v in reader.read_many(others).items())

    # A short object fails every tensor read from it, none left waiting.
    target.write_bytes(bytes(data[: entry.byte_range[0]]))
    reader = SnapshotReader(open_storage(str(tmp_path)), "ckpt", IO, PIECE, checksums)
    with pytest.raises(CheckpointReadError, match=entry.location):
        reader.read_many(wanted)
