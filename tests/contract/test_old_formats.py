"""Roots written by earlier formats restore, follow, verify and export as they were
written, and keep doing so once this version commits to them.

Each ``tests/data/format_v<N>`` holds two roots written by ``scripts/format_fixture.py``
in the last version of format N: 2 ranks, tables a: 600 x 8 table-wise and c: 401 x 8
row-wise, a checkpoint every second step, ``intermittent`` (its step 8 compacted) and
``consecutive``, each with what ``export_state_dict`` gave at every step then
(``<policy>.pt``).

- format 5 (one manifest holding every entry whole): steps 2 to 12, commit 2e83adc.
- format 6 (records, history segments, chains listed whole): steps 2 to 24, commit 64caeb3.
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
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.schema import FORMAT_VERSION
from torchrec_cnr.serving import FloatTarget

DATA = Path(__file__).parents[1] / "data"
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
@pytest.mark.parametrize("version", [5, 6])
@pytest.mark.parametrize("policy", ["intermittent", "consecutive"])
def test_an_old_root_restores_follows_verifies_and_exports_before_and_after_a_commit(
    version: int, policy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = DATA / f"format_v{version}"
    root = str(shutil.copytree(data / policy, tmp_path / "ckpt"))
    expected: dict[int, dict[str, torch.Tensor]] = torch.load(
        data / f"{policy}.pt", weights_only=True
    )
    manifest_json = json.loads((data / policy / "manifest.json").read_text())
    assert manifest_json["format_version"] == version
    assert cnr(["verify", root]) == 0 and cnr(["inspect", root]) == 0
    served = serving_model(TABLES, 4, "fp32")
    follower = Follower(root, FloatTarget(served))
    for step, want in sorted(expected.items()):
        assert _equal(want, export_state_dict(root, step)), step
        assert follower.pin(step) == step
        assert _equal(want, {k: v.detach() for k, v in served.state_dict().items()}), step
    # This version's first commit: a restore of step 6, saved again after the last.
    last = max(expected)
    run_ranks(2, _restore_and_commit, root, policy, 6, last + 2)
    manifest = Manifest.load(root)
    assert manifest.read_format == FORMAT_VERSION and manifest.steps()[-1] == last + 2
    assert all((Path(root) / e.id / "checkpoint.json").exists() for e in manifest.checkpoints)
    capsys.readouterr()
    assert cnr(["verify", root]) == 0, capsys.readouterr().out
    for step, want in sorted(expected.items()):
        assert _equal(want, export_state_dict(root, step)), step
    assert _equal(expected[6], export_state_dict(root, last + 2))
    follower.unpin()
    assert follower.poll() == last + 2
    assert _equal(expected[6], {k: v.detach() for k, v in served.state_dict().items()})
    follower.close()
