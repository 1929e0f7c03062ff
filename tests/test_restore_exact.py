"""The central claim: in fp32, restoring any policy's chain reproduces the model
at the saved step bit for bit, for the latest and for earlier checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from tests import reference
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.workload import TableSpec, ZipfBatches, build_model, dense_optimizer, train_step

TABLES = [
    TableSpec("t_tw", 400, 16, "table_wise"),
    TableSpec("t_cw", 300, 16, "column_wise"),
    TableSpec("t_twcw", 250, 16, "table_column_wise"),
    TableSpec("t_dp", 120, 16, "data_parallel"),
    TableSpec("t_tw2", 600, 16, "table_wise"),
]
STEPS_PER_INTERVAL = 2
INTERVALS = 12


def _job(policy: str, root: Path, refs: Path, seed: int):
    model = build_model(TABLES, seed=seed)
    opt = dense_optimizer(model)
    data = ZipfBatches(TABLES, batch_size=16, alpha=1.2, seed=5)
    app = {"reader": data, "dense_opt": opt}
    ckpt = CheckpointManager(
        model,
        CheckpointConfig(path=str(root), policy=policy, interval_steps=STEPS_PER_INTERVAL),
        app,
    )
    return model, opt, data, app, ckpt


def _train(model, opt, data, app, ckpt, refs: Path, first: int, last: int) -> None:
    rank = dist.get_rank()
    for step in range(first, last + 1):
        train_step(model, opt, data.next(rank))
        if ckpt.maybe_save(step):
            reference.save(reference.take(model, app), refs, step)
    ckpt.wait()


def _policy_case(policy: str, root: str, refs: str) -> None:
    root_p, refs_p = Path(root), Path(refs)
    job = _job(policy, root_p, refs_p, seed=1)
    last = STEPS_PER_INTERVAL * INTERVALS
    _train(*job, refs=refs_p, first=1, last=last)

    for step in (
        STEPS_PER_INTERVAL,
        last // 2 + 1 if (last // 2 + 1) % 2 == 0 else last // 2,
        last,
    ):
        model, _, _, app, ckpt = _job(policy, root_p, refs_p, seed=100 + step)
        assert ckpt.restore(step=step) == step
        reference.assert_model_matches(model, app, reference.load_all(refs_p, step))

    # Resume from the latest checkpoint, keep training and saving on the
    # restored chain, then restore the newest checkpoint once more.
    job = _job(policy, root_p, refs_p, seed=7)
    assert job[4].restore() == last
    _train(*job, refs=refs_p, first=last + 1, last=last + 3 * STEPS_PER_INTERVAL)
    model, _, _, app, ckpt = _job(policy, root_p, refs_p, seed=8)
    newest = last + 3 * STEPS_PER_INTERVAL
    assert ckpt.restore() == newest
    reference.assert_model_matches(model, app, reference.load_all(refs_p, newest))


@pytest.mark.dist
@pytest.mark.parametrize("policy", ["full", "one_shot", "consecutive", "intermittent"])
def test_every_policy_restores_saved_steps_bit_exact(policy: str, tmp_path: Path) -> None:
    root, refs = tmp_path / "ckpt", tmp_path / "refs"
    refs.mkdir()
    run_ranks(2, _policy_case, policy, str(root), str(refs))

    manifest = Manifest.load(root)
    entries = manifest.checkpoints
    assert len(entries) == INTERVALS + 3
    assert manifest.restores == 5
    kinds = [e["kind"] for e in entries]
    chains = [len(e["chain"]) for e in entries]
    if policy == "full":
        assert set(kinds) == {"full"} and set(chains) == {1}
    elif policy == "one_shot":
        assert kinds.count("full") == 1 and max(chains) == 2
    elif policy == "consecutive":
        assert kinds.count("full") == 1 and chains == list(range(1, len(entries) + 1))
    else:
        assert kinds.count("full") >= 2, kinds
        assert max(chains) == 2
    # Deltas hold fewer rows than a full checkpoint.
    if policy != "full":
        delta_bytes = [e["bytes"] for e in entries if e["kind"] == "delta"]
        full_bytes = [e["bytes"] for e in entries if e["kind"] == "full"]
        assert max(delta_bytes) < min(full_bytes)
