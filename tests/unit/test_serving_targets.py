"""Tests for torchrec_cnr.serving.targets: writing checkpoint rows into serving models."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.inference.modules import quantize_embeddings
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

from tests import vm_flags
from torchrec_cnr.quantization import UNIFORM_METHODS, QuantizedRows, quantize
from torchrec_cnr.serving import (
    FloatTarget,
    QuantizedTarget,
    ServingFormat,
    StoredRows,
    TableSlot,
    targets,
)
from torchrec_cnr.serving.rows import finite_rows_of
from torchrec_cnr.snapshot.buffers import HUGE_PAGE

pytestmark = pytest.mark.timeout(120)

DTYPES = {8: torch.qint8, 4: torch.quint4x2, 2: torch.quint2x4}
FORMATS: dict[int, ServingFormat] = {8: "int8", 4: "int4", 2: "int2"}
ROWS = 48
# Table key -> (module path, table name, dim).
TABLES = {
    "sparse.ebc.embedding_bags.t0.weight": ("sparse.ebc", "t0", 8),
    "sparse.ebc.embedding_bags.t1.weight": ("sparse.ebc", "t1", 16),
    "sparse.ebc.embedding_bags.t2.weight": ("sparse.ebc", "t2", 64),
    "sparse.webc.embedding_bags.w0.weight": ("sparse.webc", "w0", 16),
    "sparse.ec.embeddings.e0.weight": ("sparse.ec", "e0", 16),
    "sparse.ec.embeddings.e1.weight": ("sparse.ec", "e1", 16),
}


class _Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        cpu = torch.device("cpu")
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"t{i}", embedding_dim=d, num_embeddings=ROWS, feature_names=[f"f{i}"]
                )
                for i, d in enumerate((8, 16, 64))
            ],
            device=cpu,
        )
        self.webc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="w0", embedding_dim=16, num_embeddings=ROWS, feature_names=["wf"]
                )
            ],
            is_weighted=True,
            device=cpu,
        )
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=f"e{i}", embedding_dim=16, num_embeddings=ROWS, feature_names=[f"g{i}"]
                )
                for i in range(2)
            ],
            device=cpu,
        )


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = _Sparse()
        self.dense = nn.Linear(8, 4)


def _model(seed: int = 0) -> _Model:
    torch.manual_seed(seed)
    model = _Model()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _quantized(model: nn.Module, bits: int, **kwargs: object) -> nn.Module:
    return quantize_embeddings(
        copy.deepcopy(model),
        dtype=DTYPES[bits],
        inplace=True,
        additional_qconfig_spec_keys=[EmbeddingCollection],
        additional_mapping={EmbeddingCollection: QuantEmbeddingCollection},
        **kwargs,  # type: ignore[arg-type]
    )


def _serving_bytes(model: nn.Module, key: str) -> Tensor:
    """(rows, row_bytes) uint8: the padded rows the lookup kernel reads, for ``key``."""
    path, name, _ = TABLES[key]
    module: Any = model.get_submodule(path)
    for configs, tbe in zip(module._key_to_tables.values(), module._emb_modules):
        names = [c.name for c in configs]
        if name in names:
            return tbe.split_embedding_weights(split_scale_shifts=False)[names.index(name)][0]
    raise AssertionError(key)


def _gaussian(n: int, dim: int, seed: int) -> Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def _ids(seed: int, n: int = 20) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(ROWS, generator=g)[:n].sort().values


def _stored(q: QuantizedRows) -> StoredRows:
    return StoredRows.quantized(q.to_tensors(), q.method, q.bits, q.shape)


def _row_l2(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm(dim=1).mean())


def test_tables_are_named_by_unsharded_state_dict_keys() -> None:
    model = _model()
    assert FloatTarget(model).tables() == {
        k: TableSlot(ROWS, d, "fp32") for k, (_, _, d) in TABLES.items()
    }
    for bits, fmt in FORMATS.items():
        served = _quantized(model, bits)
        target = QuantizedTarget(served)
        assert target.tables() == {k: TableSlot(ROWS, d, fmt) for k, (_, _, d) in TABLES.items()}
        assert set(target.tables()) <= set(served.state_dict())
        assert target.dense_names() == {"dense.weight": (4, 8), "dense.bias": (4,)}


@pytest.mark.parametrize("method", UNIFORM_METHODS)
@pytest.mark.parametrize("bits", [4, 2])
def test_same_width_rows_are_copied_byte_for_byte(bits: int, method: str) -> None:
    served = _quantized(_model(), bits)
    target = QuantizedTarget(served)
    for seed, (key, (_, _, dim)) in enumerate(TABLES.items()):
        ids = _ids(seed)
        before = _serving_bytes(served, key).clone()
        q = quantize(_gaussian(len(ids), dim, seed), method, bits)
        target.write_rows(key, ids, _stored(q))

        after = _serving_bytes(served, key)
        code_bytes = dim * bits // 8
        expected = torch.zeros(len(ids), after.shape[1], dtype=torch.uint8)
        expected[:, :4] = q.data[:, -4:]  # fp16 scale, fp16 bias first
        expected[:, 4 : 4 + code_bytes] = q.data[:, :code_bytes]
        assert torch.equal(after[ids], expected), key
        untouched = torch.ones(ROWS, dtype=torch.bool)
        untouched[ids] = False
        assert torch.equal(after[untouched], before[untouched]), key
        assert torch.equal(target.read_rows(key, ids), q.dequantize()), key


@pytest.mark.parametrize(("stored_bits", "bits"), [(2, 4), (2, 8), (3, 4), (3, 8), (4, 8)])
def test_narrower_uniform_rows_are_widened_without_error(stored_bits: int, bits: int) -> None:
    target = QuantizedTarget(_quantized(_model(), bits))
    for seed, (key, (_, _, dim)) in enumerate(TABLES.items()):
        ids = _ids(seed)
        q = quantize(_gaussian(len(ids), dim, seed), "adaptive", stored_bits)
        target.write_rows(key, ids, _stored(q))
        assert torch.equal(target.read_rows(key, ids), q.dequantize()), key


def _served_error(bits: int, rows: Tensor, ours: bool) -> float:
    """Mean row L2 error of ``rows`` served at ``bits``: written by QuantizedTarget, or
    quantized by TorchRec's quantize_embeddings from a model holding them."""
    n, dim = rows.shape
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=n, feature_names=["f"])
        ],
        device=torch.device("cpu"),
    )
    key, ids = "ebc.embedding_bags.t.weight", torch.arange(n)
    if not ours:
        with torch.no_grad():
            ebc.embedding_bags["t"].weight.copy_(rows)
    # quantize_embeddings swaps submodules only, so the EBC needs a parent.
    model = nn.ModuleDict({"ebc": ebc})
    target = QuantizedTarget(quantize_embeddings(model, dtype=DTYPES[bits], inplace=False))
    if ours:
        target.write_rows(key, ids, StoredRows.fp32(rows))
    return _row_l2(target.read_rows(key, ids), rows)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_float_rows_are_served_with_lower_error_than_torchrec_quantization(bits: int) -> None:
    rows = _gaussian(1000, 64, seed=bits)
    ours, torchrec = _served_error(bits, rows, True), _served_error(bits, rows, False)
    print(f"int{bits}: ours {ours:.5f} torchrec {torchrec:.5f} ratio {ours / torchrec:.4f}")
    assert ours <= torchrec


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_requantized_stored_rows_match_their_fp32_path(bits: int) -> None:
    """8-bit rows (fp32 scale/bias) and k-means rows are served as their dequantized values."""
    target = QuantizedTarget(_quantized(_model(), bits))
    key, ids = "sparse.ebc.embedding_bags.t2.weight", _ids(1)
    for method, stored_bits in (("adaptive", 8), ("kmeans", 4), ("fp16", 16)):
        q = quantize(_gaussian(len(ids), 64, 1), method, stored_bits)
        target.write_rows(key, ids, _stored(q))
        via_quantized = target.read_rows(key, ids)
        target.write_rows(key, ids, StoredRows.fp32(q.dequantize()))
        assert torch.equal(via_quantized, target.read_rows(key, ids)), method


def _kjt(features: list[str], seed: int, weighted: bool = False) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(features) * 3,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    weights = torch.rand(len(values), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(features, values, lengths, weights)


def _fill(target: QuantizedTarget, bits: int) -> None:
    """Every table gets new rows: stored at the serving width on some, fp32 on others."""
    for seed, (key, (_, _, dim)) in enumerate(TABLES.items()):
        ids = torch.arange(ROWS)
        rows = _gaussian(ROWS, dim, 100 + seed)
        if bits < 8 and seed % 2:
            target.write_rows(key, ids, _stored(quantize(rows, "adaptive", bits)))
        else:
            target.write_rows(key, ids, StoredRows.fp32(rows))


def _pooled(target: QuantizedTarget, key: str, kjt: KeyedJaggedTensor, feature: str) -> Tensor:
    """(batch, dim) weighted sums of the served rows, bag by bag."""
    table = target.read_rows(key, torch.arange(ROWS))
    jt = kjt[feature]
    weights = jt.to_dense_weights() if jt.weights_or_none() is not None else None
    out = []
    for b, idx in enumerate(jt.to_dense()):
        w = torch.ones(len(idx)) if weights is None else weights[b]
        out.append((table[idx] * w[:, None]).sum(0))
    return torch.stack(out)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_lookup_returns_pooled_served_rows(bits: int) -> None:
    served = _quantized(_model(), bits)
    target = QuantizedTarget(served)
    _fill(target, bits)
    sparse: Any = served.get_submodule("sparse")

    kjt = _kjt(["f0", "f1", "f2"], seed=bits)
    pooled = sparse.ebc(kjt).to_dict()
    for i in range(3):
        want = _pooled(target, f"sparse.ebc.embedding_bags.t{i}.weight", kjt, f"f{i}")
        torch.testing.assert_close(pooled[f"f{i}"], want, rtol=1e-5, atol=1e-5)

    wkjt = _kjt(["wf"], seed=bits, weighted=True)
    got = sparse.webc(wkjt).to_dict()["wf"]
    want = _pooled(target, "sparse.webc.embedding_bags.w0.weight", wkjt, "wf")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # One id per bag: the kernel's row must be read_rows' exactly.
    ids = torch.arange(ROWS)
    one = KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1", "f2"], torch.cat([ids, ids, ids]), torch.ones(3 * ROWS, dtype=torch.int64)
    )
    out = sparse.ebc(one).to_dict()
    for i in range(3):
        assert torch.equal(
            out[f"f{i}"], target.read_rows(f"sparse.ebc.embedding_bags.t{i}.weight", ids)
        )
    seq = sparse.ec(
        KeyedJaggedTensor.from_lengths_sync(
            ["g0", "g1"], torch.cat([ids, ids]), torch.ones(2 * ROWS, dtype=torch.int64)
        )
    )
    for i in range(2):
        assert torch.equal(
            seq[f"g{i}"].values(), target.read_rows(f"sparse.ec.embeddings.e{i}.weight", ids)
        )


def test_tables_left_unquantized_take_rows_as_values() -> None:
    model = _model()
    # By default quantize_embeddings maps no EmbeddingCollection; per_table_weight_dtype
    # keeps t0 in fp16.
    served = quantize_embeddings(
        copy.deepcopy(model),
        dtype=torch.quint4x2,
        inplace=True,
        per_table_weight_dtype={"t0": torch.float16},
    )
    target = QuantizedTarget(served)
    slots = target.tables()
    assert slots["sparse.ec.embeddings.e0.weight"].format == "fp32"
    assert slots["sparse.ebc.embedding_bags.t0.weight"].format == "fp16"
    assert "sparse.ec.embeddings.e0.weight" not in target.dense_names()
    ids = _ids(3)
    rows = _gaussian(len(ids), 16, 3)
    target.write_rows("sparse.ec.embeddings.e0.weight", ids, StoredRows.fp32(rows))
    assert torch.equal(served.state_dict()["sparse.ec.embeddings.e0.weight"][ids], rows)
    rows8 = _gaussian(len(ids), 8, 4)
    target.write_rows("sparse.ebc.embedding_bags.t0.weight", ids, StoredRows.fp32(rows8))
    assert torch.equal(
        target.read_rows("sparse.ebc.embedding_bags.t0.weight", ids), rows8.half().float()
    )


def test_float_target_copies_rows_into_weights() -> None:
    model = _model()
    target = FloatTarget(model)
    for seed, (key, (_, _, dim)) in enumerate(TABLES.items()):
        ids = _ids(seed)
        rows = _gaussian(len(ids), dim, seed)
        target.write_rows(key, ids, StoredRows.fp32(rows))
        assert torch.equal(model.state_dict()[key][ids], rows), key
        q = quantize(rows, "adaptive", 4)
        target.write_rows(key, ids, _stored(q))
        assert torch.equal(model.state_dict()[key][ids], q.dequantize()), key
        assert torch.equal(target.read_rows(key, ids), q.dequantize()), key


@pytest.mark.parametrize("quantized", [False, True])
def test_dense_tensors_are_written_by_name(quantized: bool) -> None:
    model = _model()
    served = _quantized(model, 4) if quantized else model
    target = QuantizedTarget(served) if quantized else FloatTarget(served)
    assert target.dense_names() == {"dense.weight": (4, 8), "dense.bias": (4,)}
    new = torch.randn(4, 8)
    target.write_dense("dense.weight", new)
    assert torch.equal(served.state_dict()["dense.weight"], new)
    with pytest.raises(ValueError, match="dense.bias"):
        target.write_dense("dense.bias", torch.zeros(5))
    with pytest.raises(ValueError, match="nope"):
        target.write_dense("nope", new)


@pytest.mark.parametrize("quantized", [False, True])
def test_bad_writes_raise_value_error_naming_the_key(quantized: bool) -> None:
    model = _model()
    target = QuantizedTarget(_quantized(model, 4)) if quantized else FloatTarget(model)
    key = "sparse.ebc.embedding_bags.t1.weight"
    ids = torch.tensor([1, 5])
    with pytest.raises(ValueError, match="sparse.ebc.embedding_bags.t9.weight"):
        target.write_rows(
            "sparse.ebc.embedding_bags.t9.weight", ids, StoredRows.fp32(torch.zeros(2, 16))
        )
    with pytest.raises(ValueError, match=key):
        target.write_rows(key, ids, StoredRows.fp32(torch.zeros(2, 8)))
    with pytest.raises(ValueError, match=key):
        target.write_rows(key, ids, _stored(quantize(torch.zeros(2, 8), "adaptive", 4)))
    with pytest.raises(ValueError, match="ascending"):
        target.write_rows(key, torch.tensor([5, 1]), StoredRows.fp32(torch.zeros(2, 16)))
    with pytest.raises(ValueError, match="rows"):
        target.write_rows(key, torch.tensor([1, ROWS]), StoredRows.fp32(torch.zeros(2, 16)))
    with pytest.raises(ValueError, match=key):
        target.read_rows(key, torch.tensor([1, 5], dtype=torch.int32))


@pytest.mark.parametrize("bits", [8, 4])
def test_non_finite_rows_are_rejected_for_quantized_serving(bits: int) -> None:
    target = QuantizedTarget(_quantized(_model(), bits))
    key = "sparse.ebc.embedding_bags.t1.weight"
    rows = torch.zeros(2, 16)
    rows[1, 3] = float("nan")
    with pytest.raises(ValueError, match=key):
        target.write_rows(key, torch.tensor([1, 5]), StoredRows.fp32(rows))


def test_targets_refuse_models_of_the_other_kind() -> None:
    model = _model()
    with pytest.raises(ValueError, match="QuantizedTarget"):
        FloatTarget(_quantized(model, 4))
    with pytest.raises(ValueError, match="FloatTarget"):
        QuantizedTarget(model)
    with pytest.raises(ValueError, match="no torchrec"):
        FloatTarget(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="exactly one"):
        StoredRows()


def test_prepared_rows_are_written_where_and_as_prepared() -> None:
    served = _quantized(_model(), 4)
    target = QuantizedTarget(served)
    key, ids = "sparse.ebc.embedding_bags.t2.weight", _ids(5)
    rows = _gaussian(len(ids), 64, 5)
    before = _serving_bytes(served, key).clone()
    prepared = target.prepare(key, StoredRows.fp32(rows))
    assert torch.equal(_serving_bytes(served, key), before)  # preparing leaves the model
    target.write_prepared(key, ids, prepared)
    written = target.read_rows(key, ids)
    target.write_rows(key, ids, StoredRows.fp32(rows))
    assert torch.equal(written, target.read_rows(key, ids))
    with pytest.raises(ValueError, match="prepared for"):
        target.write_prepared("sparse.ebc.embedding_bags.t1.weight", ids, prepared)
    with pytest.raises(ValueError, match="prepared for"):
        target.write_prepared(key, ids[:-1], prepared)


def test_quantized_rows_take_their_row_count_from_the_parts() -> None:
    q = quantize(_gaussian(5, 16, 0), "kmeans", 3)
    rows = StoredRows.quantized(q.to_tensors(), "kmeans", 3, 16)
    assert rows.shape == (5, 16)
    assert torch.equal(rows.dequantize(), q.dequantize())


def _lookups(sparse: Any) -> list[Tensor]:
    """Every table's rows as the model's own forward serves them (one id per bag)."""
    ids = torch.arange(ROWS)
    ones = torch.ones(3 * ROWS, dtype=torch.int64)
    out = sparse.ebc(KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], ids.repeat(3), ones))
    return [t.clone() for t in out.to_dict().values()]


@pytest.mark.parametrize("bits", [None, 4, 2], ids=["fp32", "int4", "int2"])
def test_swap_mode_writes_aside_and_serves_every_table_at_once(bits: int | None) -> None:
    model = _model()
    served = model if bits is None else _quantized(model, bits)
    target = FloatTarget(served) if bits is None else QuantizedTarget(served)
    sparse: Any = served.get_submodule("sparse")
    keys = [k for k in TABLES if ".ebc." in k]
    before = _lookups(sparse)
    assert target.enable_swap() > 0 and target.swapping
    writes = []
    for seed, key in enumerate(keys):
        ids = _ids(seed)
        rows = target.prepare(key, StoredRows.fp32(_gaussian(len(ids), TABLES[key][2], seed)))
        target.write_prepared(key, ids, rows, spare=True)
        writes.append((key, ids, rows))
    after_writes = _lookups(sparse)
    assert all(torch.equal(a, b) for a, b in zip(before, after_writes)), "the spare is not served"
    target.swap()
    swapped = _lookups(sparse)
    for (key, ids, _), now in zip(writes, swapped):
        changed = torch.zeros(ROWS, dtype=torch.bool)
        changed[ids] = True
        old = before[keys.index(key)]
        assert not torch.equal(now[changed], old[changed]), key
        assert torch.equal(now[~changed], old[~changed]), key
        assert torch.equal(now, target.read_rows(key, torch.arange(ROWS))), key
    # The spare is now the copy served before: it lacks these writes until they are
    # written again (the follower does), after which a swap serves the same rows.
    target.swap()
    assert all(torch.equal(a, b) for a, b in zip(before, _lookups(sparse)))
    for key, ids, rows in writes:
        target.write_prepared(key, ids, rows, spare=True)
    target.swap()
    assert all(torch.equal(a, b) for a, b in zip(swapped, _lookups(sparse)))
    target.sync_spare()
    target.swap()
    assert all(torch.equal(a, b) for a, b in zip(swapped, _lookups(sparse)))


def test_a_large_table_is_advised_for_huge_pages_and_its_swap_copy_made_in_them() -> None:
    # Rows written at random places of a table: fewer misses in the TLB in huge pages.
    big = EmbeddingBagConfig(name="big", embedding_dim=64, num_embeddings=16_384,
                             feature_names=["f"])  # 4 MiB  # fmt: skip
    model = nn.ModuleDict({"ebc": EmbeddingBagCollection(tables=[big], device=torch.device("cpu"))})
    key = "ebc.embedding_bags.big.weight"
    first = model.get_parameter(key).data_ptr()
    before = model.get_parameter(key).detach().clone()
    target = FloatTarget(model)
    assert "hg" in vm_flags(-(-first // HUGE_PAGE) * HUGE_PAGE), "the served table is advised"
    assert target.enable_swap() == before.numel() * 4
    ids = torch.tensor([5, 9000, 16_383])
    rows = _gaussian(len(ids), 64, 0)
    target.write_prepared(key, ids, target.prepare(key, StoredRows.fp32(rows)), spare=True)
    assert torch.equal(model.get_parameter(key), before), "the spare is not served"
    target.swap()
    served = model.get_parameter(key)
    assert served.data_ptr() != first and "hg" in vm_flags(served.data_ptr())
    expected = before.clone()
    expected[ids] = rows
    assert torch.equal(served, expected) and torch.equal(target.read_rows(key, ids), rows)
    elsewhere = torch.empty(3 * HUGE_PAGE, dtype=torch.uint8, device="meta")
    assert targets._copy_aside(elsewhere).device == elsewhere.device  # another device's own


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_row_is_finite_exactly_when_every_element_is(dtype: torch.dtype) -> None:
    values = torch.randn(6, 8).to(dtype)
    big = torch.finfo(dtype).max
    values[1, 2] = float("nan")
    values[2, 0] = float("inf")
    values[3, 1], values[3, 5] = float("inf"), -float("inf")
    values[4] = big  # finite elements whose sum overflows: still a finite row
    values[5, 7] = -float("inf")
    got = finite_rows_of(values)
    assert got.tolist() == torch.isfinite(values).all(dim=1).tolist()
    assert got.tolist() == [True, False, False, False, True, False]
    assert finite_rows_of(values[[0, 4]]).tolist() == [True, True]  # their sum overflows
    assert finite_rows_of(values[[0]]).tolist() == [True]
