"""Every fused optimizer state and the kernels' step counters reach the checkpoint and
come back, including for the optimizers FBGEMM runs only on CUDA.

FBGEMM refuses ADAM, LAMB and their partial-row-wise variants on CPU. Here a CPU kernel
is made to look like one of them, as ``split_optimizer_states()`` returns their states
and with a step counter (``iter``) set, without training: the test checks what is
saved and written back, not the optimizer's arithmetic. The contract suite runs the
optimizers FBGEMM has on CPU, step counter included, through real training.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from cnr_train.workload import TableSpec, ZipfBatches, build_model, dense_optimizer
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.tracking import bitmap, model_state

TABLES = [
    TableSpec("a", 301, 8, "table_wise"),
    TableSpec("b", 4001, 8, "row_wise"),
    TableSpec("c", 200, 8, "column_wise"),
]
# FBGEMM's state layout per optimizer: momentum2 is per row for the partial-row-wise ones.
CUDA_ONLY = {
    "ADAM": False,
    "LAMB": False,
    "PARTIAL_ROWWISE_ADAM": True,
    "PARTIAL_ROWWISE_LAMB": True,
}


def _faked(optimizer: str, seed: int, step: int):
    """A CPU model whose kernels look like FBGEMM's ``optimizer`` TBE at ``step``."""
    model = build_model(TABLES, seed=seed)
    g = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    kernels = {id(s.kernel): s.kernel for s in model_state.local_shards(model)}
    for kernel in kernels.values():
        emb = kernel.emb_module
        emb.optimizer = EmbOptimType[optimizer]
        states = []
        for weight in emb.split_embedding_weights():
            rows, dim = weight.shape
            second = (rows,) if CUDA_ONLY[optimizer] else (rows, dim)
            states.append([torch.rand(rows, dim, generator=g), torch.rand(second, generator=g)])
        emb.split_optimizer_states = lambda states=states: states
        emb.iter.fill_(step)
        emb.iter_cpu.fill_(step)
    return model


def _states(model) -> list[dict[str, torch.Tensor]]:
    return [
        {k: v.clone() for k, v in s.states.items()} | {"weight": s.weight.clone()}
        for s in model_state.local_shards(model)
    ]


def _saves_and_writes_back(optimizer: str, root: str) -> None:
    config = CheckpointConfig(path=root, policy="one_shot")
    saved = _faked(optimizer, seed=1, step=37)
    with CheckpointManager(saved, config) as ckpt:
        ckpt.save(37)
        ckpt.wait()
        # A delta: some rows change, and the counter moves on.
        for shard in model_state.local_shards(saved):
            rows = torch.arange(0, shard.spec.rows, 7)
            for state in shard.states.values():
                state[rows] += 1.0
            assert shard.words is not None
            bitmap.set_bits(shard.words, rows)
            shard.kernel.emb_module.iter.fill_(41)
        ckpt.save(41)
    want = _states(saved)

    manifest = Manifest.load(root)
    entry = manifest.latest()
    assert entry is not None and entry.kind == "delta"
    for rec in manifest.shards(entry):
        assert rec.optimizer == optimizer
        assert set(rec.states) == {"momentum1", "momentum2"}
        assert rec.states["momentum2"].layout == ("row" if CUDA_ONLY[optimizer] else "element")
        assert rec.scalars["iter"] == 41

    restored = _faked(optimizer, seed=2, step=0)
    assert any(
        not torch.equal(a["momentum1"], b["momentum1"]) for a, b in zip(want, _states(restored))
    )
    with CheckpointManager(restored, config) as ckpt:
        assert ckpt.restore() == 41
    for w, got, shard in zip(
        want, _states(restored), model_state.local_shards(restored), strict=True
    ):
        for name in ("weight", "momentum1", "momentum2"):
            assert torch.equal(w[name], got[name]), f"{shard.spec.table} {name} not written back"
        emb = shard.kernel.emb_module
        assert int(emb.iter.item()) == 41 and int(emb.iter_cpu.item()) == 41


@pytest.mark.dist
@pytest.mark.parametrize("optimizer", list(CUDA_ONLY))
def test_cuda_only_optimizer_states_and_step_counter_are_saved_and_written_back(
    optimizer: str, tmp_path: Path
) -> None:
    run_ranks(2, _saves_and_writes_back, optimizer, str(tmp_path / "ckpt"))


def _other_optimizer_warns(root: str) -> None:
    saved = _faked("ADAM", seed=1, step=5)
    with CheckpointManager(saved, CheckpointConfig(path=root)) as ckpt:
        ckpt.save(5)
    model = build_model(TABLES, seed=2)  # row-wise Adagrad
    before = [s.states["momentum1"].clone() for s in model_state.local_shards(model)]
    with CheckpointManager(model, CheckpointConfig(path=root)) as ckpt:
        with pytest.warns(
            UserWarning, match=r"holds ADAM state .* trains with EXACT_ROWWISE_ADAGRAD"
        ):
            assert ckpt.restore() == 5
    for shard, momentum in zip(model_state.local_shards(model), before):
        assert torch.equal(shard.states["momentum1"], momentum), "optimizer state must stay"
    for shard, old in zip(model_state.local_shards(model), model_state.local_shards(saved)):
        assert torch.equal(shard.weight, old.weight), "weights are restored"


@pytest.mark.dist
def test_restore_into_another_optimizer_warns_and_keeps_its_state(tmp_path: Path) -> None:
    run_ranks(2, _other_optimizer_warns, str(tmp_path / "ckpt"))


def _reads_format_1(root: str, expected: str) -> None:
    tables = [TableSpec("a", 64, 8, "table_wise"), TableSpec("b", 48, 8, "column_wise")]
    model = build_model(tables, seed=9)
    app = {"reader": ZipfBatches(tables, batch_size=8, seed=1), "dense_opt": dense_optimizer(model)}
    with CheckpointManager(model, CheckpointConfig(path=root, policy="one_shot"), app) as ckpt:
        assert ckpt.restore() == 4
    want = torch.load(expected, weights_only=False)
    for shard in model_state.local_shards(model):
        weight, states = want["shards"][shard.spec.table]
        assert torch.equal(shard.weight, weight)
        assert torch.equal(shard.states["momentum1"], states["momentum1"])
    for key, value in model_state.dense_state(model).items():
        assert torch.equal(value, want["dense"][key])


@pytest.mark.dist
def test_a_format_1_checkpoint_still_restores(tmp_path: Path) -> None:
    import shutil

    data = Path(__file__).parents[1] / "data" / "format_v1"
    shutil.copytree(data / "ckpt", tmp_path / "ckpt")
    run_ranks(1, _reads_format_1, str(tmp_path / "ckpt"), str(data / "expected.pt"))
