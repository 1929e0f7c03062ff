"""CPR partial recovery: only the named ranks' (or tables') shards reload; the
rest of the model keeps its live state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cnr_train.workload import TableSpec
from tests import reference
from tests.jobs import make_job
from tests.multiprocess import run_ranks
from torchrec_cnr.tracking import model_state

TABLES = [
    TableSpec("a", 400, 16, "table_wise"),
    TableSpec("b", 300, 16, "column_wise"),
    TableSpec("c", 350, 16, "table_wise"),
    TableSpec("d", 250, 16, "table_wise"),
]


def _shards_equal(shards, snapshot) -> list[bool]:
    out = []
    for shard, (spec, weight, states) in zip(shards, snapshot, strict=True):
        assert shard.spec == spec
        out.append(
            torch.equal(shard.weight, weight)
            and all(torch.equal(shard.states[k], v) for k, v in states.items())
        )
    return out


def _partial(root: str, refs: str) -> None:
    rank = dist.get_rank()
    job = make_job(TABLES, root, seed=1, data_seed=3, batch_size=32, policy="consecutive")
    model, data, app, ckpt = job.model, job.data, job.app_state, job.ckpt
    job.train(4)
    ckpt.save(4)
    ckpt.wait()
    saved = reference.take(model, app)
    job.train(3)
    live = reference.take(model, app)
    shards = model_state.local_shards(model)
    assert not any(_shards_equal(shards, saved["shards"])), "training must have changed every shard"

    assert ckpt.restore(ranks=[1]) == 4
    expect = saved if rank == 1 else live
    assert all(_shards_equal(shards, expect["shards"])), f"rank {rank} shards"
    dense = model_state.dense_state(model)
    assert all(torch.equal(dense[k], v) for k, v in live["dense"].items()), (
        "dense state must stay live"
    )
    assert data.position == 7, "app_state must stay live"

    # Then one table everywhere: its shards reload on every rank, the rest stays as it is.
    before = reference.take(model, app)
    assert ckpt.restore(tables=["a"]) == 4
    for shard, b, s in zip(shards, before["shards"], saved["shards"], strict=True):
        want = s if shard.spec.table.endswith(".a") else b
        assert _shards_equal([shard], [want]) == [True], shard.spec.table
    with pytest.raises(ValueError, match=r"tables \['zz'\] are not in the model"):
        ckpt.restore(tables=["zz"])
    with pytest.raises(ValueError, match=r"ranks \[5\] are outside 0..1"):
        ckpt.restore(ranks=[5])
    # Training and checkpointing go on after a partial recovery, and the chain stays exact.
    job.train(1)
    ckpt.save(8)
    reference.save(reference.take(model, app), Path(refs), 8)
    ckpt.wait()
    fresh = make_job(TABLES, root, seed=9, data_seed=3, batch_size=32, policy="consecutive")
    assert fresh.ckpt.restore() == 8
    reference.assert_model_matches(fresh.model, fresh.app_state, reference.load_all(Path(refs), 8))


@pytest.mark.dist
def test_partial_restore_reloads_only_the_named_ranks_and_tables(any_root: str, refs: Path) -> None:
    run_ranks(2, _partial, any_root, str(refs))
