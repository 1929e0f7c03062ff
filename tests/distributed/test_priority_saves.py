"""CPR prioritized saves: MFU counts and SSU samples rank modified rows, and a
budgeted delta saves the top ones, leaving the rest for the next checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cnr_train.workload import TableSpec
from tests import reference
from tests.jobs import make_job
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointConfig
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.tracking import model_state
from torchrec_cnr.tracking.tracker import TrackingMode

TABLES = [TableSpec("a", 600, 16, "table_wise"), TableSpec("b", 500, 16, "table_wise")]
BUDGET_MB = 0.004  # about 60 rows of 16 floats + optimizer state + id per rank


def _prioritized(root: str, refs: str, mode: TrackingMode) -> None:
    rank = dist.get_rank()
    job = make_job(
        TABLES,
        root,
        seed=1,
        data_seed=3,
        batch_size=32,
        tracking_mode=mode,
        policy="consecutive",
        priority_budget_mb=BUDGET_MB,
    )
    model, app, ckpt = job.model, job.app_state, job.ckpt
    job.train(2)
    ckpt.save(2)
    ckpt.wait()
    reference.save(reference.take(model, app), Path(refs), 2)
    job.train(4)
    shards = model_state.local_shards(model)
    modified = [s.modified_mask().clone() for s in shards]
    scores = []
    for s in shards:
        assert s.priority is not None and s.priority.mode == mode
        scores.append(s.priority.scores(torch.arange(s.spec.rows)))
    ckpt.save(6)
    ckpt.wait()
    reference.save(reference.take(model, app), Path(refs), 6)
    # What the delta holds: the top-priority modified rows within the budget.
    manifest = Manifest.load(root)
    entry = manifest.latest()
    assert entry is not None
    saved_bytes = sum(r.nbytes for r in manifest.shards(entry, rank))
    assert saved_bytes <= BUDGET_MB * (1 << 20)
    saved_scores, unsaved_scores = [], []
    for shard, mask, score in zip(shards, modified, scores):
        still = shard.modified_mask()
        saved = mask & ~still  # bits cleared by the prioritized save
        assert bool((still <= mask).all()), "only saved rows lose their bit"
        saved_scores.append(score[saved])
        unsaved_scores.append(score[still & mask])
    saved_all, unsaved_all = torch.cat(saved_scores), torch.cat(unsaved_scores)
    assert saved_all.numel() > 0 and unsaved_all.numel() > 0, "the budget must cut the delta"
    assert saved_all.min() >= unsaved_all.max(), (
        "saved rows must rank at least as high as every unsaved one"
    )


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["mfu", "ssu"])
def test_budgeted_delta_saves_the_highest_priority_rows_and_keeps_the_rest_pending(
    mode: str, tmp_path: Path
) -> None:
    refs = tmp_path / "refs"
    refs.mkdir()
    run_ranks(2, _prioritized, str(tmp_path / "ckpt"), str(refs), mode)


def test_priority_budget_needs_the_consecutive_policy() -> None:
    with pytest.raises(ValueError, match="priority_budget_mb needs policy 'consecutive'"):
        CheckpointConfig(path="/tmp/x", policy="intermittent", priority_budget_mb=1)
