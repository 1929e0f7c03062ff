"""The tracker's bitmaps equal the set of ids each shard was asked for, whether its hooks or
TorchRec's ModelDeltaTracker record them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.model_tracker.types import DeltaTrackerConfig

from cnr_train.workload import TableSpec, ZipfBatches, build_model, dense_optimizer, train_step
from tests.jobs import make_job
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.tracking import bitmap, model_state
from torchrec_cnr.tracking.tracker import DeltaFeed

TABLES = [
    TableSpec("t_tw", 500, 32, "table_wise"),
    TableSpec("t_cw", 400, 32, "column_wise"),
    TableSpec("t_twcw", 300, 32, "table_column_wise"),
    TableSpec("t_dp", 100, 32, "data_parallel"),
    # Three table-wise tables on two ranks: some kernel holds several tables,
    # so ids need per-table offsets into its bitmap.
    TableSpec("t_tw2", 200, 32, "table_wise"),
    TableSpec("t_tw3", 250, 32, "table_wise"),
]


def _bitmaps_equal_ids_seen(
    tables: list[TableSpec], steps: int, several_per_kernel: bool, device_type: str = "cpu"
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(tables, seed=3, device=device)
    opt = dense_optimizer(model)
    data = ZipfBatches(tables, batch_size=32, alpha=1.05, seed=11)
    for step in range(1, steps + 1):
        train_step(model, opt, data.batch(rank, step).to(device))
    # Every rank's input reaches the shards owning its ids, so the union over
    # ranks and steps is what each shard must have recorded.
    seen: dict[str, torch.Tensor] = {}
    for r in range(world):
        for step in range(1, steps + 1):
            kjt = data.batch(r, step).sparse.to_dict()
            for t in tables:
                seen.setdefault(t.name, torch.zeros(t.rows, dtype=torch.bool))[
                    kjt[f"f_{t.name}"].values()
                ] = True
    shards = model_state.local_shards(model)
    assert shards, "rank holds no tracked shard"
    per_kernel = max(len(s.kernel.config.embedding_tables) for s in shards)
    kernels = torch.tensor([per_kernel], device=device)  # nccl reduces on the GPU
    dist.all_reduce(kernels, op=dist.ReduceOp.MAX)
    assert not several_per_kernel or kernels.item() > 1, "no kernel holds several tables"
    assert not any(s.spec.table.endswith("t_dp") for s in shards), (
        "data-parallel tables travel as dense state"
    )
    for shard in shards:
        spec = shard.spec
        name = spec.table.rsplit(".", 1)[-1]
        want = seen[name][spec.row_offset : spec.row_offset + spec.rows]
        got = shard.modified_mask().cpu()
        assert 0 < int(want.sum()) < spec.rows, "workload must touch some but not all rows"
        assert torch.equal(got, want), (
            f"{spec.table} ({spec.sharding}) bitmap differs from ids seen"
        )
        assert shard.words is not None and bitmap.count(shard.words) == int(want.sum())
    dist.barrier()


@pytest.mark.dist
def test_bitmaps_equal_ids_seen_for_table_column_and_table_column_wise() -> None:
    run_ranks(2, _bitmaps_equal_ids_seen, TABLES, 6, True)


ROW_WISE = [
    # 4001 rows: the row-wise blocks of the two ranks differ in size.
    TableSpec("t_rw", 4001, 16, "row_wise"),
    TableSpec("t_twrw", 4001, 16, "table_row_wise"),
    TableSpec("t_grid", 4001, 16, "grid_shard"),
]


@pytest.mark.dist
def test_bitmaps_equal_ids_seen_for_row_wise_table_row_wise_and_grid() -> None:
    # The ids a row-wise shard's kernel receives are bucketized to offsets in its block.
    run_ranks(2, _bitmaps_equal_ids_seen, ROW_WISE, 6, False)


ON_CUDA = [*TABLES[:3], *(replace(t, dim=32) for t in ROW_WISE)]
"""Every layout but data-parallel, in one dim (DLRM's interaction needs it)."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bitmaps_equal_ids_seen_on_cuda_with_nccl() -> None:
    world = min(2, torch.cuda.device_count())
    run_ranks(world, _bitmaps_equal_ids_seen, ON_CUDA, 6, False, "cuda", backend="nccl")


# -- TorchRec's ModelDeltaTracker as the source of the bits ------------------------------


def _fed_bits_equal_the_hooks_bits() -> None:
    # The library's sharders and TorchRec's delta tracker on one model, every layout: the
    # feed fills bitmaps of its own from the tracker; the hooks fill the shards' bitmaps.
    job = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=1)
    delta = job.model.init_torchrec_delta_tracker(DeltaTrackerConfig(consumers=["torchrec_cnr"]))
    shards = model_state.local_shards(job.model)
    feed = DeltaFeed(delta)
    fed = {}
    for s in shards:
        assert s.words is not None
        fed[s.spec.table, s.spec.col_offset] = words = torch.zeros_like(s.words)
        feed.add(s.spec.state_dict_key.removesuffix(".weight"), words, torch.zeros_like(words))
    for step in (1, 2):
        job.step(step)
    feed.drain()
    feed.drain()  # no batch since: nothing read, nothing raised
    for s in shards:
        s.drain()
        assert s.words is not None and s.words.any(), s.spec.table
        assert torch.equal(fed[s.spec.table, s.spec.col_offset], s.words), s.spec.table
    # A batch the delta tracker's hooks did not see (turned off): the next read still works.
    hooked = [m for m in job.model.modules() if getattr(m, "post_lookup_tracker_fn", None)]
    saved = [m.post_lookup_tracker_fn for m in hooked]
    for m in hooked:
        m.post_lookup_tracker_fn = None
    job.step(3)
    feed.drain()
    for m, fn in zip(hooked, saved, strict=True):
        m.post_lookup_tracker_fn = fn
    job.step(4)
    feed.drain()
    for s in shards:
        s.drain()  # the hooks' bits are set on a thread of their own
        assert s.words is not None
        assert torch.equal(fed[s.spec.table, s.spec.col_offset] | s.words, s.words)


@pytest.mark.dist
def test_rows_read_from_torchrecs_delta_tracker_equal_the_hooks_rows_on_every_layout() -> None:
    run_ranks(2, _fed_bits_equal_the_hooks_bits)


def _refused_without_the_consumer(root: str) -> None:
    job = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=1, delta_tracker=True)
    # TorchRec's stock sharders, a delta tracker whose only consumer is TorchRec's default.
    delta = job.model.get_delta_tracker()
    assert delta is not None
    delta.per_consumer_batch_idx = {"default": -1}
    with pytest.raises(ValueError, match="add 'torchrec_cnr' to DeltaTrackerConfig"):
        CheckpointManager(job.model, CheckpointConfig(path=root))


@pytest.mark.dist
def test_a_delta_tracker_without_the_managers_consumer_is_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    run_ranks(2, _refused_without_the_consumer, str(tmp_path / "ckpt"))
