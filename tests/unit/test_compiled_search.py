"""The compiled range search (``_rowsearch.c``) against the torch code and PyTorch's greedy."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from torchrec_cnr.iocontext import IOOptions
from torchrec_cnr.quantization import (
    _adaptive,
    _compiled,
    _packing,
    _uniform,
    quantize,
    search_ranges,
)


def _lib() -> ctypes.CDLL:
    # The project's setup (pip install -e .) builds it: a missing library fails here rather
    # than skipping (without a C compiler users get the torch code, tested below too).
    lib = _compiled.library()
    assert lib is not None, "the compiled range search is not built: run make setup"
    return lib


def _rows(kind: str, n: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(n, dim, generator=g)
    # Student-t, 3 degrees of freedom: heavy tails.
    z = torch.randn(n, dim, generator=g)
    chi2 = torch.randn(n, dim, 3, generator=g).square().sum(-1)
    return z / (chi2 / 3).sqrt()


def _torch_search(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    assert _compiled.library(False) is None
    return search_ranges(x, bits, compiled=False)


def _errors(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-row relative L2 error of the stored encoding of ranges [lo, hi]."""
    out = _uniform.decode(_uniform.encode_range(x, lo, hi, bits), bits, x.shape[1])
    return (out - x).norm(dim=1) / x.norm(dim=1).clamp_min(1e-30)


def test_cpu_searches_run_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    _lib()
    calls: list[int] = []
    real = _compiled.search_rows

    def counted(lib: ctypes.CDLL, x: torch.Tensor, *args: object) -> None:
        calls.append(x.shape[0])
        real(lib, x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_compiled, "search_rows", counted)
    search_ranges(_rows("gaussian", 50, 8, seed=0), 4)
    assert calls == [50]


def test_fp16_rounding_matches_torch_on_every_range_and_edge() -> None:
    g = torch.Generator().manual_seed(0)
    exps = torch.randint(-40, 20, (200_000,), generator=g).float()
    v = torch.randn(200_000, generator=g) * torch.pow(2.0, exps)
    edges = torch.tensor(
        [0.0, -0.0, 65504.0, 65519.0, 65519.996, 65520.0, -65520.0, 1e9, 2.0**-14, 2.0**-24,
         2.0**-25, 1.5 * 2.0**-24, 2.0**-25 * 1.0001, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11,
         float("inf"), -float("inf")]
    )  # fmt: skip
    # Halfway between neighbouring fp16 values in [1, 2): ties go to even.
    halves = (torch.arange(1, 2048).float() + 0.5) * 2.0**-10
    for t in (v, edges, halves, -halves):
        ours = torch.tensor([_lib().cnr_fp16_round(float(a)) for a in t])
        assert torch.equal(ours, t.half().float()), t[ours != t.half().float()][:5]
    assert torch.isnan(torch.tensor(_lib().cnr_fp16_round(float("nan"))))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [1, 5, 16, 33, 64, 128])
def test_compiled_search_is_no_worse_than_the_torch_code(
    bits: int, dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.cat([_rows("gaussian", 400, dim, dim), _rows("t3", 400, dim, dim + 1) * 3 - 1])
    ours = _errors(x, *search_ranges(x, bits), bits).mean()
    ref = _errors(x, *_torch_search(x, bits), bits).mean()
    assert ours <= ref * (1 + 1e-4)


@pytest.mark.parametrize("kind", ["gaussian", "t3"])
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_compiled_4bit_error_is_below_pytorch_greedy(kind: str, dim: int) -> None:
    x = _rows(kind, 200_000 // dim, dim, seed=7 * dim)
    greedy = torch.ops.quantized.embedding_bag_4bit_unpack(
        torch.ops.quantized.embedding_bag_4bit_prepack(x, optimized_qparams=True)
    )
    ref = ((greedy - x).norm(dim=1) / x.norm(dim=1)).mean()
    assert _errors(x, *search_ranges(x, 4), 4).mean() < ref


@pytest.mark.parametrize("compiled", ["1", "0"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_each_row_is_no_worse_than_its_min_max_and_stored_exactly(bits: int, compiled: str) -> None:
    # Both searches: compiled, and the torch code (CUDA, or no compiler).
    x = _rows("gaussian", 301, 24, seed=11) * 2.0 - 0.5
    x[0] = 0.1234567  # constant rows: lo == hi
    x[1] = 0.0
    x[2, 0] = 1e4  # a far extreme
    x[3] += 3000.0  # far from zero: fp16 bias steps of 2
    lo, hi = search_ranges(x, bits, compiled=compiled == "1")
    assert lo[0] == hi[0] == x[0, 0] and lo[1] == hi[1] == 0.0
    ours = _errors(x, lo, hi, bits)
    plain = _errors(x, x.amin(1), x.amax(1), bits)
    assert (ours <= plain * (1 + 1e-4) + 1e-6).all()
    if bits < 8:  # the encoder derives exactly the (bias, scale) the search evaluated
        levels = (1 << bits) - 1
        scale, bias = _uniform.nbit_params(lo, hi, bits)
        moved = (lo != x.amin(1)) | (hi != x.amax(1))
        assert bool(moved.any())
        assert torch.equal(bias[moved], lo[moved])
        assert torch.equal(hi[moved], bias[moved] + scale[moved] * levels)


def test_rows_do_not_depend_on_their_batch_mates_or_the_call() -> None:
    # 8 rows per vector batch: tails of every length, and rows searched alone.
    x = _rows("t3", 37, 21, seed=5)
    lo, hi = search_ranges(x, 4)
    for n in range(1, 18):
        part = search_ranges(x[:n], 4)
        assert torch.equal(part[0], lo[:n]) and torch.equal(part[1], hi[:n])
    alone = [search_ranges(x[i : i + 1], 4) for i in range(x.shape[0])]
    assert torch.equal(torch.cat([a[0] for a in alone]), lo)
    assert torch.equal(torch.cat([a[1] for a in alone]), hi)


def test_half_and_strided_inputs_search_like_their_fp32_copy() -> None:
    x = _rows("gaussian", 500, 40, seed=3)
    for view in (x.half(), x.bfloat16(), x.t().contiguous().t(), x[:, ::2]):
        want = search_ranges(view.float().contiguous(), 4)
        got = search_ranges(view, 4)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_threads_search_concurrently_with_the_same_results() -> None:
    x = _rows("gaussian", 20_000, 64, seed=9)
    want = search_ranges(x, 4)
    got: list[tuple[torch.Tensor, torch.Tensor]] = [None] * 4  # type: ignore[list-item]

    def run(i: int) -> None:
        got[i] = search_ranges(x, 4)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for lo, hi in got:
        assert torch.equal(lo, want[0]) and torch.equal(hi, want[1])


def test_bad_arguments_raise_instead_of_writing() -> None:
    x = _rows("gaussian", 4, 8, seed=1)
    lo, hi = torch.zeros(4), torch.zeros(4)
    with pytest.raises(ValueError, match="bad arguments"):
        _compiled.search_rows(_lib(), x, 5, [1], 200, 0, _adaptive._OMEGA, 0.0, lo, hi)
    assert not lo.any() and not hi.any()


def test_switch_off_falls_back_to_the_torch_code(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _rows("gaussian", 1000, 16, seed=2)
    compiled = search_ranges(x, 4)
    torch_code = _torch_search(x, 4)
    # Another search (other candidates), as good within a few percent.
    assert not torch.equal(compiled[0], torch_code[0])
    ratio = _errors(x, *torch_code, 4).mean() / _errors(x, *compiled, 4).mean()
    assert 1.0 <= ratio < 1.03


def test_a_mistyped_switch_fails_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHREC_CNR_COMPILED_SEARCH", "maybe")
    with pytest.raises(ValueError, match="TORCHREC_CNR_COMPILED_SEARCH='maybe': use 1 or 0"):
        IOOptions()
    monkeypatch.setenv("TORCHREC_CNR_COMPILED_SEARCH", "0")
    assert not IOOptions().compiled_search


@pytest.mark.parametrize(("build", "level"), [("avx2", 1), ("avx512", 2)])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_the_vector_builds_return_the_baselines_ranges(bits: int, build: str, level: int) -> None:
    # The entry point runs the widest build the CPU has (AVX-512: 16 rows at a time, AVX2:
    # 8); the baseline runs elsewhere. All are exported: they must agree bit for bit.
    lib = _lib()
    lib.cnr_search_build.restype = ctypes.c_int
    if lib.cnr_search_build() < level:
        pytest.skip(f"this CPU cannot run the {build} build")
    names = ("cnr_quantize_rows_base", f"cnr_quantize_rows_{build}")
    for name in names:
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = lib.cnr_quantize_rows.argtypes
    # 602 rows: the last batch is short for 8 and for 16 lanes.
    x = torch.cat([_rows("gaussian", 301, 40, seed=bits), _rows("t3", 301, 40, seed=bits + 1) * 7])
    x[0] = 0.5  # a constant row
    x[1, :20] = 0.0  # ties between grid points
    x[2] *= 1e-30  # a range below fp16's smallest step
    clips, refine = _adaptive._plan(bits, 40, 200, 0.16, cheap=True)
    arr = (ctypes.c_int32 * len(clips))(*clips)
    width = _packing.padded_dim(40, bits)
    got = []
    for name in names:
        lo, hi = torch.full((602,), float("nan")), torch.full((602,), float("nan"))
        codes = torch.zeros(602, width * bits // 8 + 3, dtype=torch.uint8)
        bad = ctypes.c_int64(7)
        rc = getattr(lib, name)(
            x.data_ptr(),
            602,
            40,
            bits,
            arr,
            len(clips),
            200,
            refine,
            _adaptive._OMEGA,
            _adaptive._frame(bits),
            lo.data_ptr(),
            hi.data_ptr(),
            codes.data_ptr(),
            codes.stride(0),
            width,
            ctypes.byref(bad),
        )
        assert rc == 0 and bad.value == -1
        assert not codes[:, -3:].any()  # nothing written past each row's codes
        got.append((lo, hi, codes))
    assert not got[0][0].isnan().any()
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [1, 5, 16, 33, 64, 128])
def test_one_pass_encoding_stores_what_the_search_and_the_encoder_store(
    bits: int, dim: int
) -> None:
    # quantize() on CPU searches and encodes each batch of rows in one compiled pass; the
    # stored rows must be those of the two passes it replaces, byte for byte.
    x = torch.cat([_rows("gaussian", 301, dim, seed=dim), _rows("t3", 300, dim, dim + 1) * 5 - 1])
    x[0] = 0.5  # a constant row
    x[1, : dim // 2 + 1] = 0.0  # ties between grid points
    x[2] *= 1e-30  # a range below fp16's smallest step
    if bits == 8:
        x[3] *= 1e30  # beyond fp16, fine with 8 bits' fp32 parameters
    want = _uniform.encode_range(x, *search_ranges(x, bits), bits)
    got = quantize(x, "adaptive", bits).to_tensors()["data"]
    assert torch.equal(got, want)


@pytest.mark.parametrize("where", [0, 9, 600])
def test_one_pass_encoding_names_the_first_row_that_is_not_finite(where: int) -> None:
    x = _rows("gaussian", 601, 24, seed=3)
    x[where, 5] = float("nan")
    x[-1, 0] = float("inf")
    with pytest.raises(ValueError, match=rf"table 't7' row {100 + where} contains NaN or Inf"):
        quantize(x, "adaptive", 4, name="t7", row_ids=100)
