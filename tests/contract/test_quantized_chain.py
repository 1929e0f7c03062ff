"""Quantized checkpoints end to end: every policy's chain restores each row as
the quantizer's round trip of its saved value; bit widths follow the restores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchsnapshot.manifest import ChunkedTensorEntry, SnapshotMetadata

from cnr_train.workload import TableSpec
from tests import reference
from tests.jobs import Job, make_job, save_reference
from tests.multiprocess import run_ranks
from torchrec_cnr import QuantizeConfig
from torchrec_cnr.encoding import FP32, FormatResolver, writer
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.quantization import quantize
from torchrec_cnr.selection import POLICIES
from torchrec_cnr.snapshot import SNAPSHOT_MARKER
from torchrec_cnr.tracking import model_state

TABLES = [
    TableSpec("big", 600, 16, "table_wise"),
    TableSpec("cw", 500, 16, "column_wise"),
    TableSpec("small", 100, 16, "table_wise"),
]
QUANT = QuantizeConfig(method="adaptive", bits=4, min_rows=200, tables={"cw": "asymmetric:3"})


def _job(root: str, policy: str, seed: int, background: str = "thread") -> Job:
    return make_job(TABLES, root, seed=seed, data_seed=6, policy=policy, interval_steps=2,
                    quantize=QUANT, background=background)  # fmt: skip


def _round_trip(table: str, rows: torch.Tensor) -> torch.Tensor:
    fmt = FormatResolver(QUANT, restores=0).resolve(
        table, {"big": 600, "cw": 500, "small": 100}[table.rsplit(".", 1)[-1]]
    )
    if fmt == FP32:
        return rows
    return quantize(rows, fmt.method, fmt.bits, n_bins=QUANT.n_bins, ratio=QUANT.ratio).dequantize()


def _quantized_chain(root: str, refs: str, policy: str, encode_bytes: int | None = None) -> None:
    job = _job(root, policy, seed=1)
    default = writer.ENCODE_BYTES
    writer.ENCODE_BYTES = encode_bytes or default
    try:
        for step in range(1, 13):
            job.train(1)
            if job.ckpt.maybe_save(step):
                save_reference(job, refs, step)
        job.ckpt.wait()
    finally:
        writer.ENCODE_BYTES = default
    for step in (6, 12):
        fresh = _job(root, policy, seed=40 + step)
        assert fresh.ckpt.restore(step=step) == step
        refs_at = reference.load_all(Path(refs), step)
        reference.assert_model_matches(
            fresh.model, fresh.app_state, refs_at, expected_rows=_round_trip
        )


@pytest.mark.dist
@pytest.mark.parametrize("policy", POLICIES)
def test_quantized_chain_restores_the_quantizer_round_trip_of_saved_rows(
    policy: str, root: str, refs: Path
) -> None:
    run_ranks(2, _quantized_chain, root, str(refs), policy)
    manifest = Manifest.load(root)
    formats = {
        (r.spec.table.rsplit(".", 1)[-1], r.format.method, r.format.bits)
        for e in manifest.checkpoints
        for r in manifest.shards(e)
    }
    assert formats == {("big", "adaptive", 4), ("cw", "asymmetric", 3), ("small", "none", 32)}
    big = [r for r in manifest.shards(manifest.checkpoints[0]) if r.spec.table.endswith("big")]
    fp32_bytes = sum(r.saved_rows * r.spec.cols * 4 for r in big)
    stored = sum(r.nbytes for r in big)
    assert stored < fp32_bytes / 2, (
        "4-bit rows plus fp32 optimizer state must be well under fp32 rows"
    )


@pytest.mark.dist
@pytest.mark.parametrize("policy", ["full", "intermittent"])
def test_shards_encoded_in_pieces_restore_the_quantizer_round_trip(
    policy: str, root: str, refs: Path
) -> None:
    # 40 rows of 16 fp32 per piece: every quantized shard (100 to 600 rows) in several.
    run_ranks(2, _quantized_chain, root, str(refs), policy, 40 * 16 * 4)
    baseline = Manifest.load(root).checkpoints[0]
    index = SnapshotMetadata.from_yaml((Path(root) / baseline.id / SNAPSHOT_MARKER).read_text())
    chunks = {
        path: len(entry.chunks)
        for path, entry in index.manifest.items()
        if isinstance(entry, ChunkedTensorEntry)
    }
    # Whole, every tensor of these small tables fits one object: pieces come from encoding.
    assert chunks and all(n > 1 for n in chunks.values())


@pytest.mark.dist
@pytest.mark.parametrize("policy", ["one_shot", "intermittent"])
def test_quantized_chain_on_an_s3_root_restores_the_quantizer_round_trip(
    policy: str, s3_root: str, refs: Path
) -> None:
    run_ranks(2, _quantized_chain, s3_root, str(refs), policy)


def _nan_row_fails_the_checkpoint(root: str, background: str) -> None:
    job = _job(root, "full", seed=1, background=background)
    job.train(1)
    for shard in model_state.local_shards(job.model):
        if shard.spec.table.endswith("big"):
            shard.weight[7, 0] = float("nan")
    job.ckpt.save(1)
    with pytest.raises(Exception, match=r"table '.*big' row 7 contains NaN or Inf"):
        job.ckpt.wait()
    assert Manifest.load(root).steps() == []
    for shard in model_state.local_shards(job.model):  # the next checkpoint commits
        shard.weight.nan_to_num_(0.0)
    job.train(1)
    job.ckpt.save(2)
    job.ckpt.wait()
    assert Manifest.load(root).steps() == [2]


@pytest.mark.dist
@pytest.mark.parametrize("background", ["thread", "process"])
def test_nan_row_fails_the_checkpoint_naming_table_and_row(root: str, background: str) -> None:
    run_ranks(2, _nan_row_fails_the_checkpoint, root, background)
