"""``staging_memory_mb``: a checkpoint larger than the budget is staged and written in
chunks during the stall. The chunks make the same checkpoint as one unchunked save (fp32:
bit for bit, and it restores exactly; quantized: the same codes but for a rare rounding
step), a failure in one chunk fails every rank at once, and the host memory a save holds
stays within the budget (peak resident set size, measured in a process of its own).
``restore_memory_mb`` bounds a restore's host memory the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cnr_train.workload import TableSpec
from tests import REPO
from tests.jobs import make_job, restores_exactly
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointError, QuantizeConfig, read_table
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.selection import POLICIES
from torchrec_cnr.storage import open_storage
from torchrec_cnr.tracking import model_state

TABLES = [
    TableSpec("big", 3000, 16, "table_wise"),
    TableSpec("cw", 2000, 16, "column_wise"),
    TableSpec("small", 100, 16, "table_wise"),
]
BUDGET_MB = 0.03  # 31 KB: "big" alone stages 200 KB in a full save
QUANT = QuantizeConfig(method="adaptive", bits=4, min_rows=500)


def _train(root: str, refs: str, policy: str, budget: float | None, quantized: bool) -> None:
    job = make_job(
        TABLES, root, seed=1, data_seed=2, policy=policy, interval_steps=3,
        staging_memory_mb=budget, quantize=QUANT if quantized else QuantizeConfig(),
    )  # fmt: skip
    job.run(1, 9, refs)
    job.ckpt.close()


def _objects(root: str) -> int:
    """The data objects of a root (not its metadata files)."""
    return sum(len(files) for folder, _, files in os.walk(root) if Path(folder).name == "data")


@pytest.mark.dist
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "4-bit"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_save_larger_than_the_budget_is_written_in_chunks_and_is_the_same_checkpoint(
    policy: str, quantized: bool, tmp_path: Path
) -> None:
    roots = {b: str(tmp_path / f"ckpt-{b}") for b in ("whole", "chunked")}
    refs = {b: tmp_path / f"refs-{b}" for b in roots}
    for budget, name in ((None, "whole"), (BUDGET_MB, "chunked")):
        refs[name].mkdir()
        run_ranks(2, _train, roots[name], str(refs[name]), policy, budget, quantized)
    # fp32 chunks of at most 31 KB make many more objects than whole tensors cut at
    # 64 KB (4-bit ones are too small to tell: "big" encodes to 36 KB in all).
    if not quantized:
        assert _objects(roots["chunked"]) > 1.5 * _objects(roots["whole"])
    steps = Manifest.load(roots["chunked"]).steps()
    assert steps == Manifest.load(roots["whole"]).steps() == [3, 6, 9]
    for step in steps:
        for table in ("big", "cw", "small"):
            chunked, whole = (read_table(roots[b], table, step) for b in ("chunked", "whole"))
            if not quantized:
                assert torch.equal(chunked, whole), (table, step)
                continue
            # The quantizer's float reductions over another block of rows may round a
            # boundary value the other way: a rare code one step off, nothing more.
            differ = (chunked != whole).any(dim=1)
            assert differ.float().mean() < 0.002, (table, step, int(differ.sum()))
            step_size = (whole.amax(dim=1) - whole.amin(dim=1)) / 15
            assert ((chunked - whole).abs() <= step_size[:, None] * 1.01 + 1e-7).all()
        if not quantized:
            run_ranks(2, restores_exactly, TABLES, roots["chunked"], str(refs["chunked"]), step,
                      seed=9, data_seed=2)  # fmt: skip


def _nan_in_a_chunk(root: str) -> None:
    job = make_job(
        TABLES, root, seed=1, data_seed=2, policy="full", staging_memory_mb=BUDGET_MB,
        quantize=QUANT,
    )  # fmt: skip
    job.train(1)
    saved = {}
    if job.ckpt.rank == 1:
        for shard in model_state.local_shards(job.model):
            if shard.spec.rows > 1500:  # a chunk past the first
                saved[shard.spec.table] = shard.weight[1500].clone()
                shard.weight[1500, 3] = float("nan")
    assert job.ckpt.save(1)
    with pytest.raises(CheckpointError, match=r"row 1500 contains NaN or Inf"):
        job.ckpt.wait()
    assert Manifest.load(root).steps() == []
    for shard in model_state.local_shards(job.model):  # repaired: the next save commits
        if shard.spec.table in saved:
            shard.weight[1500] = saved[shard.spec.table]
    job.ckpt.save(2)
    job.ckpt.wait()
    assert Manifest.load(root).steps() == [2]
    job.ckpt.close()


@pytest.mark.dist
def test_a_nan_row_in_one_chunk_fails_every_rank_and_commits_nothing(root: str) -> None:
    run_ranks(2, _nan_in_a_chunk, root)


def _peak_mb(root: Path, budget: str, what: str = "save") -> float:
    out = subprocess.run(
        [sys.executable, "-m", "tests.contract.memory_job", str(root), budget, what],
        cwd=REPO,
        # Objects of the default size: the suite's tiny ones (conftest) multiply the
        # per-object bookkeeping, which is not what a user's save holds.
        env={k: v for k, v in os.environ.items() if k != "TORCHREC_CNR_OBJECT_MB"}
        | {"OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return float(got["peak_mb"] - got["before_mb"])


def test_the_staging_budget_bounds_the_host_memory_a_full_save_holds(tmp_path: Path) -> None:
    # The model holds a 64 MB table; its full checkpoint, staged whole, needs as much.
    unbounded = _peak_mb(tmp_path / "whole", "none")
    assert unbounded > 60, unbounded
    bounded = _peak_mb(tmp_path / "chunked", "8")
    assert bounded < 8 + 4, f"a save with staging_memory_mb=8 held {bounded:.1f} MB"
    # The bounded checkpoint is complete: every row of the 64 MB table is in it.
    assert Manifest.load(str(tmp_path / "chunked")).steps() == [1]
    assert (
        open_storage(str(tmp_path / "chunked")).tree_bytes(
            Manifest.load(str(tmp_path / "chunked")).checkpoints[0].id
        )
        > 64e6
    )


def test_the_restore_budget_bounds_the_host_memory_a_restore_holds(tmp_path: Path) -> None:
    # Unbounded, the 64 MB table is read into the staging buffers, verified, then copied
    # in; within 8 MB (staging and restore) it is verified a few pieces at a time, then
    # read straight into place.
    unbounded = _peak_mb(tmp_path / "whole", "none", "restore")
    assert unbounded > 60, unbounded
    bounded = _peak_mb(tmp_path / "bounded", "8", "restore")
    assert bounded < 2 * 8 + 4, f"a manager and restore within 8 MB held {bounded:.1f} MB"
