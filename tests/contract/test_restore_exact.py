"""The central claim: in fp32, restoring any policy's chain reproduces the model
at the saved step bit for bit, for the latest and for earlier checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from cnr_train.workload import TableSpec
from tests.jobs import Job, assert_restores, make_job
from tests.multiprocess import run_ranks
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.selection import POLICIES

TABLES = [
    TableSpec("t_tw", 400, 16, "table_wise"),
    TableSpec("t_cw", 300, 16, "column_wise"),
    TableSpec("t_twcw", 250, 16, "table_column_wise"),
    TableSpec("t_dp", 120, 16, "data_parallel"),
    TableSpec("t_tw2", 600, 16, "table_wise"),
]
STEPS_PER_INTERVAL = 2
INTERVALS = 12


def _job(policy: str, root: str, seed: int, staging: str = "lazy") -> Job:
    return make_job(
        TABLES,
        root,
        seed=seed,
        data_seed=5,
        alpha=1.2,
        policy=policy,
        interval_steps=STEPS_PER_INTERVAL,
        staging=staging,
    )


def _policy_case(policy: str, root: str, refs: str, staging: str) -> None:
    refs_p = Path(refs)
    last = STEPS_PER_INTERVAL * INTERVALS
    job = _job(policy, root, seed=1, staging=staging)
    job.run(1, last, refs_p)
    job.ckpt.wait()

    for step in (
        STEPS_PER_INTERVAL,
        last // 2 + 1 if (last // 2 + 1) % 2 == 0 else last // 2,
        last,
    ):
        fresh = _job(policy, root, seed=100 + step)
        assert_restores(fresh, refs_p, step)
        fresh.ckpt.close()

    # Resume from the latest checkpoint, keep training and saving on the
    # restored chain, then restore the newest checkpoint once more.
    job = _job(policy, root, seed=7, staging=staging)
    assert job.ckpt.restore() == last
    newest = last + 3 * STEPS_PER_INTERVAL
    job.run(last + 1, newest, refs_p)
    job.ckpt.close()
    fresh = _job(policy, root, seed=8)
    assert_restores(fresh, refs_p, newest, latest=True)
    fresh.ckpt.close()


def _chain_shape_holds(policy: str, kinds: Sequence[str], chains: list[int]) -> bool:
    """What each policy's chain looks like after 15 checkpoints and a resume."""
    shapes = {
        "full": set(kinds) == {"full"} and set(chains) == {1},
        "one_shot": kinds.count("full") == 1 and max(chains) == 2,
        "consecutive": kinds.count("full") == 1 and chains == list(range(1, len(chains) + 1)),
        "intermittent": kinds.count("full") >= 2 and max(chains) == 2,
    }
    assert policy in shapes, f"state the chain shape of policy {policy!r} here"
    return shapes[policy]


@pytest.mark.dist
@pytest.mark.parametrize("staging", ["lazy", "eager"])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_restores_saved_steps_bit_exact(
    policy: str, staging: str, root: str, refs: Path
) -> None:
    run_ranks(2, _policy_case, policy, root, str(refs), staging)

    manifest = Manifest.load(root)
    entries = manifest.checkpoints
    assert len(entries) == INTERVALS + 3
    assert manifest.restores == 5
    kinds = [e.kind for e in entries]
    assert _chain_shape_holds(policy, kinds, [e.depth for e in entries]), kinds
    # Deltas hold fewer rows than a full checkpoint.
    delta_bytes = [e.bytes for e in entries if e.kind == "delta"]
    full_bytes = [e.bytes for e in entries if e.kind == "full"]
    assert not delta_bytes or max(delta_bytes) < min(full_bytes)
