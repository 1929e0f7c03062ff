"""Restore maps rows by global id onto another sharding or world size, and refuses a
checkpoint of another model without changing anything (missing or damaged files:
``test_damage.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from cnr_train.workload import TableSpec
from tests import reference
from tests.jobs import Job, assert_restore_refused, make_job, save_reference
from tests.multiprocess import run_ranks
from torchrec_cnr import ModelMismatchError
from torchrec_cnr.read import MemoryBudget
from torchrec_cnr.storage import CountingStorage, open_storage

MIXED = [
    TableSpec("a", 400, 16, "table_wise"),
    TableSpec("b", 300, 16, "column_wise"),
    TableSpec("c", 250, 16, "table_column_wise"),
    TableSpec("d", 120, 16, "data_parallel"),
]


def _resharded(tables: list[TableSpec], sharding: str) -> list[TableSpec]:
    return [dataclasses.replace(t, sharding=sharding) for t in tables]


def _job(tables: list[TableSpec], root: str, seed: int, **config: Any) -> Job:
    return make_job(tables, root, seed=seed, data_seed=2, policy="intermittent", **config)


def _save(tables, root: str, refs: str, steps: tuple[int, ...]) -> None:
    job = _job(tables, root, seed=1)
    for step in range(1, max(steps) + 1):
        job.train(1)
        if step in steps:
            job.ckpt.save(step)
            save_reference(job, refs, step)
    job.ckpt.close()


def _restore_and_compare(
    tables, root: str, refs: str, step: int, check_states: bool, warns: str | None = None
) -> None:
    job = _job(tables, root, seed=50)
    if warns is None:
        assert job.ckpt.restore(step=step) == step
    else:
        with pytest.warns(UserWarning, match=warns):
            assert job.ckpt.restore(step=step) == step
    reference.assert_model_matches(
        job.model, job.app_state, reference.load_all(Path(refs), step), check_states
    )


@pytest.mark.dist
def test_two_rank_chain_restores_on_one_rank(tmp_path: Path) -> None:
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    run_ranks(2, _save, MIXED, root, str(refs), (2, 4, 6))
    # Rank 1's app_state (its data reader's position, its dense optimizer) has no rank.
    dropped = r"the app_state of rank 1 \('reader', 'dense_opt'\) is not restored"
    run_ranks(1, _restore_and_compare, MIXED, root, str(refs), 6, True, dropped)
    run_ranks(1, _restore_and_compare, MIXED, root, str(refs), 4, True, dropped)


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
    assert_restore_refused(_job(tables, root, seed=77), expected, needles)


ROW_WISE = [TableSpec("r", 20000, 16, "row_wise"), TableSpec("s", 12000, 16, "row_wise")]


def _restore_counting(
    root: str, refs: str, step: int, out: str, budget_mb: float | None, held: bool = False
) -> None:
    import torch.distributed as dist

    other = MemoryBudget(None)
    if held:  # another read of the process (a compaction, say) holds all of the budget
        assert budget_mb is not None and other.take(int(budget_mb * 2**20))
    storage = CountingStorage(open_storage(root))
    job = _job(ROW_WISE, root, seed=50, storage=storage, restore_memory_mb=budget_mb)
    assert job.ckpt.restore(step=step) == step
    reference.assert_model_matches(
        job.model, job.app_state, reference.load_all(Path(refs), step), True
    )
    Path(out, f"rank{dist.get_rank()}").write_text(str(storage.bytes_read))


@pytest.mark.dist
def test_a_restore_reads_only_the_saved_shards_its_rows_come_from(tmp_path: Path) -> None:
    root, refs, out = str(tmp_path / "ckpt"), tmp_path / "refs", tmp_path / "out"
    refs.mkdir()
    out.mkdir()
    run_ranks(2, _save, ROW_WISE, root, str(refs), (2,))
    stored = sum(f.stat().st_size for f in Path(root).rglob("data/*"))
    run_ranks(2, _restore_counting, root, str(refs), 2, str(out), None)
    read = [int((out / f"rank{r}").read_text()) for r in range(2)]
    # Each rank's rows lie in its own saved shards: half the stored rows, not all of them.
    assert all(n < 0.6 * stored for n in read), (read, stored)
    assert sum(read) < 1.2 * stored, (read, stored)


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


TABLE_WISE = _resharded(ROW_WISE, "table_wise")
SMALL_OBJECTS = "0.0625"
"""MB (64 KiB): each table's weights stored in 20 and 12 blocks of rows, each with its checksum."""
BUDGETS = [None, 0.2]
"""``restore_memory_mb``: none (every window held), and less than one table's window (each
read twice: checked, then read again while applying, a block or so at a time)."""


@pytest.mark.dist
@pytest.mark.parametrize("budget_mb", BUDGETS)
def test_a_resharding_restore_reads_and_checks_only_the_blocks_its_rows_lie_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget_mb: float | None
) -> None:
    """Saved table-wise (each table whole on one rank), restored row-wise: each rank's
    half of every table is read in the blocks it lies in, not the saved shards whole
    (twice within a budget smaller than the half)."""
    monkeypatch.setenv("TORCHREC_CNR_OBJECT_MB", SMALL_OBJECTS)
    root, refs, out = str(tmp_path / "ckpt"), tmp_path / "refs", tmp_path / "out"
    refs.mkdir()
    out.mkdir()
    run_ranks(2, _save, TABLE_WISE, root, str(refs), (2,))
    stored = sum(f.stat().st_size for f in Path(root).rglob("data/*"))
    run_ranks(2, _restore_counting, root, str(refs), 2, str(out), budget_mb)
    read = [int((out / f"rank{r}").read_text()) for r in range(2)]
    passes = 1 if budget_mb is None else 2
    assert all(n < 0.6 * passes * stored for n in read), (read, stored)


@pytest.mark.dist
@pytest.mark.parametrize("budget_mb", BUDGETS)
@pytest.mark.parametrize("saved", ["table_wise", "column_wise"])
def test_a_chain_restores_row_wise_within_any_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved: str, budget_mb: float | None
) -> None:
    """A baseline and a delta (its rows by id) restored row-wise onto 2 ranks: each rank's
    rows read in windows, straight into place or in pieces (another column split, a
    delta's scattered ids) when read again within a small budget; exact either way."""
    monkeypatch.setenv("TORCHREC_CNR_OBJECT_MB", SMALL_OBJECTS)
    root, refs, out = str(tmp_path / "ckpt"), tmp_path / "refs", tmp_path / "out"
    refs.mkdir()
    out.mkdir()
    run_ranks(2, _save, _resharded(ROW_WISE, saved), root, str(refs), (2, 4))
    for step in (2, 4):
        run_ranks(2, _restore_counting, root, str(refs), step, str(out), budget_mb)


@pytest.mark.dist
def test_the_bound_of_every_read_bounds_a_restore_and_its_own_budget_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TORCHREC_CNR_READ_MEMORY_MB`` (``IOOptions.read_memory_mb``) under one table's
    window: a restore holds only what fits, so it reads its windows twice (checked, then
    again while applying), exactly; ``restore_memory_mb`` set wins over it, within what
    the process's other reads leave of it."""
    monkeypatch.setenv("TORCHREC_CNR_OBJECT_MB", SMALL_OBJECTS)
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    run_ranks(2, _save, TABLE_WISE, root, str(refs), (2,))
    read = {}
    for name, bound, own in (("unbounded", None, None), ("bounded", "0.2", None),
                             ("own", "0.2", 1000.0), ("shared", "0.2", 1000.0)):  # fmt: skip
        if bound is not None:
            monkeypatch.setenv("TORCHREC_CNR_READ_MEMORY_MB", bound)
        out = tmp_path / name
        out.mkdir()
        run_ranks(2, _restore_counting, root, str(refs), 2, str(out), own, name == "shared")
        read[name] = [int((out / f"rank{r}").read_text()) for r in range(2)]
    # Within what the process's other reads leave of the budget: none of it, as bounded.
    for name in ("bounded", "shared"):
        assert all(b > 1.8 * u for b, u in zip(read[name], read["unbounded"])), (name, read)
    # Read once, as unbounded (the root's metadata may differ by a few bytes between reads).
    assert all(o < 1.1 * u for o, u in zip(read["own"], read["unbounded"])), read
