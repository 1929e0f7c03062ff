"""Checkpoints outside training, for every policy: tables read without a model and the
unsharded model's state dict exported (torch, safetensors, DCP). Compaction's tests are in
``test_compaction.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import reference
from tests.jobs import interval_config, make_job, save_reference
from tests.models import unsharded
from tests.multiprocess import run_ranks
from torchrec_cnr import (
    CheckpointConfig,
    CheckpointManager,
    QuantizeConfig,
    export_state_dict,
    read_table,
)
from torchrec_cnr.cli import main as cnr
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.offline import read_optimizer_state, save_export
from torchrec_cnr.selection import POLICIES

STEPS, EVERY = 12, 3


def _train(root: str, refs: str, policy: str, quant: dict | None = None, **config) -> None:
    job = make_job("ebc", optimizer="exact_adagrad", seed=1)
    with CheckpointManager(
        job.model, interval_config(root, policy, EVERY, quant, **config), job.app_state
    ) as ckpt:
        job.run(1, STEPS, refs, ckpt=ckpt)


@pytest.mark.dist
@pytest.mark.parametrize("policy", POLICIES)
def test_tables_read_and_export_without_a_model_equal_the_live_model(
    policy: str, root: str, refs: Path, tmp_path: Path
) -> None:
    run_ranks(2, _train, root, str(refs), policy)
    for step in (EVERY, 9, STEPS):
        want = reference.tables_at(refs, step)
        for table, values in want.items():
            assert torch.equal(read_table(root, table, step), values["weight"]), (table, step)
            states = read_optimizer_state(root, table, step)
            assert torch.equal(states["momentum1"], values["momentum1"]), (table, step)
        # rows=: a subset, in any order, read whole (verified) or alone (not).
        table = "sparse.ebc.t_row_wise"
        rows = torch.tensor([4000, 3, 2000, 2001, 3, 17])
        for verify in (True, False):
            got = read_table(root, "t_row_wise", step, rows=rows, verify=verify)
            assert torch.equal(got, want[table]["weight"][rows])
        # The unsharded model's state dict, under the unsharded module's keys.
        exported = export_state_dict(root, step)
        model, _, _ = unsharded("ebc", "cpu")
        assert set(exported) == set(model.state_dict())
        model.load_state_dict(exported, strict=True)
        for table, values in want.items():
            key = table.replace(".ebc.", ".ebc.embedding_bags.").replace(
                ".weighted_ebc.", ".weighted_ebc.embedding_bags."
            )
            assert torch.equal(model.state_dict()[f"{key}.weight"], values["weight"])
        dense = reference.load_all(refs, step)[0]["dense"]
        assert all(torch.equal(exported[k], v) for k, v in dense.items())
    # Every file format reads back the same tensors.
    for fmt, out in (("torch", "m.pt"), ("safetensors", "m.safetensors")):
        save_export(exported, tmp_path / out, fmt)  # type: ignore[arg-type]
    assert all(torch.equal(v, torch.load(tmp_path / "m.pt")[k]) for k, v in exported.items())
    assert all(
        torch.equal(v, load_file(tmp_path / "m.safetensors")[k]) for k, v in exported.items()
    )


def test_cnr_export_writes_the_state_dict_of_a_step(tmp_path: Path, capsys) -> None:
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    run_ranks(2, _train, root, str(refs), "intermittent")
    out = tmp_path / "step9.pt"
    assert cnr(["export", root, "--step", "9", "--out", str(out), "--tables", "t_row_wise"]) == 0
    saved = torch.load(out)
    assert list(saved) == ["sparse.ebc.embedding_bags.t_row_wise.weight"]
    assert torch.equal(
        saved[list(saved)[0]], reference.tables_at(refs, 9)["sparse.ebc.t_row_wise"]["weight"]
    )
    assert cnr(["export", root, "--step", "10", "--out", str(out)]) == 2
    assert "no committed checkpoint of step 10" in capsys.readouterr().err


QUANT: dict = {"method": "adaptive", "bits": 4, "min_rows": 1000}


def _restored(root: str, out: str, step: int) -> None:
    job = make_job("ebc", optimizer="exact_adagrad", seed=5)
    with CheckpointManager(job.model, CheckpointConfig(path=root), job.app_state) as ckpt:
        assert ckpt.restore(step=step) == step
    save_reference(job, out, step)


@pytest.mark.dist
def test_a_quantized_chain_reads_as_the_dequantized_stored_rows(
    root: str, refs: Path, tmp_path: Path
) -> None:
    run_ranks(2, _train, root, str(refs), "consecutive", QUANT)
    config = QuantizeConfig(**QUANT)
    for step in (EVERY, STEPS):
        manifest = Manifest.load(root)
        found = manifest.find(step)
        assert found is not None
        entry = manifest.record(found)
        # What a restore into a live model gives: the stored rows, dequantized.
        restored_dir = tmp_path / f"restored-{step}"
        restored_dir.mkdir()
        run_ranks(2, _restored, root, str(restored_dir), step)
        restored = reference.tables_at(restored_dir, step)
        exported = export_state_dict(root, step)
        for table, values in reference.tables_at(refs, step).items():
            got = read_table(root, table, step)
            assert torch.equal(got, restored[table]["weight"]), (table, step)
            key = table.replace(".ebc.", ".ebc.embedding_bags.").replace(
                ".weighted_ebc.", ".weighted_ebc.embedding_bags."
            )
            assert torch.equal(exported[f"{key}.weight"], got), (table, step)
            if entry.tables[table].num_embeddings < config.min_rows:
                assert torch.equal(got, values["weight"])
            else:  # quantized: within the quantizer's error, never exact
                assert not torch.equal(got, values["weight"])
                assert (got - values["weight"]).abs().max() < 0.1
