"""Restore maps rows by global id onto another sharding or world size, and
refuses a checkpoint of another model or with missing files without changing anything."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import reference
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointConfig, CheckpointManager, model_state
from torchrec_cnr.restore import ModelMismatchError
from torchrec_cnr.workload import TableSpec, ZipfBatches, build_model, dense_optimizer, train_step
from torchrec_cnr.writer import CheckpointReadError

MIXED = [
    TableSpec("a", 400, 16, "table_wise"),
    TableSpec("b", 300, 16, "column_wise"),
    TableSpec("c", 250, 16, "table_column_wise"),
    TableSpec("d", 120, 16, "data_parallel"),
]


def _resharded(tables: list[TableSpec], sharding: str) -> list[TableSpec]:
    return [dataclasses.replace(t, sharding=sharding) for t in tables]


def _job(tables, root: str, seed: int, policy: str = "intermittent"):
    model = build_model(tables, seed=seed)
    opt = dense_optimizer(model)
    app = {"reader": ZipfBatches(tables, batch_size=16, seed=2), "dense_opt": opt}
    return (
        model,
        opt,
        app,
        CheckpointManager(model, CheckpointConfig(path=root, policy=policy), app),
    )


def _save(tables, root: str, refs: str, steps: tuple[int, ...]) -> None:
    model, opt, app, ckpt = _job(tables, root, seed=1)
    for step in range(1, max(steps) + 1):
        train_step(model, opt, app["reader"].next(dist.get_rank()))
        if step in steps:
            ckpt.save(step)
            reference.save(reference.take(model, app), Path(refs), step)
    ckpt.wait()


def _restore_and_compare(tables, root: str, refs: str, step: int, check_states: bool) -> None:
    model, _, app, ckpt = _job(tables, root, seed=50)
    assert ckpt.restore(step=step) == step
    reference.assert_model_matches(model, app, reference.load_all(Path(refs), step), check_states)


@pytest.mark.dist
def test_two_rank_chain_restores_on_one_rank(tmp_path: Path) -> None:
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    run_ranks(2, _save, MIXED, root, str(refs), (2, 4, 6))
    run_ranks(1, _restore_and_compare, MIXED, root, str(refs), 6, True)
    run_ranks(1, _restore_and_compare, MIXED, root, str(refs), 4, True)


@pytest.mark.dist
@pytest.mark.parametrize(
    "saved,restored", [("table_wise", "column_wise"), ("column_wise", "table_wise")]
)
def test_chain_restores_onto_other_sharding(saved: str, restored: str, tmp_path: Path) -> None:
    tables = _resharded(MIXED[:3], saved)
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    run_ranks(2, _save, tables, root, str(refs), (2, 4))
    run_ranks(2, _restore_and_compare, _resharded(tables, restored), root, str(refs), 4, True)


def _refuses(tables, root: str, expected: type[Exception], needles: list[str]) -> None:
    model, _, app, ckpt = _job(tables, root, seed=77)
    before = reference.take(model, app)
    with pytest.raises(expected) as info:
        ckpt.restore()
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    after = model_state.local_shards(model)
    for (spec, weight, states), shard in zip(before["shards"], after):
        assert spec == shard.spec and torch.equal(weight, shard.weight)
        assert all(torch.equal(v, shard.states[k]) for k, v in states.items())
    dense = model_state.dense_state(model)
    assert all(torch.equal(v, dense[k]) for k, v in before["dense"].items())
    ckpt.close()


@pytest.mark.dist
def test_checkpoint_of_another_model_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    run_ranks(2, _save, MIXED, root, str(refs), (2,))
    other = [
        dataclasses.replace(MIXED[0], rows=410),
        *MIXED[1:],
        TableSpec("e", 50, 16, "table_wise"),
    ]
    needles = [
        "embedding_bag_collection.a' is 400x16 in the checkpoint but 410x16",
        "'sparse_arch.embedding_bag_collection.e' is in the model but not",
    ]
    run_ranks(2, _refuses, other, root, ModelMismatchError, needles)


@pytest.mark.dist
def test_missing_checkpoint_files_are_named_and_change_nothing(tmp_path: Path) -> None:
    root, refs = tmp_path / "ckpt", tmp_path / "refs"
    refs.mkdir()
    run_ranks(2, _save, MIXED, str(root), str(refs), (2, 4))
    baseline = sorted(p for p in root.iterdir() if p.is_dir())[0]
    shutil.rmtree(baseline)
    run_ranks(2, _refuses, MIXED, str(root), CheckpointReadError, [baseline.name])
