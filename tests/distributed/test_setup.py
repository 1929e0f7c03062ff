"""A job learns what would stop it before it trains, and nothing it asks for is silently a
no-op: a root it cannot claim fails every rank with one message as the manager is built; a
restore that finds nothing says where it looked (or fails, if a checkpoint is required);
``maybe_save`` without an interval says it never saves; torchtitan's option names do what
they say."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

from cnr_train.workload import TableSpec
from tests import logged, reference
from tests.faults import Fault, FaultyStorage
from tests.jobs import make_job, save_reference
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointError
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.storage import open_storage

TABLES = [TableSpec("a", 400, 16, "table_wise"), TableSpec("b", 300, 16, "column_wise")]


def _refused_at_once(root: str, how: str, out: str) -> None:
    job = make_job(TABLES, seed=1)  # the model first: building it is not the manager's
    storage = FaultyStorage(root, Fault("write", "lease.json")) if how == "read-only" else None
    with (
        logged() as said,
        warnings.catch_warnings(record=True) as warned,
        pytest.raises(CheckpointError) as e,
    ):
        warnings.simplefilter("always")
        job.attach(root, storage)
    # Nothing else said first, and nothing that contradicts the error.
    assert not said and not [w for w in warned if "cnr" in str(w.filename)], (
        said,
        [str(w.message) for w in warned],
    )
    Path(f"{out}.{dist.get_rank()}").write_text(str(e.value))


@pytest.mark.dist
@pytest.mark.parametrize("how", ["under-a-file", "read-only"])
def test_a_root_the_job_cannot_write_fails_every_rank_alike_before_it_trains(
    how: str, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    if how == "under-a-file":
        (tmp_path / "file").write_text("")
        root = tmp_path / "file" / "ckpt"
    run_ranks(2, _refused_at_once, str(root), how, str(tmp_path / "error"))
    errors = [(tmp_path / f"error.{rank}").read_text() for rank in range(2)]
    assert errors[0] == errors[1], errors
    assert f"{root} cannot be written" in errors[0], errors[0]
    assert ("NotADirectoryError" if how == "under-a-file" else "no space left") in errors[0]


def _nothing_to_restore(root: str, out: str) -> None:
    job = make_job(TABLES, root, seed=1)
    with logged() as said:
        assert job.ckpt.restore() is None
    Path(f"{out}.{dist.get_rank()}").write_text("\n".join(said))
    job.ckpt.close()
    required = make_job(TABLES, root, seed=1, require_checkpoint=True)
    with pytest.raises(CheckpointError, match=f"no committed checkpoint in {root} to restore"):
        required.ckpt.restore()
    # A job with no interval: maybe_save never saves, and says so once.
    with pytest.warns(UserWarning, match=r"maybe_save\(\) never saves: .*interval_steps is None"):
        assert not required.ckpt.maybe_save(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not required.ckpt.maybe_save(2)
    required.ckpt.close()


@pytest.mark.dist
def test_a_restore_that_finds_nothing_says_where_it_looked_once_or_fails_if_required(
    tmp_path: Path,
) -> None:
    root = tmp_path / "mistyped"
    run_ranks(2, _nothing_to_restore, str(root), str(tmp_path / "log"))
    logs = [(tmp_path / f"log.{rank}").read_text() for rank in range(2)]
    assert (
        logs[0] == f"no committed checkpoint in {root}: nothing restored, the model stays as it is"
    )
    assert logs[1] == "", "said once, by rank 0"


def _torchtitans_options(root: str, refs: str) -> None:
    # torchtitan's names: a checkpoint every 2 steps, the latest 2 kept, each committed
    # before save() returns.
    job = make_job(TABLES, root, seed=1, interval=2, keep_latest_k=2, async_mode="disabled")
    for step in range(1, 7):
        job.step(step)
        if job.ckpt.maybe_save(step):
            latest = Manifest.load(root).latest()
            assert latest is not None and latest.step == step, "committed when save() returned"
            save_reference(job, refs, step)
    job.ckpt.close()
    manifest = Manifest.load(root)  # what restoring the latest 2 needs (their chains)
    assert manifest.steps()[-2:] == [4, 6]
    assert set(open_storage(root).children()) == manifest.needed_ids(2)
    # A job that loads step 4 and keeps its own data reader's position.
    fresh = make_job(TABLES, seed=9, data_seed=0)
    with pytest.raises(ValueError, match=r"exclude_from_loading names \['loader'\]"):
        fresh.attach(root, load_step=4, exclude_from_loading=["loader"])
    fresh.attach(root, load_step=4, exclude_from_loading=["reader"])
    fresh.data.position = 123
    assert fresh.ckpt.restore() == 4
    assert fresh.data.position == 123, "an excluded app_state entry is left as it is"
    loaded = {"dense_opt": fresh.dense_opt}
    reference.assert_model_matches(fresh.model, loaded, reference.load_all(Path(refs), 4))
    fresh.ckpt.close()


@pytest.mark.dist
def test_torchtitans_option_names_save_keep_and_load_as_they_say(root: str, refs: Path) -> None:
    run_ranks(2, _torchtitans_options, root, str(refs))
