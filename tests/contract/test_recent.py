"""Format 4: every checkpoint records the rows that changed since the one before it.

For every policy, layout and a quantized root: between two consecutive committed
checkpoints, every row whose restored value differs is among the rows the later one
records as changed, and those are rows it stores. A restore that rewinds the job links
the next checkpoint to the restored one. Format 5: a cumulative delta stores those rows
last, after the others, staged lazily or eagerly.
"""

from __future__ import annotations

import pytest
import torch

from cnr_train.workload import TableSpec
from tests.jobs import make_job
from tests.multiprocess import run_ranks
from torchrec_cnr import QuantizeConfig, read_table
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.offline import list_checkpoints
from torchrec_cnr.read.chain import ChainReader
from torchrec_cnr.selection import POLICIES
from torchrec_cnr.serving.plan import changed_since

TABLES = [
    TableSpec("a", 600, 8, "table_wise"),
    TableSpec("b", 300, 8, "column_wise"),
    TableSpec("c", 401, 8, "row_wise"),
]


def _train_and_save(root: str, policy: str, quantized: bool, staging: str = "lazy") -> None:
    quantize = (
        QuantizeConfig(method="adaptive", bits=4, min_rows=0) if quantized else QuantizeConfig()
    )
    job = make_job(
        TABLES, root, seed=1, policy=policy, alpha=1.3, quantize=quantize, staging=staging
    )
    for step in range(2, 13, 2):
        job.train(2)
        job.ckpt.save(step)
    job.ckpt.close()


def _restore_and_go_on(root: str, policy: str) -> None:
    job = make_job(TABLES, root, seed=2, policy=policy, alpha=1.3)
    assert job.ckpt.restore(6) == 6
    job.train(2)
    job.ckpt.save(8)
    job.ckpt.close()


def _changed(root: str, step: int) -> dict[str, torch.Tensor]:
    with ChainReader.open(root, step) as chain:
        changed = changed_since(chain, chain.entry)
    assert changed is not None, "format 4 records every shard's changes"
    return changed


@pytest.mark.dist
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "adaptive4"])
@pytest.mark.parametrize("policy", POLICIES)
def test_each_checkpoint_records_every_row_that_changed_since_the_one_before(
    policy: str, quantized: bool, root: str
) -> None:
    run_ranks(2, _train_and_save, root, policy, quantized)
    manifest = Manifest.load(root)
    entries = [manifest.record(e) for e in manifest.checkpoints]
    assert entries[0].since is None
    for before, after in zip(entries, entries[1:]):
        assert after.since == before.id
        changed = _changed(root, after.step)
        for name, shape in after.tables.items():
            old = read_table(root, name, before.step)
            new = read_table(root, name, after.step)
            differ = torch.nonzero((old != new).any(dim=1)).flatten()
            listed = changed.get(name, torch.empty(0, dtype=torch.int64))
            assert bool(torch.isin(differ, listed).all()), (
                f"{name} step {after.step}: rows {differ[~torch.isin(differ, listed)][:5].tolist()} "
                "changed but are not recorded"
            )
            assert listed.numel() < shape.num_embeddings or after.kind == "full"
            assert differ.numel() > 0, "the test must see rows change"
    infos = list_checkpoints(root)
    assert all(i.rows_changed is not None and 0 < i.rows_changed for i in infos[1:])
    if policy != "consecutive":
        # A cumulative delta or a baseline stores more than what changed since the last one.
        assert any(i.rows_changed is not None and i.rows_changed < i.rows_saved for i in infos[1:])


@pytest.mark.dist
def test_a_checkpoint_after_a_restore_records_its_changes_since_the_restored_one(
    root: str,
) -> None:
    run_ranks(2, _train_and_save, root, "intermittent", False)
    run_ranks(2, _restore_and_go_on, root, "intermittent")
    manifest = Manifest.load(root)
    restored = next(e for e in manifest.checkpoints if e.step == 6)
    after = manifest.record(manifest.checkpoints[-1])
    assert after.step == 8 and after.since == restored.id
    changed = _changed(root, 8)
    for name in after.tables:
        old = read_table(root, name, 6)
        new = read_table(root, name, 8)
        differ = torch.nonzero((old != new).any(dim=1)).flatten()
        assert bool(torch.isin(differ, changed.get(name, torch.empty(0))).all())


def _ascending(ids: torch.Tensor) -> bool:
    return bool((ids[1:] > ids[:-1]).all())


@pytest.mark.dist
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "adaptive4"])
@pytest.mark.parametrize("staging", ["lazy", "eager"])
def test_a_cumulative_delta_stores_the_rows_changed_since_the_previous_checkpoint_last(
    staging: str, quantized: bool, root: str
) -> None:
    run_ranks(2, _train_and_save, root, "intermittent", quantized, staging)
    tails = 0
    manifest = Manifest.load(root)
    for entry in manifest.checkpoints:
        with ChainReader.open(root, entry.step) as chain:
            last = len(chain.links) - 1
            for rec in manifest.shards(entry):
                if rec.saved_rows == 0:
                    continue
                ids = chain.saved_ids(last, rec)
                if rec.recent != "tail":
                    assert _ascending(ids), (entry.step, rec.key, rec.recent)
                    continue
                assert entry.kind == "delta" and not rec.all_rows
                recent = chain.tensor(last, rec.spec.rank, rec.recent_name).to(torch.int64)
                start = rec.saved_rows - rec.recent_rows
                assert torch.equal(ids[start:], recent)
                assert _ascending(ids[:start]) and _ascending(recent)
                assert not bool(torch.isin(ids[:start], recent).any())
                tails += int(0 < start)
    assert tails > 0, "the test must see cumulative deltas with rows changed earlier"
