"""Tests for torchrec_cnr.quantization (per-row checkpoint quantization)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchrec_cnr.quantization import (
    BITS,
    CAST_METHODS,
    CODE_METHODS,
    METHODS,
    UNIFORM_METHODS,
    QuantizedRows,
    _adaptive,
    _kmeans,
    _uniform,
    pack_codes,
    packed_nbytes,
    padded_dim,
    quantize,
    search_ranges,
    select_bits,
    unpack_codes,
)

FP16_EPS = 2.0**-11  # unit roundoff of fp16
QUANT_CASES = [(m, b) for m in CODE_METHODS for b in BITS] + [(m, 4) for m in CAST_METHODS]


def _gaussian(n: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g)


def _row_l2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=1)


def _uniform_bound(x: torch.Tensor, method: str, bits: int) -> torch.Tensor:
    """Per-row max |x - x_hat| allowed for symmetric/asymmetric quantization.

    Half a quantization step, plus the rounding slack of the stored scale and
    bias (fp16 below 8 bits: bias off by |min|*eps, scale by range*eps, which
    the top level multiplies by 2**bits - 1; fp32 at 8 bits).
    """
    levels = (1 << bits) - 1
    mn, mx = x.amin(1), x.amax(1)
    mag = torch.maximum(mn.abs(), mx.abs())
    span = (mx - mn) if method == "asymmetric" else 2 * mag
    eps = FP16_EPS if bits < 8 else 2.0**-22
    slack = 2 * eps * (span + 2 * mag) + 1e-7
    return span / (2 * levels) + slack


# --------------------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [1, 3, 7, 8, 13, 16, 33, 64, 65])
def test_pack_unpack_roundtrips_random_codes_exactly(bits: int, dim: int) -> None:
    g = torch.Generator().manual_seed(bits * 100 + dim)
    codes = torch.randint(0, 1 << bits, (11, dim), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (11, packed_nbytes(dim, bits))
    assert packed.shape[1] % 2 == 0 or bits == 8  # fp16 scale/bias stay aligned
    assert torch.equal(unpack_codes(packed, bits, dim), codes)


def test_packing_uses_fbgemm_low_bits_first_order() -> None:
    codes = torch.tensor([[1, 2, 3, 0, 3, 3, 0, 1]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x03, 0x33, 0x10]]
    assert pack_codes(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4, 3 | 3 << 2 | 1 << 6]]
    assert padded_dim(5, 2) == 8 and padded_dim(5, 3) == 16 and padded_dim(5, 4) == 8


def test_unpack_rejects_wrong_packed_width() -> None:
    with pytest.raises(ValueError, match="expected"):
        unpack_codes(torch.zeros(2, 3, dtype=torch.uint8), 4, 8)


# ------------------------------------------------------------------ FBGEMM layout


@pytest.mark.skipif(_uniform.fbgemm_ops() is None, reason="fbgemm_gpu not importable")
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [8, 40, 64])
def test_torch_encoder_reproduces_fbgemm_fused_rows(bits: int, dim: int) -> None:
    # The torch path is what CUDA (and 3-bit) use; it must write FBGEMM's bytes.
    x = _gaussian(500, dim, seed=dim) * 3 + 1
    x[0] = 0.1234567  # constant row with a non-fp16 value
    ops = _uniform.fbgemm_ops()
    assert ops is not None
    lo, hi = x.amin(1), x.amax(1)
    if bits == 8:
        ref = ops.FloatToFused8BitRowwiseQuantized(x)
        ours = _uniform._encode_8bit_torch(x, lo, hi)
        assert torch.equal(ref[:, dim:], ours[:, dim:])  # fp32 scale/bias
        diff = (ref[:, :dim].int() - ours[:, :dim].int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3  # fma/ties only
    else:
        ref = ops.FloatToFusedNBitRowwiseQuantizedSBHalf(x, bits)
        assert torch.equal(ref, _uniform._encode_nbit_torch(x, lo, hi, bits))
        codes, scale, bias = _uniform.split_fused(ref, bits, dim)
        manual = bias[:, None] + scale[:, None] * codes.float()
        assert torch.equal(ops.FusedNBitRowwiseQuantizedSBHalfToFloat(ref, bits), manual)


@pytest.mark.parametrize("method", UNIFORM_METHODS)
@pytest.mark.parametrize("bits", BITS)
def test_torch_path_used_on_gpu_matches_the_fbgemm_path_on_cpu(
    method: str, bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPU tensors (and CPU installs without fbgemm_gpu) never call FBGEMM;
    # forcing that path on CPU checks its bytes decode like the kernel's.
    x = _gaussian(400, 21, seed=bits)
    x[0] = 0.0
    x[1] = 0.1234567
    with_fbgemm = quantize(x, method, bits)
    monkeypatch.setattr(_uniform, "_cpu_ops", lambda t: None)
    monkeypatch.setattr(_uniform, "_ENCODE_CHUNK_ELEMS", 1000)  # several chunks
    torch_only = quantize(x, method, bits)
    assert torch_only.to_tensors()["data"].shape == with_fbgemm.to_tensors()["data"].shape
    step = (x.amax(1) - x.amin(1)) / ((1 << bits) - 1)
    diff = (torch_only.dequantize() - with_fbgemm.dequantize()).abs()
    assert (diff <= step[:, None] * 1.001 + 1e-6).all()  # at most one level apart
    assert (diff > 1e-6).float().mean() < 1e-3  # and that only on rounding ties
    ops = _uniform.fbgemm_ops()  # FBGEMM's own decoder reads the torch path's bytes
    if ops is not None and bits in (2, 4):
        fb = ops.FusedNBitRowwiseQuantizedSBHalfToFloat(torch_only.data, bits)[:, :21]
        assert torch.equal(fb, torch_only.dequantize())
    elif ops is not None and bits == 8:
        fb = ops.Fused8BitRowwiseQuantizedToFloat(torch_only.data)
        assert torch.equal(fb, torch_only.dequantize())


@pytest.mark.skipif(_uniform.fbgemm_ops() is None, reason="fbgemm_gpu not importable")
def test_asymmetric_stores_fbgemm_kernel_output_and_pads_odd_dims() -> None:
    x = _gaussian(64, 6)
    ops = _uniform.fbgemm_ops()
    assert ops is not None
    padded = torch.cat([x, x[:, -1:].expand(-1, 2)], dim=1)  # 4-bit rows pad to 8 columns
    q = quantize(x, "asymmetric", 4)
    assert torch.equal(
        q.to_tensors()["data"], ops.FloatToFusedNBitRowwiseQuantizedSBHalf(padded, 4)
    )
    q8 = quantize(x, "asymmetric", 8)
    assert torch.equal(q8.to_tensors()["data"], ops.FloatToFused8BitRowwiseQuantized(x))


# --------------------------------------------------------------------- error bounds


@pytest.mark.parametrize("method", ["asymmetric", "symmetric"])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [5, 64])
def test_uniform_error_is_within_half_a_step_plus_rounding_slack(
    method: str, bits: int, dim: int
) -> None:
    x = _gaussian(300, dim, seed=bits) * 2 + 0.5
    err = (quantize(x, method, bits).dequantize() - x).abs().amax(1)
    assert (err <= _uniform_bound(x, method, bits)).all()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_adaptive_mean_error_is_below_asymmetric_on_gaussian_rows(bits: int) -> None:
    x = _gaussian(2000, 64, seed=1)
    adaptive = _row_l2(quantize(x, "adaptive", bits).dequantize(), x).mean()
    asymmetric = _row_l2(quantize(x, "asymmetric", bits).dequantize(), x).mean()
    assert adaptive < asymmetric


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_adaptive_requantizing_a_restored_row_adds_almost_no_error(bits: int) -> None:
    # A restored row that training leaves alone is quantized again by the next
    # baseline; the error of restores must not compound on such rows.
    x = _gaussian(2000, 64, seed=3) * 0.05
    once = quantize(x, "adaptive", bits).dequantize()
    twice = quantize(once, "adaptive", bits).dequantize()
    assert _row_l2(twice, once).mean() < 0.01 * _row_l2(once, x).mean()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kmeans_mean_error_is_below_asymmetric_on_gaussian_rows(bits: int) -> None:
    x = _gaussian(2000, 64, seed=2)
    kmeans = _row_l2(quantize(x, "kmeans", bits).dequantize(), x).mean()
    asymmetric = _row_l2(quantize(x, "asymmetric", bits).dequantize(), x).mean()
    assert kmeans < asymmetric


def test_float_casts_stay_within_their_precision_and_none_is_exact() -> None:
    x = _gaussian(200, 33) * 10
    assert ((quantize(x, "fp16").dequantize() - x).abs() <= x.abs() * FP16_EPS + 2.0**-25).all()
    assert ((quantize(x, "bf16").dequantize() - x).abs() <= x.abs() * 2.0**-8).all()
    assert torch.equal(quantize(x, "none").dequantize(), x)


def test_adaptive_4bit_error_is_at_most_pytorch_greedy_prepack() -> None:
    prepack = getattr(torch.ops.quantized, "embedding_bag_4bit_prepack", None)
    if prepack is None:  # pragma: no cover - depends on the torch build
        pytest.skip("torch.ops.quantized.embedding_bag_4bit_prepack missing")
    x = _gaussian(3000, 64, seed=3)
    ref = torch.ops.quantized.embedding_bag_4bit_unpack(prepack(x, optimized_qparams=True))
    ours = quantize(x, "adaptive", 4).dequantize()
    assert _row_l2(ours, x).mean() <= _row_l2(ref, x).mean()


def test_exact_greedy_search_matches_pytorch_greedy_error() -> None:
    # stride=1, no polish is PyTorch's algorithm (keeping the best range seen).
    x = _gaussian(500, 64, seed=4)
    ref = torch.ops.quantized.embedding_bag_4bit_unpack(
        torch.ops.quantized.embedding_bag_4bit_prepack(x, optimized_qparams=True)
    )
    lo, hi = search_ranges(x, 4, 200, 0.16, stride=1, refine=0)
    ours = _uniform.decode(_uniform.encode_range(x, lo, hi, 4), 4, 64)
    assert _row_l2(ours, x).mean() <= _row_l2(ref, x).mean() * (1 + 1e-4)


@pytest.mark.parametrize("bits", BITS)
def test_adaptive_never_worse_than_asymmetric_per_row(bits: int) -> None:
    x = torch.cat([_gaussian(200, 24, seed=5), _gaussian(200, 24, seed=6).exp()])
    adaptive = _row_l2(quantize(x, "adaptive", bits).dequantize(), x)
    asymmetric = _row_l2(quantize(x, "asymmetric", bits).dequantize(), x)
    assert (adaptive <= asymmetric * (1 + 1e-3) + 1e-6 * x.norm(dim=1)).all()


@pytest.mark.parametrize(("method", "bits"), [("adaptive", 4), ("adaptive", 8), ("kmeans", 3)])
def test_chunked_processing_matches_one_big_chunk(
    method: str, bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _gaussian(1000, 19, seed=7)
    whole = quantize(x, method, bits).to_tensors()
    monkeypatch.setattr(_adaptive, "_CHUNK_ELEMS", 19 * 130)  # 130-row chunks, ragged tail
    monkeypatch.setattr(_kmeans, "_CHUNK_ROWS", 130)
    chunked = quantize(x, method, bits).to_tensors()
    assert all(torch.equal(whole[k], chunked[k]) for k in whole)


# ------------------------------------------------------------- property-based tests


@st.composite
def _rows(draw: st.DrawFn) -> torch.Tensor:
    n = draw(st.integers(0, 50))
    d = draw(st.integers(1, 70))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([1e-3, 1.0, 100.0]))
    x = _gaussian(n, d, seed) * scale + draw(st.sampled_from([0.0, 3.0]))
    if n and draw(st.booleans()):  # some constant rows
        k = draw(st.integers(0, n - 1))
        x[: k + 1] = x[: k + 1, :1]
    return x


def _allowed_error_per_row(x: torch.Tensor, method: str, bits: int) -> torch.Tensor:
    """Per-row L2 error each method guarantees (see the module docs)."""
    d = x.shape[1]
    mag = x.abs().amax(1)
    if method in ("asymmetric", "symmetric"):
        return _uniform_bound(x, method, bits) * math.sqrt(d)
    if method == "adaptive":  # never worse than asymmetric (fp32 noise aside)
        return (_uniform_bound(x, "asymmetric", bits) * math.sqrt(d)) * (1 + 1e-3) + 1e-6 * mag
    if method == "kmeans":  # Lloyd from the uniform grid, then an fp16 codebook
        levels = (1 << bits) - 1
        step = (x.amax(1) - x.amin(1)) / (2 * levels)
        return (step + 2 * FP16_EPS * mag + 2.0**-24) * math.sqrt(d)
    if method == "fp16":  # 2**-25: half the spacing of fp16 subnormals
        return (mag * FP16_EPS + 2.0**-25) * math.sqrt(d)
    if method == "bf16":
        return mag * 2.0**-8 * math.sqrt(d)
    return torch.zeros_like(mag)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=_rows(), case=st.sampled_from(QUANT_CASES))
def test_quantize_properties_shape_dtype_error_and_tensor_roundtrip(
    x: torch.Tensor, case: tuple[str, int]
) -> None:
    method, bits = case
    q = quantize(x, method, bits)
    out = q.dequantize()
    assert out.shape == x.shape and out.dtype == torch.float32 and out.device == x.device
    assert q.shape == tuple(x.shape) and q.method == method
    if x.shape[0]:
        assert torch.isfinite(out).all()
        assert (_row_l2(out, x) <= _allowed_error_per_row(x, method, bits)).all()
    tensors = q.to_tensors()
    assert q.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    back = QuantizedRows.from_tensors(
        {k: v.clone() for k, v in tensors.items()}, q.method, q.bits, q.shape
    )
    assert all(torch.equal(back.to_tensors()[k], v) for k, v in tensors.items())
    assert torch.equal(back.dequantize(), out)


# ------------------------------------------------------------------------ edge cases


@pytest.mark.parametrize(("method", "bits"), QUANT_CASES)
def test_zero_rows_and_fp16_representable_constant_rows_roundtrip_exactly(
    method: str, bits: int
) -> None:
    x = torch.tensor([0.0, 0.5, -3.0, 1.25, 96.0])[:, None].repeat(1, 9)
    assert torch.equal(quantize(x, method, bits).dequantize(), x)


@pytest.mark.parametrize(("method", "bits"), QUANT_CASES)
def test_arbitrary_constant_rows_stay_finite_and_within_fp16_rounding(
    method: str, bits: int
) -> None:
    values = torch.tensor([0.1234567, -7.654321, 1e-6, 3e4])
    x = values[:, None].repeat(1, 7)
    out = quantize(x, method, bits).dequantize()
    assert torch.isfinite(out).all()
    tol = 0.0 if method == "none" else (2.0**-8 if method == "bf16" else FP16_EPS)
    subnormal = 0.0 if method in ("none", "bf16") else 2.0**-24  # 1e-6 is an fp16 subnormal
    assert ((out - x).abs() <= x.abs() * tol + subnormal).all()
    if method in UNIFORM_METHODS and bits == 8:  # fp32 scale/bias: exact
        assert torch.equal(out, x)


@pytest.mark.parametrize("method", METHODS)
def test_empty_tables_quantize_to_empty_tensors(method: str) -> None:
    q = quantize(torch.empty(0, 13), method, 3)
    assert q.shape == (0, 13) and q.nbytes == 0
    assert q.dequantize().shape == (0, 13)
    assert QuantizedRows.from_tensors(q.to_tensors(), q.method, q.bits, q.shape).shape == (0, 13)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_raise_value_error_naming_table_and_first_bad_row(
    method: str, bad: float
) -> None:
    x = _gaussian(30, 6)
    x[17, 2] = bad
    x[21, 0] = bad
    with pytest.raises(ValueError, match=r"table 't3' row 17 contains NaN or Inf"):
        quantize(x, method, 4, name="t3")


def test_values_overflowing_stored_fp16_are_rejected_naming_the_row() -> None:
    x = _gaussian(10, 4)
    x[6, 1] = 1e6
    for method, bits in [
        ("asymmetric", 4),
        ("symmetric", 3),
        ("adaptive", 2),
        ("kmeans", 8),
        ("fp16", 4),
    ]:
        with pytest.raises(ValueError, match=r"table 'big' row 6 overflows the fp16"):
            quantize(x, method, bits, name="big")
    for method, bits in [("asymmetric", 8), ("adaptive", 8), ("bf16", 4), ("none", 4)]:
        assert torch.isfinite(quantize(x, method, bits).dequantize()).all()


def test_unknown_method_and_bits_raise_value_error_listing_allowed_values() -> None:
    x = _gaussian(4, 4)
    with pytest.raises(
        ValueError, match="allowed: symmetric, asymmetric, adaptive, kmeans, fp16, bf16, none"
    ):
        quantize(x, "int4")
    for method in CODE_METHODS:
        with pytest.raises(ValueError, match="allowed: 2, 3, 4, 8"):
            quantize(x, method, 5)
    with pytest.raises(ValueError, match="n_bins"):
        quantize(x, "adaptive", 4, n_bins=0)
    with pytest.raises(ValueError, match="ratio"):
        quantize(x, "adaptive", 4, ratio=1.0)
    with pytest.raises(ValueError, match="2-D floating"):
        quantize(torch.ones(5), "asymmetric", 4)
    with pytest.raises(ValueError, match="2-D floating"):
        quantize(torch.ones(2, 2, dtype=torch.int64), "asymmetric", 4)


def test_cast_methods_ignore_bits_and_report_stored_width() -> None:
    x = _gaussian(3, 5)
    assert quantize(x, "fp16", 99).bits == 16
    assert quantize(x, "bf16").bits == 16
    assert quantize(x, "none").bits == 32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_quantize_and_dequantize_to_fp32(dtype: torch.dtype) -> None:
    x = _gaussian(50, 10).to(dtype)
    for method, bits in [("adaptive", 3), ("kmeans", 2), ("none", 4)]:
        out = quantize(x, method, bits).dequantize()
        assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.equal(quantize(x, "none").dequantize(), x.float())


def test_quantized_rows_do_not_alias_the_live_weights() -> None:
    w = torch.nn.Parameter(_gaussian(8, 8))
    q = quantize(w, "none")
    with torch.no_grad():
        w.add_(1.0)
    assert not q.data.requires_grad
    assert not torch.equal(q.dequantize(), w.detach())


def test_nbytes_counts_codes_and_per_row_parameters_honestly() -> None:
    n, d = 10, 30
    x = _gaussian(n, d)
    assert quantize(x, "asymmetric", 4).nbytes == n * (32 // 2 + 4)  # 30 -> 32 columns
    assert quantize(x, "asymmetric", 8).nbytes == n * (d + 8)  # fp32 scale + bias
    assert quantize(x, "adaptive", 3).nbytes == n * (32 * 3 // 8 + 4)
    assert quantize(x, "kmeans", 2).nbytes == n * (32 // 4 + 4 * 2)
    assert quantize(x, "fp16").nbytes == n * d * 2
    assert quantize(x, "none").nbytes == n * d * 4


def test_from_tensors_rejects_mismatched_layouts() -> None:
    q = quantize(_gaussian(6, 10), "adaptive", 4)
    with pytest.raises(ValueError, match="needs"):
        QuantizedRows.from_tensors(q.to_tensors(), "adaptive", 2, q.shape)
    with pytest.raises(ValueError, match="need tensors"):
        QuantizedRows.from_tensors(q.to_tensors(), "kmeans", 4, q.shape)
    with pytest.raises(ValueError, match="allowed"):
        QuantizedRows.from_tensors(q.to_tensors(), "adaptive", 7, q.shape)


# ------------------------------------------------------------- bits policy / config


@pytest.mark.parametrize(
    ("restores", "bits"), [(0, 2), (1, 2), (2, 3), (3, 3), (4, 4), (20, 4), (21, 8), (1e9, 8)]
)
def test_select_bits_follows_expected_restore_thresholds(restores: float, bits: int) -> None:
    assert select_bits(restores) == bits


def test_select_bits_validates_inputs() -> None:
    assert select_bits(5, thresholds=((10, 3),)) == 3
    assert select_bits(11, thresholds=((10, 3),)) == 8
    for bad in (-1, float("nan"), "3", None, True):
        with pytest.raises(ValueError):
            select_bits(bad)  # type: ignore[arg-type]
    for thresholds in (((3, 3), (1, 2)), ((1, 5),), ((1,),)):
        with pytest.raises(ValueError):
            select_bits(2, thresholds=thresholds)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("method", "bits"), QUANT_CASES)
def test_cuda_rows_quantize_on_device_and_decode_like_cpu(method: str, bits: int) -> None:
    x = _gaussian(4000, 37, seed=9)
    x[3] = 0.0
    x[4] = 0.5
    q = quantize(x.cuda(), method, bits)
    assert q.device.type == "cuda"
    out = q.dequantize()
    assert out.device.type == "cuda" and out.dtype == torch.float32
    cpu = quantize(x, method, bits)
    # Same stored layout on both devices: CPU decodes GPU bytes and vice versa.
    moved = QuantizedRows.from_tensors(
        {k: v.cpu() for k, v in q.to_tensors().items()}, method, q.bits, q.shape
    )
    assert torch.allclose(moved.dequantize(), out.cpu(), atol=1e-6, rtol=1e-6)
    assert torch.equal(out[3:5].cpu(), x[3:5])
    err_gpu, err_cpu = _row_l2(out.cpu(), x).mean(), _row_l2(cpu.dequantize(), x).mean()
    # On CUDA the adaptive search runs as torch code, on CPU compiled: other candidates,
    # as good within a few percent (the torch code's bound in test_compiled_search; 2 bits
    # at width 37 measured 1.03% above on an H200).
    assert err_gpu <= err_cpu * 1.03 + 1e-7
