"""Quantized checkpoints end to end: every policy's chain restores each row as
the quantizer's round trip of its saved value; bit widths follow the restores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import reference
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.config import QuantizeConfig
from torchrec_cnr.encoding import FP32, Format, FormatResolver
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.quantization import quantize
from torchrec_cnr.workload import TableSpec, ZipfBatches, build_model, dense_optimizer, train_step

TABLES = [
    TableSpec("big", 600, 16, "table_wise"),
    TableSpec("cw", 500, 16, "column_wise"),
    TableSpec("small", 100, 16, "table_wise"),
]
QUANT = QuantizeConfig(method="adaptive", bits=4, min_rows=200, tables={"cw": "asymmetric:3"})


def _job(root: str, policy: str, seed: int):
    model = build_model(TABLES, seed=seed)
    opt = dense_optimizer(model)
    app = {"reader": ZipfBatches(TABLES, batch_size=16, seed=6), "dense_opt": opt}
    config = CheckpointConfig(path=root, policy=policy, interval_steps=2, quantize=QUANT)
    return model, opt, app, CheckpointManager(model, config, app)


def _round_trip(table: str, rows: torch.Tensor) -> torch.Tensor:
    fmt = FormatResolver(QUANT, restores=0).resolve(
        table, {"big": 600, "cw": 500, "small": 100}[table.rsplit(".", 1)[-1]]
    )
    if fmt == FP32:
        return rows
    return quantize(rows, fmt.method, fmt.bits, n_bins=QUANT.n_bins, ratio=QUANT.ratio).dequantize()


def _quantized_chain(root: str, refs: str, policy: str) -> None:
    model, opt, app, ckpt = _job(root, policy, seed=1)
    for step in range(1, 13):
        train_step(model, opt, app["reader"].next(dist.get_rank()))
        if ckpt.maybe_save(step):
            reference.save(reference.take(model, app), Path(refs), step)
    ckpt.wait()
    for step in (6, 12):
        fresh, _, fresh_app, fresh_ckpt = _job(root, policy, seed=40 + step)
        assert fresh_ckpt.restore(step=step) == step
        refs_at = reference.load_all(Path(refs), step)
        reference.assert_model_matches(fresh, fresh_app, refs_at, expected_rows=_round_trip)


@pytest.mark.dist
@pytest.mark.parametrize("policy", ["full", "one_shot", "consecutive", "intermittent"])
def test_quantized_chain_restores_the_quantizer_round_trip_of_saved_rows(
    policy: str, tmp_path: Path
) -> None:
    root, refs = str(tmp_path / "ckpt"), tmp_path / "refs"
    refs.mkdir()
    run_ranks(2, _quantized_chain, root, str(refs), policy)
    manifest = Manifest.load(root)
    formats = {
        (r["spec"]["table"].rsplit(".", 1)[-1], r["format"]["method"], r["format"]["bits"])
        for e in manifest.checkpoints
        for r in e["shards"]
    }
    assert formats == {("big", "adaptive", 4), ("cw", "asymmetric", 3), ("small", "none", 32)}
    fp32_bytes = sum(
        r["saved_rows"] * r["spec"]["cols"] * 4
        for r in manifest.checkpoints[0]["shards"]
        if r["spec"]["table"].endswith("big")
    )
    stored = sum(
        r["nbytes"] for r in manifest.checkpoints[0]["shards"] if r["spec"]["table"].endswith("big")
    )
    assert stored < fp32_bytes / 2, (
        "4-bit rows plus fp32 optimizer state must be well under fp32 rows"
    )


def test_auto_bits_follow_expected_restores_and_fall_back_to_8_bits() -> None:
    for restores_expected, bits in ((1, 2), (3, 3), (20, 4), (21, 8)):
        config = QuantizeConfig(method="adaptive", bits="auto", expected_restores=restores_expected)
        assert FormatResolver(config, restores=0).resolve("t", 10_000) == Format("adaptive", bits)
    config = QuantizeConfig(method="adaptive", bits="auto", expected_restores=1)
    with pytest.warns(
        UserWarning,
        match="2 restores exceed quantize.expected_restores=1; checkpoints now use 8 bits",
    ):
        assert FormatResolver(config, restores=2).resolve("t", 10_000) == Format("adaptive", 8)


def test_small_tables_stay_fp32_unless_named() -> None:
    config = QuantizeConfig(method="kmeans", bits=3, min_rows=1000, tables={"tiny": "fp16"})
    resolver = FormatResolver(config, restores=0)
    assert resolver.resolve("ebc.small", 999) == FP32
    assert resolver.resolve("ebc.tiny", 10) == Format("fp16", 16)
    assert resolver.resolve("ebc.large", 5000) == Format("kmeans", 3)


def test_quantize_config_rejects_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="quantize. method must be one of"):
        QuantizeConfig(method="lossy")
    with pytest.raises(ValueError, match="bits must be one of"):
        QuantizeConfig(bits=5)
    with pytest.raises(ValueError, match="quantize.tables entry 'adaptive:7'"):
        QuantizeConfig(tables={"t": "adaptive:7"})
    with pytest.raises(ValueError, match="quantize.optimizer_state"):
        QuantizeConfig(optimizer_state="int8")


def _nan_row_fails_the_checkpoint(root: str) -> None:
    from torchrec_cnr import model_state

    model, opt, app, ckpt = _job(root, "full", seed=1)
    train_step(model, opt, app["reader"].next(dist.get_rank()))
    for shard in model_state.local_shards(model):
        if shard.spec.table.endswith("big"):
            shard.weight[7, 0] = float("nan")
    ckpt.save(1)
    with pytest.raises(Exception, match=r"table '.*big' row 7 contains NaN or Inf"):
        ckpt.wait()
    assert Manifest.load(root).steps() == []


@pytest.mark.dist
def test_nan_row_fails_the_checkpoint_naming_table_and_row(tmp_path: Path) -> None:
    run_ranks(2, _nan_row_fails_the_checkpoint, str(tmp_path / "ckpt"))
