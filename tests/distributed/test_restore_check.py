"""The app's restore check (``cnr_train.report.check_restore``) says what a restore must give
of a quantized root that jobs resume again and again: a row that an earlier restore set
and training has not changed since comes back as the live row itself, not re-quantized;
the other rows as the quantizer's round trip of the live row. A changed row is a mismatch.
"""

from __future__ import annotations

import pytest
import torch

from cnr_train.report import check_restore
from cnr_train.workload import TableSpec
from tests.jobs import make_job
from tests.multiprocess import run_ranks
from torchrec_cnr import QuantizeConfig
from torchrec_cnr.offline import list_checkpoints
from torchrec_cnr.tracking import model_state

pytestmark = pytest.mark.dist

TABLES = [TableSpec("a", 3000, 16, "table_wise"), TableSpec("b", 2000, 16, "row_wise")]
FOUR_BIT = QuantizeConfig(method="adaptive", bits=4, min_rows=0)


def _across_a_restore(root: str) -> None:
    first = make_job(TABLES, root, seed=1, data_seed=2, policy="intermittent", quantize=FOUR_BIT)
    first.train(3)
    assert first.ckpt.save(3)
    first.ckpt.close()
    second = make_job(TABLES, root, seed=5, data_seed=2, policy="intermittent", quantize=FOUR_BIT)
    assert second.ckpt.restore() == 3  # rows now hold the 4-bit round trip of step 3's
    second.train(2)  # a few rows change; most keep their restored values
    assert second.ckpt.save(5)
    second.ckpt.wait()
    third = make_job(TABLES, root, seed=9, data_seed=2, policy="intermittent", quantize=FOUR_BIT)
    assert third.ckpt.restore() == 5
    infos = list_checkpoints(root)
    chain = [i for i in infos if i.step in infos[-1].chain]
    assert [i.kind for i in chain] == ["full", "delta"], chain
    ok, _ = check_restore(second.model, third.model, chain, FOUR_BIT)
    assert ok, "the restore of step 5 holds every row as stored"
    # A restored row that differs from what was stored is a mismatch, on whichever rank.
    shard = model_state.local_shards(third.model)[0]
    with torch.no_grad():
        shard.weight[7] += 0.25
    ok, _ = check_restore(second.model, third.model, chain, FOUR_BIT)
    assert not ok
    second.ckpt.close()
    third.ckpt.close()


def test_rows_a_restore_set_and_training_left_come_back_as_they_are(root: str) -> None:
    run_ranks(2, _across_a_restore, root)
