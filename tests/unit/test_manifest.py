"""The manifest contract: versioned, atomic, and bounded whatever the history (damage to
it: ``test_damage_unit.py``)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.faults import Fault, FaultyStorage
from torchrec_cnr import CheckpointConfig, ManifestError
from torchrec_cnr.commit.commit import CommitTarget, append
from torchrec_cnr.encoding import FP32, ShardRecord, StateInfo
from torchrec_cnr.manifest import (
    FORMAT_VERSION,
    DenseInfo,
    Entry,
    Keep,
    Manifest,
    Summary,
    TableShape,
)
from torchrec_cnr.manifest.store import TAIL
from torchrec_cnr.schema import checkpoint_id
from torchrec_cnr.selection.policy import Policy
from torchrec_cnr.storage import CountingStorage, Storage
from torchrec_cnr.storage.fs import FsStorage
from torchrec_cnr.tracking import ShardSpec


def _entry(seq: int, step: int, chain: list[str], nbytes: int) -> Entry:
    spec = ShardSpec("m.t", 0, "row_wise", 0, 0, 10, 4, 19, 4)
    record = ShardRecord(
        spec=spec,
        key="s0",
        saved_rows=3,
        all_rows=False,
        optimizer="EXACT_ADAGRAD",
        states={"momentum1": StateInfo("s0.momentum1", "element", "float32")},
        scalars={"iter": 7},
        format=FP32,
        parts=[],
        nbytes=60,
        checksums={"s0.w": 1, "s0.ids": 2, "s0.momentum1": 3},
    )
    return Entry(
        id=chain[-1],
        seq=seq,
        step=step,
        kind="full" if len(chain) == 1 else "delta",
        policy="consecutive",
        chain=chain,
        sizes=[],
        world_size=2,
        tables={"m.t": TableShape(19, 4)},
        dense={"over.weight": DenseInfo.of(torch.zeros(2, 3))},
        shards=[record],
        dense_checksums={"over.weight": 4},
        app_checksums=[5, 6],
        bytes=nbytes,
    )


def test_manifest_round_trips_and_names_its_format_version(tmp_path: Path) -> None:
    m = Manifest()
    for entry in (_entry(0, 10, ["a"], 100), _entry(1, 20, ["a", "b"], 10)):
        m.add(entry)
    m.save(FsStorage(tmp_path))
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["format_version"] == FORMAT_VERSION
    assert "shards" not in raw["checkpoints"][0]  # the detail is in the record
    loaded = Manifest.load(tmp_path)
    assert all(type(e) is Summary for e in loaded.checkpoints)  # records hold the detail
    assert loaded.checkpoints == m.checkpoints  # every typed field survives JSON
    assert loaded.steps() == [10, 20] and loaded.next_seq() == 2
    latest, first = loaded.find(None), loaded.find(10)
    assert latest is not None and latest.id == "b"
    assert first is not None and first.id == "a" and loaded.find(30) is None
    assert loaded.chain_bytes(latest) == 110
    assert loaded.record(latest) == m.record("b")
    assert loaded.checksums(latest) == {
        "0/rows/s0.w": 1,
        "0/rows/s0.ids": 2,
        "0/rows/s0.momentum1": 3,
        "0/dense/over.weight": 4,
        "0/app/blob": 5,
        "1/app/blob": 6,
    }
    assert loaded.needed_ids(1) == {"a", "b"}
    assert not list(tmp_path.glob(".manifest.json.*"))  # no temporary file left behind


def test_missing_manifest_means_no_checkpoint(tmp_path: Path) -> None:
    assert Manifest.load(tmp_path).latest() is None


def test_unknown_format_version_is_refused(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 99, "checkpoints": []}))
    with pytest.raises(ManifestError, match="format_version 99"):
        Manifest.load(tmp_path)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"policy": "weekly"}, "policy"),
        ({"interval_steps": 0}, "interval_steps"),
        ({"keep_last": 0}, "keep_last"),
        ({"baseline_rule": "x"}, "baseline_rule"),
        ({"path": ""}, "path"),
        ({"quantize": None}, r"quantize must be given as QuantizeConfig\(\.\.\.\)"),
        ({"io": {"threads": 4}}, r"io must be given as IOOptions\(\.\.\.\)"),
        ({"timeouts": 30}, r"timeouts must be given as Timeouts\(\.\.\.\)"),
    ],
)
def test_config_rejects_out_of_range_values_naming_the_field(kwargs: dict, field: str) -> None:
    args = {"path": "/tmp/x", **kwargs}
    with pytest.raises(ValueError, match=field):
        CheckpointConfig(**args)


def _commit_run(
    storage: Storage,
    count: int,
    start: int = 0,
    keep_last: int | None = None,
    policy: str = "intermittent",
) -> list[tuple[int, int]]:
    """Commits checkpoints ``start..start + count - 1`` as a job does, each with its
    record: intermittent (a baseline every 7th) or consecutive (one baseline, then a chain
    of every delta); returns, per commit, the bytes it read and wrote."""
    costs = []
    chain: list[str] = []
    for seq in range(start, start + count):
        ckpt_id = checkpoint_id(seq, 10 * seq, 0)
        if policy == "consecutive":
            chain = [*chain, ckpt_id]
        else:
            base = checkpoint_id(seq - seq % 7, 10 * (seq - seq % 7), 0)
            chain = [base] if base == ckpt_id else [base, ckpt_id]
        entry = dataclasses.replace(_entry(seq, 10 * seq, chain, 10), policy=policy)
        counting = CountingStorage(storage)
        append(CommitTarget(counting, Policy(policy), 0, keep_last), entry)  # type: ignore[arg-type]
        costs.append((counting.bytes_read, counting.bytes_written))
    return costs


@pytest.mark.parametrize("policy", ["intermittent", "consecutive"])
def test_a_commit_reads_and_writes_the_same_bytes_whatever_the_history(
    policy: str, tmp_path: Path
) -> None:
    storage = FsStorage(tmp_path)
    costs = _commit_run(storage, 300, policy=policy)
    # Steady once the first segment is sealed: the same sawtooth, whatever came before.
    early = costs[2 * TAIL : 2 * TAIL + 7 * TAIL]
    late = costs[-7 * TAIL :]
    for i in (0, 1):
        assert max(c[i] for c in late) <= 1.2 * max(c[i] for c in early), (early, late)
        assert sum(c[i] for c in late) <= 1.2 * sum(c[i] for c in early)
    assert (tmp_path / "manifest.json").stat().st_size < 2 * TAIL * 1000


def test_the_history_is_read_from_its_segments_and_a_chain_from_records(tmp_path: Path) -> None:
    storage = FsStorage(tmp_path)
    _commit_run(storage, 100)
    manifest = Manifest.load(tmp_path)
    assert len(manifest.tail) < 2 * TAIL and manifest.count() == 100
    latest = manifest.latest()
    assert latest is not None and latest.seq == 99 and manifest.next_seq() == 100
    # A chain's baseline older than the held summaries comes from its record alone.
    counting = CountingStorage(storage)
    reader = Manifest.load(counting)
    base = reader.by_id(checkpoint_id(98, 980, 0))
    assert base.step == 980 and reader.shards(base)[0].key == "s0"
    assert counting.requests <= 3  # the manifest, the record; no segment
    assert [e.seq for e in manifest.checkpoints] == list(range(100))
    assert manifest.steps() == [10 * i for i in range(100)]
    found = manifest.find(30)
    assert found is not None and manifest.shards(found)[0].checksums == {
        "s0.w": 1,
        "s0.ids": 2,
        "s0.momentum1": 3,
    }
    assert manifest.find_id(checkpoint_id(3, 30, 0)) is not None
    assert manifest.find_id(checkpoint_id(100, 1000, 0)) is None


def test_a_consecutive_chain_is_stored_by_parents_and_walked_back_when_read(
    tmp_path: Path,
) -> None:
    storage = FsStorage(tmp_path)
    _commit_run(storage, 60, policy="consecutive")
    ids = [checkpoint_id(seq, 10 * seq, 0) for seq in range(60)]
    record = json.loads((tmp_path / ids[-1] / "checkpoint.json").read_text())["entry"]
    assert "chain" not in record and (record["parent"], record["depth"]) == (ids[-2], 60)
    # A follower's idle poll and update plan read the summaries, not the chain.
    counting = CountingStorage(storage)
    counted = Manifest.load(counting)
    latest = counted.latest()
    assert latest is not None and latest.depth == 60 and latest.parent == ids[-2]
    assert latest.chain is None and counting.requests == 1
    # A restore's planning walks it back: from the records, or from the history once read.
    held = len(Manifest.load(tmp_path).tail)
    assert counted.chain(latest) == ids and counting.requests == 1 + 60 - held
    whole = Manifest.load(tmp_path)
    assert [e.id for e in whole.links(whole.checkpoints[-1])] == ids
    assert [whole.chain(e) for e in whole.checkpoints] == [ids[: i + 1] for i in range(60)]
    assert whole.by_id(ids[30]).depth == 31 and whole.by_id(ids[30]).parent == ids[29]


def test_a_format_5_manifest_gets_records_when_first_written(tmp_path: Path) -> None:
    data = Path(__file__).parents[1] / "data" / "format_v5" / "intermittent"
    root = shutil.copytree(data, tmp_path / "root")
    old = Manifest.load(root)
    assert old.read_format == 5
    entry = dataclasses.replace(old.record(old.checkpoints[-1]), id=checkpoint_id(6, 14, 1), seq=6)
    append(CommitTarget(FsStorage(root), Policy("intermittent"), 1, None), entry)
    new = Manifest.load(root)
    assert new.read_format == FORMAT_VERSION
    assert [e.id for e in new.checkpoints] == [e.id for e in old.checkpoints] + [entry.id]
    for before, after in zip(old.checkpoints, new.checkpoints, strict=False):
        assert after == before and new.record(after) == old.record(before)


def test_retention_rewrites_a_sealed_history_and_deletes_its_segments(tmp_path: Path) -> None:
    storage = FsStorage(tmp_path)
    _commit_run(storage, 30)
    assert len(list(tmp_path.glob("history-*.json"))) > 1
    _commit_run(storage, 1, start=30, keep_last=2)
    manifest = Manifest.load(tmp_path)
    kept = [checkpoint_id(s, 10 * s, 0) for s in (28, 29, 30)]  # 30's chain: [28, 30]
    assert [e.id for e in manifest.checkpoints] == kept
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == kept
    assert not list(tmp_path.glob("history-*.json"))  # three summaries: no segment
    _commit_run(storage, 20, start=31, keep_last=12)
    manifest = Manifest.load(tmp_path)
    assert manifest.history is not None and manifest.count() == len(manifest.checkpoints)
    named = set(manifest._segments)
    assert {p.name for p in tmp_path.glob("history-*.json")} == named


@dataclass
class _Hook:
    """A commit plug-in as compaction is one: it keeps ``keeps``, and lands ``lands``."""

    keeps: Keep | None = None
    lands: Entry | None = None

    def land(self, manifest: Manifest) -> None:
        if self.lands is not None:
            manifest.land(self.lands)

    def keep(self) -> Keep | None:
        return self.keeps


def _land(tmp_path: Path, count: int, compacted_seq: int) -> tuple[Manifest, list[str], str]:
    """A consecutive chain of ``count`` checkpoints (keep_last=2); a compaction of checkpoint
    ``compacted_seq`` runs while the later ones commit (it keeps its chain, and the
    checkpoints from it on out of the sealed history), then lands with the next, whose
    chain starts from it; one more builds on that."""
    storage = FsStorage(tmp_path)
    ids = [checkpoint_id(seq, 10 * seq, 0) for seq in range(count + 2)]
    target = CommitTarget(storage, Policy("consecutive"), 0, 2)
    keeping = _Hook(Keep(compacted_seq, frozenset(ids[: compacted_seq + 1])))
    for seq in range(count):
        append(target, _entry(seq, 10 * seq, ids[: seq + 1], 10), keeping)
    held = Manifest.load(tmp_path)
    assert set(ids[: compacted_seq + 1]) <= {e.id for e in held.checkpoints}, "kept for it"
    assert held.tail[0].seq <= compacted_seq, "nothing from it on is sealed"
    compacted = checkpoint_id(compacted_seq, 10 * compacted_seq, 0, compacted=True)
    landed = dataclasses.replace(
        _entry(compacted_seq, 10 * compacted_seq, [compacted], 10),
        compacted_from=ids[compacted_seq],
    )
    after = ids[compacted_seq + 1 : count + 1]
    append(target, _entry(count, 10 * count, [compacted, *after], 10), _Hook(lands=landed))
    append(target, _entry(count + 1, 10 * (count + 1), [compacted, *after, ids[-1]], 10))
    manifest = Manifest.load(tmp_path)
    latest = manifest.latest()
    assert latest is not None and latest.id == ids[-1]
    found = manifest.find(10 * compacted_seq)
    assert found is not None and found.id == compacted, "a restore of its step reads it"
    first = json.loads((tmp_path / after[0] / "checkpoint.json").read_text())["entry"]
    assert first["chain"] == [compacted, after[0]], "what linked to it links to the compaction"
    for i, ckpt_id in enumerate(after):  # from the summaries, and from the records alone
        assert manifest.chain(manifest.by_id(ckpt_id)) == [compacted, *after[: i + 1]]
    kept = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert kept == sorted({compacted, *after, ids[-1]}), "keep_last=2 retired the old chain"
    return manifest, ids, compacted


def test_a_compaction_lands_right_after_what_it_compacts(tmp_path: Path) -> None:
    manifest, ids, compacted = _land(tmp_path, 5, 2)
    assert [e.id for e in manifest.checkpoints] == [compacted, *ids[3:]]


def test_a_long_running_compaction_keeps_its_place_out_of_the_sealed_history(
    tmp_path: Path,
) -> None:
    count = 3 * TAIL
    manifest, ids, compacted = _land(tmp_path, count, 1)
    assert [e.id for e in manifest.checkpoints] == [compacted, *ids[2:]]
    reread = Manifest.load(CountingStorage(FsStorage(tmp_path)))
    assert reread.chain(reread.by_id(ids[count])) == [compacted, *ids[2 : count + 1]]


def test_a_landing_whose_manifest_write_fails_leaves_every_committed_chain_as_it_was(
    tmp_path: Path,
) -> None:
    # The landing rewrote the records of what links to the compacted checkpoint, then its
    # manifest write failed (a full disk, a takeover): the compaction never committed, and
    # its files go. Chains read from records alone, once those are sealed, must not name it.
    storage = FsStorage(tmp_path)
    ids = [checkpoint_id(seq, 10 * seq, 0) for seq in range(5 * TAIL)]
    target = CommitTarget(storage, Policy("consecutive"), 0, None)
    for seq in range(4):
        append(target, _entry(seq, 10 * seq, ids[: seq + 1], 10))
    compacted = checkpoint_id(1, 10, 0, compacted=True)
    landed = dataclasses.replace(_entry(1, 10, [compacted], 10), compacted_from=ids[1])
    full = CommitTarget(
        FaultyStorage(storage, Fault("write", "manifest.json")), target.policy, 0, None
    )
    with pytest.raises(OSError, match="injected"):
        append(full, _entry(4, 40, [compacted, *ids[2:5]], 10), _Hook(lands=landed))
    for ckpt_id in (compacted, ids[4]):
        storage.delete_tree(ckpt_id)  # the failed commit's files (remove_failed, the sweep)
    for seq in range(4, len(ids)):
        append(target, _entry(seq, 10 * seq, ids[: seq + 1], 10))
    reread = Manifest.load(CountingStorage(storage))
    assert ids[2] not in {e.id for e in reread.tail}, "sealed: its chain comes from records"
    assert reread.chain(reread.by_id(ids[-1])) == ids
    fresh = Manifest.load(storage)
    assert fresh.chain(fresh.by_id(ids[3])) == ids[:4], "walked back through ids[2]'s record"
