"""Retention keeps what the last N chains need; checkpoint directory names round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_cnr.commit.retention import retire
from torchrec_cnr.manifest import Entry, Manifest
from torchrec_cnr.schema import CheckpointName, checkpoint_id, parse_checkpoint_id
from torchrec_cnr.storage import Storage, open_storage

GENERATION = 2


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    found = open_storage(str(tmp_path / "root"))
    found.create()
    return found


def _id(seq: int, generation: int = GENERATION) -> str:
    return checkpoint_id(seq, 100 * seq, generation)


def _entry(ckpt_id: str, chain: list[str]) -> Entry:
    name = parse_checkpoint_id(ckpt_id)
    assert name is not None
    return Entry(
        id=ckpt_id,
        seq=name.seq,
        step=name.step,
        kind="full" if len(chain) == 1 else "delta",
        policy="consecutive",
        chain=chain,
        sizes=[],
        world_size=1,
        tables={},
        dense={},
        shards=[],
        dense_checksums={},
        app_checksums=[],
        bytes=1,
    )


def _committed(storage: Storage, chains: list[list[str]]) -> Manifest:
    """A committed manifest of one checkpoint per chain (its last id), with their folders."""
    manifest = Manifest(checkpoints=[_entry(c[-1], c) for c in chains], writer_generation=2)
    manifest.save(storage)
    for chain in chains:
        _make_dir(storage, chain[-1])
    return manifest


def _make_dir(storage: Storage, name: str) -> None:
    storage.write_object(f"{name}/0/rows/s0.w", memoryview(b"rows"))


def _consecutive(storage: Storage) -> tuple[Manifest, list[str]]:
    """Two consecutive chains: a, a+b, a+b+c, then d, d+e."""
    a, b, c, d, e = (_id(i) for i in range(5))
    chains = [[a], [a, b], [a, b, c], [d], [d, e]]
    return _committed(storage, chains), [a, b, c, d, e]


def test_keep_last_drops_chains_no_kept_checkpoint_needs(storage: Storage) -> None:
    manifest, (a, b, c, d, e) = _consecutive(storage)
    assert sorted(retire(storage, manifest, 2, GENERATION)) == [a, b, c]
    assert [x.id for x in manifest.checkpoints] == [d, e]
    assert [x.id for x in Manifest.load(storage).checkpoints] == [d, e]  # saved first
    assert storage.children() == [d, e]


def test_a_kept_consecutive_delta_keeps_its_baseline_and_every_delta_before_it(
    storage: Storage,
) -> None:
    manifest, ids = _consecutive(storage)
    assert retire(storage, manifest, 3, GENERATION) == []  # c needs a and b
    assert [x.id for x in Manifest.load(storage).checkpoints] == ids
    assert storage.children() == ids


def test_a_delta_that_later_chains_skip_is_dropped(storage: Storage) -> None:
    a, b, c = (_id(i) for i in range(3))
    manifest = _committed(storage, [[a], [a, b], [a, c]])  # incremental: each on the baseline
    assert retire(storage, manifest, 1, GENERATION) == [b]
    assert storage.children() == [a, c]


def test_without_keep_last_every_committed_checkpoint_stays(storage: Storage) -> None:
    manifest, ids = _consecutive(storage)
    version = manifest.version
    assert retire(storage, manifest, None, GENERATION) == []
    assert storage.children() == ids
    assert Manifest.load(storage).version == version  # nothing to commit


def test_uncommitted_folders_of_older_generations_are_deleted(storage: Storage) -> None:
    manifest, ids = _consecutive(storage)
    older = _id(5, generation=1)
    format_1 = "000006-step0000000600"  # no generation: written before leases (0)
    for name in (older, format_1):
        _make_dir(storage, name)
    assert sorted(retire(storage, manifest, None, GENERATION)) == sorted([older, format_1])
    assert storage.children() == ids


def test_committed_folders_of_older_generations_stay(storage: Storage) -> None:
    old = _id(0, generation=1)
    manifest = _committed(storage, [[old], [old, _id(1)]])
    assert retire(storage, manifest, None, GENERATION) == []
    assert old in storage.children()


def test_uncommitted_folders_of_this_or_a_newer_generation_are_never_deleted(
    storage: Storage,
) -> None:
    manifest, ids = _consecutive(storage)
    in_flight = _id(5, generation=GENERATION)  # this writer's own save, not committed yet
    newer = _id(6, generation=GENERATION + 1)  # a job that took the root over
    for name in (in_flight, newer):
        _make_dir(storage, name)
    assert retire(storage, manifest, 1, GENERATION) == ids[:3]
    assert storage.children() == [*ids[3:], in_flight, newer]


def test_folders_and_files_that_are_not_checkpoints_are_left_alone(storage: Storage) -> None:
    manifest, ids = _consecutive(storage)
    storage.write_object("tensorboard/events", memoryview(b"x"))
    storage.write_object("000007-step0000000700-g0001.tmp/x", memoryview(b"x"))
    storage.write("lease.json", b"{}")
    retire(storage, manifest, 1, GENERATION)
    assert "tensorboard" in storage.children()
    assert "000007-step0000000700-g0001.tmp" in storage.children()
    assert storage.exists("lease.json") and storage.exists("manifest.json")


# Checkpoint directory names


def test_checkpoint_id_names_seq_step_generation_and_compaction() -> None:
    assert checkpoint_id(3, 500, 1) == "000003-step0000000500-g0001"
    assert checkpoint_id(3, 500, 1, compacted=True) == "000003-step0000000500-g0001-c"
    assert checkpoint_id(3, 500, 12345) == "000003-step0000000500-g12345"


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 999_999),
    st.integers(0, 9_999_999_999),
    st.integers(0, 99_999),
    st.booleans(),
)
def test_checkpoint_ids_parse_back_to_their_parts(
    seq: int, step: int, generation: int, compacted: bool
) -> None:
    name = checkpoint_id(seq, step, generation, compacted)
    assert parse_checkpoint_id(name) == CheckpointName(seq, step, generation, compacted)


def test_format_1_names_without_a_generation_parse_as_generation_0() -> None:
    assert parse_checkpoint_id("000003-step0000000500") == CheckpointName(3, 500, 0, False)
    assert parse_checkpoint_id("000003-step0000000500-c") == CheckpointName(3, 500, 0, True)


@pytest.mark.parametrize(
    "name",
    [
        "tensorboard",
        "000003-step500",
        "3-step0000000500-g0001",
        "000003-step0000000500-g",
        "000003-step0000000500-g0001.tmp",
        "000003-step0000000500-g0001-c-c",
        "x000003-step0000000500-g0001",
    ],
)
def test_other_names_are_not_checkpoints(name: str) -> None:
    assert parse_checkpoint_id(name) is None


def test_checkpoint_ids_past_a_million_checkpoints_still_parse() -> None:
    name = checkpoint_id(1_000_000, 12_345_678_901, 3)
    parsed = parse_checkpoint_id(name)
    assert parsed is not None
    assert (parsed.seq, parsed.step, parsed.generation) == (1_000_000, 12_345_678_901, 3)
