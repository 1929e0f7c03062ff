"""The contract: with fp32, a job restored from a committed checkpoint in the middle of a
chain and trained on ends bit-identical to one that never stopped.

Run for every policy, every layout (all in one model), every fused optimizer FBGEMM runs
on CPU, TorchRec's TestSparseNN (an EmbeddingBagCollection and a weighted one) and a
sequence model on an EmbeddingCollection. "Bit-identical" covers every shard's weights,
every fused optimizer state including the kernels' step counters, the dense parameters
and the dense optimizer in ``app_state``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.jobs import make_job, restores_exactly, save_reference
from tests.models import MODEL_LAYOUTS, OPTIMIZERS, capture, differences
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.config import Background, Staging
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.selection import POLICIES
from torchrec_cnr.selection.policy import PolicyName
from torchrec_cnr.tracking import model_state

STEPS = 12
EVERY = 3
RESUME_AT = 9
"""A checkpoint in the middle of the chain: a delta over the step-3 baseline for every
policy but ``full`` (consecutive: 3, 6, 9)."""


def _resume_equals_uninterrupted(
    kind: str,
    optimizer: str,
    policy: PolicyName,
    root: str,
    staging: Staging = "lazy",
    background: Background = "thread",
    delta_tracker: bool = False,
) -> None:
    config = CheckpointConfig(path=root, policy=policy, interval_steps=EVERY, staging=staging,
                              background=background)  # fmt: skip
    job = make_job(kind, optimizer=optimizer, seed=1, delta_tracker=delta_tracker)
    with CheckpointManager(job.model, config, job.app_state) as ckpt:
        job.run(1, STEPS, ckpt=ckpt)
        ckpt.wait()
    uninterrupted = capture(job.model, job.app_state)

    manifest = Manifest.load(root)
    entry = manifest.find(RESUME_AT)
    assert entry is not None
    assert policy == "full" or entry.depth >= 2, manifest.chain(entry)
    for rec, shard in zip(
        manifest.shards(entry, dist.get_rank()),
        model_state.local_shards(job.model),
        strict=True,
    ):
        # The manifest names the optimizer, its states and the step counters it saved.
        assert rec.optimizer == shard.optimizer
        assert set(rec.states) == set(shard.states)
        assert set(rec.scalars) == set(shard.scalar_states())

    resumed = make_job(kind, optimizer=optimizer, seed=2, delta_tracker=delta_tracker)
    assert differences(uninterrupted, capture(resumed.model, resumed.app_state)), (
        "a fresh model must differ"
    )
    with CheckpointManager(resumed.model, config, resumed.app_state) as ckpt:
        assert ckpt.restore(step=RESUME_AT) == RESUME_AT
        resumed.run(RESUME_AT + 1, STEPS, ckpt=ckpt)
        ckpt.wait()
    diff = differences(uninterrupted, capture(resumed.model, resumed.app_state))
    assert not diff, f"resumed run differs from the uninterrupted one at {diff[:5]}"

    # The resumed run continued the chain; its last checkpoint restores the same state (as a
    # job that only reads it does: with background="process", no writer process starts).
    latest = make_job(kind, optimizer=optimizer, seed=3, delta_tracker=delta_tracker)
    reader = dataclasses.replace(config, read_only=True)
    with CheckpointManager(latest.model, reader, latest.app_state) as ckpt:
        assert ckpt.restore() == STEPS
    diff = differences(uninterrupted, capture(latest.model, latest.app_state))
    assert not diff, f"continued chain restores differently at {diff[:5]}"


@pytest.mark.dist
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_resume_equals_uninterrupted_on_every_layout(
    optimizer: str, policy: str, tmp_path: Path
) -> None:
    run_ranks(2, _resume_equals_uninterrupted, "ebc", optimizer, policy, str(tmp_path / "ckpt"))


@pytest.mark.dist
@pytest.mark.parametrize("staging", ["lazy", "eager"])
@pytest.mark.parametrize("policy", ["consecutive", "intermittent"])
def test_resume_equals_uninterrupted_with_torchrecs_sharders_and_delta_tracker(
    policy: str, staging: Staging, tmp_path: Path
) -> None:
    # TorchRec's own sharders; the manager reads TorchRec's ModelDeltaTracker for the rows.
    root = str(tmp_path / "ckpt")
    run_ranks(2, _resume_equals_uninterrupted, "ebc", "exact_rowwise_adagrad", policy, root,
              staging, "thread", True)  # fmt: skip


@pytest.mark.dist
@pytest.mark.parametrize("policy", ["consecutive", "intermittent"])
def test_resume_equals_uninterrupted_on_an_s3_root(policy: str, s3_root: str) -> None:
    run_ranks(2, _resume_equals_uninterrupted, "ebc", "exact_rowwise_adagrad", policy, s3_root)


@pytest.mark.dist
@pytest.mark.parametrize("staging", ["lazy", "eager"])
@pytest.mark.parametrize("policy", POLICIES)
def test_resume_equals_uninterrupted_with_sequence_embeddings(
    policy: str, staging: Staging, tmp_path: Path
) -> None:
    root = str(tmp_path / "ckpt")
    run_ranks(2, _resume_equals_uninterrupted, "ec", "exact_adagrad", policy, root, staging)


@pytest.mark.dist
@pytest.mark.parametrize("staging", ["lazy", "eager"])
@pytest.mark.parametrize("policy", POLICIES)
def test_resume_equals_uninterrupted_with_a_writer_process(
    policy: PolicyName, staging: Staging, tmp_path: Path
) -> None:
    root = str(tmp_path / "ckpt")
    run_ranks(2, _resume_equals_uninterrupted, "ebc", "exact_adagrad", policy, root, staging,
              "process")  # fmt: skip


@pytest.mark.dist
def test_resume_equals_uninterrupted_with_a_writer_process_alone(tmp_path: Path) -> None:
    # One rank: the writer process agrees with nobody, no collective goes through the trainer.
    root = str(tmp_path / "ckpt")
    run_ranks(1, _resume_equals_uninterrupted, "ebc", "exact_adagrad", "intermittent", root,
              "lazy", "process")  # fmt: skip


@pytest.mark.dist
def test_resume_equals_uninterrupted_with_a_writer_process_on_s3(s3_root: str) -> None:
    run_ranks(2, _resume_equals_uninterrupted, "ebc", "exact_rowwise_adagrad", "consecutive",
              s3_root, "lazy", "process")  # fmt: skip


def _resume_from_each_beside_background_compaction(root: str, background: Background) -> None:
    config = CheckpointConfig(path=root, policy="consecutive", interval_steps=1, compact_every=2,
                              background=background)  # fmt: skip
    job = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=1)
    with CheckpointManager(job.model, config, job.app_state) as ckpt:
        last, rebased = 0, 0
        while last < STEPS or rebased < 2:  # two checkpoints built on a landed compaction
            assert last < 300, "no compaction landed"
            last += 1
            job.run(last, last, ckpt=ckpt)
            ckpt.wait()
            manifest = Manifest.load(root)
            latest = manifest.latest()
            assert latest is not None
            first = manifest.chain(latest)[0]
            rebased += first.endswith("-c") and first != latest.id
    uninterrupted = capture(job.model, job.app_state)
    manifest = Manifest.load(root)
    assert any(e.compacted_from for e in manifest.checkpoints)
    # Every committed step: a compaction where one landed, a delta on an old chain or on one.
    # One job resumes from each in turn: every restore must overwrite all the last one trained.
    resumed = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=2)
    reader = CheckpointConfig(path=root, read_only=True)
    for step in sorted(set(manifest.steps())):
        with CheckpointManager(resumed.model, reader, resumed.app_state) as ckpt:
            assert ckpt.restore(step=step) == step
        resumed.run(step + 1, last)
        diff = differences(uninterrupted, capture(resumed.model, resumed.app_state))
        assert not diff, f"resumed from step {step}, it differs at {diff[:5]}"


@pytest.mark.dist
@pytest.mark.parametrize("background", ["thread", "process"])
def test_resume_from_any_checkpoint_beside_background_compaction_equals_uninterrupted(
    background: Background, tmp_path: Path
) -> None:
    root = str(tmp_path / "ckpt")
    run_ranks(2, _resume_from_each_beside_background_compaction, root, background)


# -- resharding ---------------------------------------------------------------------


def _layouts(layout: str) -> dict[str, str]:
    # Data-parallel tables stay replicated: they travel with the dense state.
    return {
        f"{prefix}_{x}": layout
        for prefix in ("t", "w")
        for x in MODEL_LAYOUTS["ebc"]
        if x != "data_parallel"
    }


def _save_chain(layout: str, root: str, refs: str) -> None:
    job = make_job("ebc", optimizer="exact_adagrad", seed=1, layouts=_layouts(layout))
    config = CheckpointConfig(path=root, policy="intermittent")
    with CheckpointManager(job.model, config, job.app_state) as ckpt:
        for step in range(1, 7):
            job.step(step)
            if step in (3, 6):
                ckpt.save(step)
                save_reference(job, refs, step)


@pytest.mark.dist
@pytest.mark.parametrize(
    "saved,saved_ranks,restored,restored_ranks",
    [
        ("row_wise", 2, "table_wise", 1),
        ("table_wise", 1, "row_wise", 2),
        ("row_wise", 2, "column_wise", 2),
        ("column_wise", 2, "row_wise", 2),
    ],
)
def test_row_wise_chain_restores_exactly_onto_other_layouts_and_back(
    saved: str, saved_ranks: int, restored: str, restored_ranks: int, tmp_path: Path
) -> None:
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    run_ranks(saved_ranks, _save_chain, saved, root, str(refs))
    latest = Manifest.load(root).latest()
    assert latest is not None and latest.depth == 2  # a baseline and a delta
    run_ranks(restored_ranks, restores_exactly, "ebc", root, str(refs), 6, latest=True,
              optimizer="exact_adagrad", seed=9, layouts=_layouts(restored))  # fmt: skip
