"""The rank pool behind ``run_ranks``: failures surface with their traceback, and a
failed call never leaves its ranks to the next one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.multiprocess import run_ranks


def _record(folder: str) -> None:
    rank = dist.get_rank()
    Path(folder, f"{rank}.txt").write_text(f"{os.getpid()} {os.environ.get('CNR_TEST_VALUE')}")


def _fail_on(rank: int) -> None:
    if dist.get_rank() == rank:
        raise ValueError("failed on purpose")
    dist.barrier()  # waits for a peer that has gone


@pytest.mark.dist
def test_ranks_see_the_callers_environment_and_a_failed_call_gets_fresh_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CNR_TEST_VALUE", "first")
    run_ranks(2, _record, str(tmp_path))
    before = {p.name: p.read_text().split() for p in tmp_path.iterdir()}
    assert {v[1] for v in before.values()} == {"first"}

    with pytest.raises(mp.ProcessRaisedException, match="failed on purpose"):
        run_ranks(2, _fail_on, 1)

    monkeypatch.setenv("CNR_TEST_VALUE", "second")
    run_ranks(2, _record, str(tmp_path))
    after = {p.name: p.read_text().split() for p in tmp_path.iterdir()}
    assert {v[1] for v in after.values()} == {"second"}
    assert not {v[0] for v in before.values()} & {v[0] for v in after.values()}, (
        "ranks of a failed call must not be reused"
    )
