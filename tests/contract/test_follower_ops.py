"""Operating a follower: pin and unpin, rollback, the accept gate, metrics, retries.

- A poll that finds nothing new costs one stat of the manifest, no bytes.
- ``pin()`` keeps the served step and reads nothing while pinned; ``rollback(step)``
  serves an earlier committed step exactly, reading only the rows changed in between,
  and stays there until ``unpin()``; a step retention removed is refused, naming it.
- The accept gate sees each update before it is served: a refused update leaves the last
  accepted step served, is reported, is not read again, and the next commit is served
  exactly. The default gate refuses non-finite rows (fp32 and quantized) and dense tensors.
- Metrics in Prometheus's text format say what the follower did.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.contract.test_follower import _assert_serves_the_root, _train
from tests.models import unsharded
from tests.multiprocess import run_ranks
from torchrec_cnr import CnrError, export_state_dict
from torchrec_cnr.offline import list_checkpoints
from torchrec_cnr.quantization import quantize
from torchrec_cnr.serving import (
    FloatTarget,
    Follower,
    FollowerOptions,
    PendingUpdate,
    StoredRows,
    finite_rows,
)
from torchrec_cnr.serving.metrics import metrics_text
from torchrec_cnr.serving.plan import UpdatePlan
from torchrec_cnr.serving.rows import finite_rows_of


def _serves_step(model: torch.nn.Module, root: str, step: int) -> None:
    want = export_state_dict(root, step=step)
    got = model.state_dict()
    bad = [k for k, v in want.items() if not torch.equal(v, got[k])]
    assert not bad, f"served tensors differ from step {step}: {bad}"


@pytest.mark.dist
def test_pin_reads_nothing_and_rollback_reads_only_the_rows_changed_in_between(
    root: str,
) -> None:
    for last in (4, 8, 12):
        run_ranks(2, _train, root, "ebc", "intermittent", last, {})
    model, _, _ = unsharded("ebc", device="cpu")
    target = FloatTarget(model)
    follower = Follower(root, target)
    assert follower.poll() == 12
    total = follower.reports[-1].rows  # a cold start reads every row
    # Data-parallel tables are replicated, saved whole with the dense state: no row of them
    # is tracked, and an update that changes the dense state reads them whole.
    sharded = {t.state_dict_key for t in list_checkpoints(root)[-1].tables.values()}
    replicated = sum(s.num_embeddings for k, s in target.tables().items() if k not in sharded)

    assert follower.pin() == 12 and follower.pinned
    run_ranks(2, _train, root, "ebc", "intermittent", 14, {})
    before = follower.storage.bytes_read
    assert follower.poll() == 12
    assert follower.storage.bytes_read == before, "a pinned follower read the root"

    assert follower.rollback(4) == 4
    _serves_step(model, root, 4)
    back = follower.reports[-1]
    assert back.rewind and not back.cold and back.step == 4
    changed = sum(i.rows_changed or 0 for i in list_checkpoints(root) if 4 < i.step <= 12)
    assert 0 < back.rows <= min(changed + replicated, total - 1), (back.rows, changed, total)
    assert follower.poll() == 4  # still pinned

    with pytest.raises(ValueError, match="older than the served 4"):
        follower.rollback(8)
    with pytest.raises(ValueError, match="5"):
        follower.pin(5)  # never committed
    assert follower.step == 4
    _serves_step(model, root, 4)

    follower.unpin()
    assert follower.poll() == 14
    _assert_serves_the_root(model, root)
    # A poll that finds nothing new stats the manifest and reads nothing.
    before, requests = follower.storage.bytes_read, follower.storage.requests
    assert follower.poll() == 14
    assert (follower.storage.bytes_read, follower.storage.requests) == (before, requests + 1)
    follower.close()


@pytest.mark.dist
def test_a_refused_update_keeps_the_last_accepted_step_and_is_not_read_again(
    root: str,
) -> None:
    seen: list[int] = []

    def gate(update: PendingUpdate) -> str | None:
        seen.append(update.step)
        return "step 6 is bad" if update.step == 6 else None

    model, _, _ = unsharded("ebc", device="cpu")
    follower = Follower(root, FloatTarget(model), FollowerOptions(accept=gate))
    run_ranks(2, _train, root, "ebc", "consecutive", 4, {})
    assert follower.poll() == 4
    run_ranks(2, _train, root, "ebc", "consecutive", 6, {})
    assert follower.poll() == 4
    _serves_step(model, root, 4)
    assert [(r.step, r.reason) for r in follower.refused] == [(6, "step 6 is bad")]
    before, requests = follower.storage.bytes_read, follower.storage.requests
    assert follower.poll() == 4 and seen == [4, 6], seen  # not prepared again
    assert follower.storage.bytes_read == before, "nothing is read again"
    assert follower.storage.requests == requests + 1, "one stat of the manifest"
    with pytest.raises(CnrError, match="step 6 is bad"):
        follower.pin(6)
    follower.unpin()

    run_ranks(2, _train, root, "ebc", "consecutive", 8, {})
    assert follower.poll() == 8  # its update carries step 6's rows too
    _assert_serves_the_root(model, root)

    text = metrics_text(follower)
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert got["cnr_follower_served_step"] == 8
    assert got["cnr_follower_updates_total"] == len(follower.reports) == 2
    assert got["cnr_follower_refused_updates_total"] == len(follower.refused) == 2  # pin(6) too
    assert got["cnr_follower_failed_polls_total"] == 0
    assert got["cnr_follower_polls_total"] == 4  # pin(6) is not a poll
    assert got["cnr_follower_idle_polls_total"] == 2  # the refused step, then the stat
    assert got["cnr_follower_requests_total"] == follower.storage.requests
    assert got["cnr_follower_pinned"] == 0
    assert got["cnr_follower_rows_total"] == sum(r.rows for r in follower.reports)
    assert got["cnr_follower_last_update_bytes"] == follower.reports[-1].bytes_read
    assert got["cnr_follower_last_update_requests"] == follower.reports[-1].requests > 0
    follower.close()


def _pending(**rows: StoredRows) -> PendingUpdate:
    update = PendingUpdate(UpdatePlan(target=None))  # type: ignore[arg-type]
    update.rows = [(key, torch.arange(r.shape[0]) + 10, r) for key, r in rows.items()]
    return update


def test_the_default_gate_refuses_non_finite_rows_and_dense_tensors() -> None:
    good = torch.randn(6, 8)
    assert finite_rows(_pending(a=StoredRows.fp32(good))) is None
    bad = good.clone()
    bad[2, 3] = float("nan")
    bad[4, 0] = float("inf")
    reason = finite_rows(_pending(a=StoredRows.fp32(good), b=StoredRows.fp32(bad)))
    assert reason is not None and "b rows [12, 14]" in reason and "a rows" not in reason

    q = quantize(good, "adaptive", 4)
    parts = q.to_tensors()
    assert finite_rows(_pending(c=StoredRows.quantized(parts, "adaptive", 4, 8))) is None
    data = parts["data"].clone()  # [4-bit codes | fp16 scale | fp16 bias] per row
    data[1, -4:-2] = torch.tensor([float("inf")], dtype=torch.float16).view(torch.uint8)
    reason = finite_rows(_pending(c=StoredRows.quantized({"data": data}, "adaptive", 4, 8)))
    assert reason is not None and "c rows [11]" in reason, reason

    update = _pending(a=StoredRows.fp32(good))
    update.dense = {"over.weight": torch.tensor([1.0, float("nan")])}
    assert finite_rows(update) == "non-finite values in over.weight"


@pytest.mark.parametrize(("method", "bits"), [("adaptive", 2), ("asymmetric", 3), ("adaptive", 4),
                                              ("adaptive", 8), ("kmeans", 4)])  # fmt: skip
def test_the_gate_finds_the_rows_dequantizing_would_find_non_finite(method: str, bits: int) -> None:
    """2/3/4-bit rows are judged by their scale and bias, not dequantized: the same rows
    as dequantizing them finds, whichever of scale or bias is NaN or infinite."""
    gen = torch.Generator().manual_seed(bits)
    parts = quantize(torch.randn(64, 12, generator=gen), method, bits).to_tensors()
    name = "data" if "data" in parts else "codebook"
    damaged = parts[name].clone()
    width = 2 if damaged.dtype == torch.uint8 and bits < 8 else 4  # fp16 or fp32 scale, bias
    for row, at, value in [(3, 0, "nan"), (17, 1, "inf"), (40, 0, "-inf"), (41, 1, "nan")]:
        if name == "codebook":  # every centroid of a k-means row
            damaged[row] = float(value)
            continue
        dtype = torch.float16 if width == 2 else torch.float32
        raw = torch.tensor([float(value)], dtype=dtype).view(torch.uint8)
        end = damaged.shape[1] - (1 - at) * width
        damaged[row, end - width : end] = raw
    rows = StoredRows.quantized({**parts, name: damaged}, method, bits, 12)
    expected = finite_rows_of(rows.dequantize())
    assert not bool(expected[[3, 17, 40, 41]].any()) and int((~expected).sum()) == 4
    assert torch.equal(rows.finite(), expected)
    reason = finite_rows(_pending(t=rows))
    assert reason is not None and "t rows [13, 27, 50, 51]" in reason, reason
