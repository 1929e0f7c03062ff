"""Roots written by earlier formats restore, follow, verify and export as they were
written, and keep doing so once this version commits to them.

``tests/data/format_v5``: two roots of format 5 (one manifest holding every entry whole),
2 ranks, tables a: 600 x 8 table-wise and c: 401 x 8 row-wise, a checkpoint every second
step from 2 to 12: ``intermittent`` (its step 8 compacted) and ``consecutive``, each with
what ``export_state_dict`` gave at every step then (``<policy>.pt``), written by
the last format-5 version (commit 2e83adc).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cnr_train.serve import serving_model
from cnr_train.workload import TableSpec
from tests.jobs import make_job
from tests.multiprocess import run_ranks
from torchrec_cnr import Follower, export_state_dict
from torchrec_cnr.cli import main as cnr
from torchrec_cnr.commit import Manifest
from torchrec_cnr.serving import FloatTarget

DATA = Path(__file__).parents[1] / "data" / "format_v5"
TABLES = [TableSpec("a", 600, 8, "table_wise"), TableSpec("c", 401, 8, "row_wise")]


def _equal(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, got[k]) for k, v in want.items())


def _restore_and_commit(root: str, policy: str, step: int, new_step: int) -> None:
    """Restores ``step`` and commits it again untrained as ``new_step``: this version's
    first commit to the root."""
    job = make_job(TABLES, root, seed=9, data_seed=2, policy=policy)
    assert job.ckpt.restore(step) == step
    job.ckpt.save(new_step)
    job.ckpt.close()
    dist.barrier()


@pytest.mark.dist
@pytest.mark.parametrize("policy", ["intermittent", "consecutive"])
def test_a_format_5_root_restores_follows_verifies_and_exports_before_and_after_a_commit(
    policy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(shutil.copytree(DATA / policy, tmp_path / "ckpt"))
    expected: dict[int, dict[str, torch.Tensor]] = torch.load(
        DATA / f"{policy}.pt", weights_only=True
    )
    assert json.loads((DATA / policy / "manifest.json").read_text())["format_version"] == 5
    assert cnr(["verify", root]) == 0 and cnr(["inspect", root]) == 0
    served = serving_model(TABLES, 4, "fp32")
    follower = Follower(root, FloatTarget(served))
    for step, want in sorted(expected.items()):
        assert _equal(want, export_state_dict(root, step)), step
        assert follower.pin(step) == step
        assert _equal(want, {k: v.detach() for k, v in served.state_dict().items()}), step
    # This version's first commit: a restore of step 6, saved again as step 14.
    run_ranks(2, _restore_and_commit, root, policy, 6, 14)
    manifest = Manifest.load(root)
    assert manifest.read_format == 6 and manifest.steps()[-1] == 14
    assert all((Path(root) / e.id / "checkpoint.json").exists() for e in manifest.checkpoints)
    capsys.readouterr()
    assert cnr(["verify", root]) == 0, capsys.readouterr().out
    for step, want in sorted(expected.items()):
        assert _equal(want, export_state_dict(root, step)), step
    assert _equal(expected[6], export_state_dict(root, 14))
    follower.unpin()
    assert follower.poll() == 14
    assert _equal(expected[6], {k: v.detach() for k, v in served.state_dict().items()})
    follower.close()
