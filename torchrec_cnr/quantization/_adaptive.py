"""Per-row clipping-range search for uniform quantization ("adaptive").

The reference is PyTorch's greedy search behind
``embedding_bag_4bit_prepack(w, optimized_qparams=True)``: start from
``[min, max]``, step ``= range / n_bins``; at each move try raising ``min``
and lowering ``max`` by one step, take whichever gives the lower L2
quantize-dequantize error, stop once the range has shrunk by ``ratio`` and
keep the best range seen. That is 65 error evaluations per row, and most of
what they gain over ``[min, max]`` is not the clipping trend (rows of one
width and distribution all want about the same clipping) but *alignment*:
with 4-16 levels for 16-128 values, where the grid happens to fall among the
row's values swings its error by +-10%, and the greedy keeps the luckiest of
its samples.

The default search solves for good alignments instead of sampling them. On
CPU it runs compiled (``_rowsearch.c`` through :mod:`._compiled`), eight rows
at a time, one per vector lane, each candidate grid one loop over rows held in
cache; that makes a candidate cheap enough to afford more of them (see
:func:`_plan`). Elsewhere (CUDA tensors, or the library not built) the same
steps run for all rows of a chunk at once with whole-chunk tensor ops:

1. ``[min, max]`` is evaluated, so the result is never worse than plain
   asymmetric quantization (beyond fp32 noise).
2. For one or two grid scales (clip ``k`` bins of ``range / n_bins`` off each
   end, ``k`` near the typical optimum for the row and bit width, see
   :func:`_plan`), the grid offset is solved in closed form. With ``t`` the
   row in grid units, shifting the grid by ``c`` steps costs
   ``sum_i rho(t_i - c)``, ``rho(u) = (u - round(u))**2``; the first Fourier
   harmonic of that is minimised at the circular mean of the fractional parts
   ``f_i = t_i - round(t_i)``: ``c = atan2(S, C) / (2 pi)``. ``S`` and ``C``
   stand in for ``sum sin(2 pi f_i)`` and ``sum cos(2 pi f_i)`` through the
   power sums ``sum f``, ``sum f**2``, ``sum f**3`` (``_COS*`` and ``_SIN*``),
   so nothing transcendental runs per element.
3. Each shifted grid is evaluated exactly and, from the same pass, polished
   by least squares: with the codes fixed, the (scale, bias) minimising the
   error is a linear regression of the row on its codes (over-relaxed by
   ``_OMEGA``). The polished point's error *with the same codes* is a
   quadratic form in sums already at hand, and bounds its true error from
   above (re-rounding to the nearest code only lowers it), so the polished
   point competes without a pass of its own.
4. ``refine`` further polish passes from the best point so far.

In torch code that is 25-55 whole-chunk passes (an exact error evaluation is
six); compiled, 3-6 loops over the row. PyTorch's greedy makes 65 evaluations
in scalar code, and the mean error still comes out below the greedy's, on
Gaussian and on heavy-tailed rows (``python -m benchmarks.quantization
--vs-greedy`` measures both).

Every candidate competes on its true error (or that upper bound) with scale
and bias rounded as the stored format rounds them (fp16 for 2/3/4 bits, as
in PyTorch's loss), and the returned ``(lo, hi)`` make the encoder store
exactly the chosen values.

``search_ranges(..., stride=k)`` runs the greedy walk itself instead, ``k``
bins per move (``stride=1`` is PyTorch's algorithm), vectorized the same way.
"""

from __future__ import annotations

import ctypes
import math
import threading

import torch

from . import _compiled
from ._packing import padded_dim

# Rows per chunk scale with D so one (rows, D) fp32 buffer holds this many
# elements: enough to amortise the dispatch of the many small per-row ops,
# little enough to stay in cache (narrow rows prefer smaller chunks).
_CHUNK_ELEMS = 1 << 20
_CHUNK_ELEMS_NARROW = 1 << 18
_NARROW = 32
# Over-relaxation of the least-squares step; 1.0 is plain alternation.
_OMEGA = 1.5
# Floor for the search's scale so (near-)constant rows give finite errors;
# their stored parameters come from the encoder's own fix-ups.
_TINY = 2.0**-24
# Stand-ins for cos(2 pi f) and sin(2 pi f), |f| <= 1/2. Only the ratio S/C
# matters. The even one must average ~0 over uniform f (1 - 12 f**2 does
# exactly; a bias towards cos > 0 favours small shifts, which measured a
# little better); the odd one is a cubic close to sin's shape. Chosen by the
# mean error on Gaussian and Student-t rows, widths 16-128, 4 bits.
_COS0, _COS2 = 1.0, -11.6
_SIN1, _SIN3 = 7.78, -32.0
# The offset step takes fractional parts with one frac() pass, which needs
# t > 0: grids are evaluated with t shifted up by this many steps (clipped
# values sit at most ~1.5 steps below the range).
_FRAME = 2.0

_local = threading.local()

#: Default ``refine``: ``None`` picks the polish passes from the row width.
DEFAULT_REFINE = None

# Typical best clipping per side as a fraction of the row's range, for rows
# of width 8, 16, ..., 256 (the minimum over symmetric clippings of the mean
# error on Gaussian rows), interpolated in log2(width).
_CLIP_WIDTHS = (8, 16, 32, 64, 128, 256)
_CLIP = {
    2: (0.045, 0.085, 0.13, 0.17, 0.2, 0.2),
    3: (0.01, 0.02, 0.04, 0.065, 0.095, 0.125),
    4: (0.0, 0.005, 0.01, 0.02, 0.035, 0.055),
    8: (0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
}
# Rows narrower than this try one clipping (the polish gains plenty there);
# wider ones try two, at these multiples of the typical clipping.
_TWO_CLIPS = 48
_CLIP_FACTORS = (0.5, 1.5)
# Rows at least this wide get one more polish pass: with many values,
# alignment luck matters less and the exact range more. Where candidates are
# cheap (compiled on CPU, and on CUDA) the search polishes once more at every
# width and tries three clippings from this width
# (mean error / greedy's, 4 bits, Gaussian rows: 0.969 at width 16, 0.994 at
# 64, 0.998 at 128, against 0.978, 0.996, 0.9998 with the torch code's plan).
_WIDE = 96
_CLIP_FACTORS_WIDE = (0.5, 1.0, 1.5)


def _typical_clip(bits: int, dim: int) -> float:
    """``_CLIP[bits]`` interpolated at ``dim`` (clamped to the table)."""
    table = _CLIP[bits]
    pos = math.log2(max(dim, 1)) - math.log2(_CLIP_WIDTHS[0])
    if pos <= 0:
        return table[0]
    if pos >= len(table) - 1:
        return table[-1]
    i = int(pos)
    return table[i] + (table[i + 1] - table[i]) * (pos - i)


def _plan(
    bits: int, dim: int, n_bins: int, ratio: float, cheap: bool = False
) -> tuple[list[int], int]:
    """Clippings (bins per side, ascending) whose grids are shifted and polished,
    and the default number of extra polish passes; ``cheap``: the richer plan
    for where candidates cost little (compiled on CPU, and on CUDA).

    Clippings are capped so the range shrinks by at most ``ratio`` in all.
    """
    phi = _typical_clip(bits, dim)
    cap = int(n_bins * ratio / 2)
    if dim < _TWO_CLIPS:
        factors: tuple[float, ...] = (1.0,)
    elif cheap and dim >= _WIDE:
        factors = _CLIP_FACTORS_WIDE
    else:
        factors = _CLIP_FACTORS
    clips = sorted({min(cap, round(phi * f * n_bins)) for f in factors})
    return clips, 1 if cheap or dim >= _WIDE else 0


def _frame(bits: int) -> float:
    """Where the compiled search measures fractional parts from: grid points
    (0) at 2-4 bits, midpoints (1/2, as the torch code does) at 8 bits; each
    measured lower mean error at its widths (the stand-ins for cos and sin
    are crude, so the two frames choose different shifts)."""
    return 0.5 if bits == 8 else 0.0


def _fp(v: torch.Tensor, fp16: bool) -> torch.Tensor:
    """``v`` rounded to the stored parameter precision."""
    return v.half().float() if fp16 else v


def _tree(x: torch.Tensor, op: str) -> torch.Tensor:
    """(C, 1) reduction of (C, D) ``x`` along dim 1 by pairwise ``op`` (min/max).

    ``amin``/``amax`` along a row are ~5x slower than this when ``D`` is not a
    multiple of 32 (they lose vectorization over short rows).
    """
    fn = torch.minimum if op == "min" else torch.maximum
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        folded = fn(x[:, :half], x[:, half : 2 * half])
        if x.shape[1] % 2:
            folded[:, :1] = fn(folded[:, :1], x[:, 2 * half :])
        x = folded
    return x


class _Chunk:
    """One chunk of rows plus the buffers its passes reuse.

    ``t`` holds the row in the grid units of the candidate at hand; ``q`` is
    scratch (codes, fractional parts, residuals).
    """

    def __init__(self, x: torch.Tensor, bits: int, t: torch.Tensor, q: torch.Tensor) -> None:
        self.x = x
        self.dim = x.shape[1]
        self.levels = (1 << bits) - 1
        self.fp16 = bits < 8
        # The 8-bit encoder (like FloatToFused8BitRowwiseQuantized) divides
        # by range + 1e-8, i.e. by scale + 1e-8/255.
        self.eps = 0.0 if self.fp16 else 1e-8 / 255.0
        # Buffers are shared across chunks: fresh multi-MiB allocations are
        # page-faulted in on first write, which costs as much as the math.
        self.t = t[: x.shape[0]]
        self.q = q[: x.shape[0]]
        # Row sums of short rows are ~2x faster as a matrix-vector product.
        self._ones = torch.ones(self.dim, 1, device=x.device) if self.dim < 64 else None
        self.sum_x = self.rsum(x)

    def rsum(self, v: torch.Tensor) -> torch.Tensor:
        """(C, 1) row sums of (C, D) ``v``."""
        return v.sum(1, keepdim=True) if self._ones is None else torch.mm(v, self._ones)

    @staticmethod
    def rsumsq(v: torch.Tensor) -> torch.Tensor:
        """(C, 1) row sums of squares of (C, D) ``v``."""
        return torch.linalg.vector_norm(v, dim=1, keepdim=True).square_()

    def min_max(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(C, 1) row minima and maxima."""
        if self.dim % 32 == 0:  # amin+amax beat aminmax(dim=1) ~10x on CPU
            return self.x.amin(1, keepdim=True), self.x.amax(1, keepdim=True)
        return _tree(self.x, "min"), _tree(self.x, "max")

    def stored(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bias, scale) for range [lo, hi] as the stored format holds them."""
        bias = _fp(lo, self.fp16)
        # Divide (not multiply by 1/levels) to round exactly as FBGEMM does;
        # the clamp keeps (near-)constant rows from turning errors into NaN.
        return bias, _fp((hi - bias).div_(self.levels), self.fp16).clamp_min_(_TINY)

    def scaled(self, bias: torch.Tensor, scale: torch.Tensor, frame: float = 0.0) -> torch.Tensor:
        """t <- (x - bias) / scale + frame; returns the (C, 1) 1 / scale used."""
        inv = (scale + self.eps).reciprocal_() if self.eps else scale.reciprocal()
        if frame:
            bias = torch.add(bias, scale, alpha=-frame)
        torch.sub(self.x, bias, out=self.t).mul_(inv)
        return inv

    def error(self, scale: torch.Tensor, frame: float = 0.0, clamp: bool = True) -> torch.Tensor:
        """(C, 1) squared error of the candidate in ``t`` (kept) of this ``scale``.

        ``clamp=False`` when no value of ``t`` rounds outside the levels.
        """
        t, q = self.t, self.q
        if clamp:
            torch.clamp(t, frame, self.levels + frame, out=q).round_()
        else:
            torch.round(t, out=q)
        return self.rsumsq(torch.sub(t, q, out=q)).mul_(scale * scale)

    def offset(self) -> torch.Tensor:
        """(C, 1) grid shift in steps (within +-1/2) that best aligns ``t`` (kept).

        Circular mean of the fractional parts (module docstring, step 2).
        ``t`` must be positive (see ``_FRAME``); ``g = frac(t)`` then lies in
        [0, 1), and ``f = g - 1/2`` are the fractional parts of ``t - 1/2``,
        whose moments follow from those of ``g``. The mean angle of ``f``
        plus a half turn is that of ``t``: ``atan2(-S, -C)``.
        """
        g, dim = self.q, self.dim
        torch.frac(self.t, out=g)
        g1 = self.rsum(g)
        g2 = self.rsumsq(g)
        g3 = self.rsum(g.pow_(3))
        # sum f = g1 - D/2, sum f^2 = g2 - g1 + D/4,
        # sum f^3 = g3 - 3/2 g2 + 3/4 g1 - D/8.
        neg_cos = torch.add(g1, g2, alpha=-1.0).mul_(_COS2).sub_((_COS0 + _COS2 / 4) * dim)
        neg_sin = (
            torch.add(g2, g3, alpha=-2.0 / 3.0)
            .mul_(1.5 * _SIN3)
            .sub_(g1, alpha=_SIN1 + 0.75 * _SIN3)
            .add_((_SIN1 / 2 + _SIN3 / 8) * dim)
        )
        return torch.atan2(neg_sin, neg_cos).mul_(0.5 / math.pi)

    def polish(
        self, bias: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Exact error of (bias, scale) and its least-squares polish.

        ``t`` must hold the row in the grid units of (bias, scale), ``inv``
        being the 1 / scale it was made with; ``t`` is consumed. With codes
        ``q`` and residuals ``r = t - q`` (so ``x = bias + scale (q + r)``),
        any (b, s) keeping the codes errs by ``sum (d_b + d_s q + scale r)^2``,
        ``d_b = bias - b``, ``d_s = scale - s``: a quadratic form in
        ``sum q``, ``sum q^2``, ``sum r``, ``sum q r`` and ``sum r^2``.

        Returns:
            ``(err, bias2, scale2, bound)``, each (C, 1): the squared error of
            (bias, scale), the polished parameters as stored, and an upper
            bound of their squared error.
        """
        t, q, dim = self.t, self.q, float(self.dim)
        torch.clamp(t, 0, self.levels, out=q).round_()
        # sum q r from |t|^2 = |q|^2 + 2 q.r + |r|^2: one pass instead of two;
        # the cancellation costs ~1e-7 |q|^2, far below what the sum feeds.
        s_tt = self.rsumsq(t)
        s_q = self.rsum(q)
        s_qq = self.rsumsq(q)
        s_rr = self.rsumsq(t.sub_(q))
        # sum r = sum t - sum q, and sum t follows from the row sum.
        s_r = torch.add(self.sum_x, bias, alpha=-dim).mul_(inv).sub_(s_q)
        s_qr = s_tt.sub_(s_qq).sub_(s_rr).mul_(0.5)
        err = s_rr.mul_(scale * scale)
        # Least squares of the row on its codes: the scale grows by the factor
        # 1 + g, the bias moves by scale (s_r - g s_q) / D. var = D sum q^2 -
        # (sum q)^2 is a whole number, 0 when all codes are equal (num is then
        # 0 up to rounding too, so the clamp leaves the parameters put).
        var = torch.mul(s_qq, dim).addcmul_(s_q, s_q, value=-1.0)
        g = torch.mul(s_qr, dim).addcmul_(s_q, s_r, value=-1.0).div_(var.clamp_min_(1.0))
        lo = torch.addcmul(bias, scale, torch.addcmul(s_r, g, s_q, value=-1.0), value=_OMEGA / dim)
        hi = torch.addcmul(lo, scale, g.mul_(_OMEGA).add_(1.0), value=self.levels)
        bias2, scale2 = self.stored(lo, hi)
        d_b, d_s = bias - bias2, scale - scale2
        # bound = err + d_b (D d_b + 2 scale s_r + 2 d_s s_q) + d_s (d_s s_qq + 2 scale s_qr)
        u = torch.mul(d_b, dim).addcmul_(scale, s_r, value=2.0).addcmul_(d_s, s_q, value=2.0)
        v = torch.mul(d_s, s_qq).addcmul_(scale, s_qr, value=2.0)
        bound = torch.addcmul(err, d_b, u).addcmul_(d_s, v)
        return err, bias2, scale2, bound


class _Best:
    """Per-row best (error, bias, scale) so far.

    Float 0/1 masks with lerp: on CPU ~5x cheaper than bool masks with
    torch.where, and exact at weights 0 and 1.
    """

    def __init__(self, err: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor) -> None:
        self.err, self.bias, self.scale = err, bias, scale

    def offer(self, err: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor) -> None:
        better = (self.err - err).gt_(0)
        self.err = torch.minimum(self.err, err)
        self.bias = torch.lerp(self.bias, bias, better)
        self.scale = torch.lerp(self.scale, scale, better)

    def polish(self, ch: _Chunk, passes: int) -> None:
        """``passes`` least-squares polish passes from the best point."""
        bias, scale = self.bias, self.scale
        for _ in range(passes):
            err, bias2, scale2, bound = ch.polish(bias, scale, ch.scaled(bias, scale))
            self.offer(err, bias, scale)
            self.offer(bound, bias2, scale2)
            bias, scale = bias2, scale2

    def range(self, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, hi) from which the encoder derives exactly (bias, scale)."""
        return self.bias, torch.add(self.bias, self.scale, alpha=levels)


def _shifted_search(
    ch: _Chunk, mn: torch.Tensor, mx: torch.Tensor, clips: list[int], n_bins: int, refine: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The default search (module docstring). Returns (lo, hi), each (C, 1)."""
    levels = float(ch.levels)
    bias, scale = ch.stored(mn, mx)
    inv = ch.scaled(bias, scale, _FRAME)
    # Values round inside the levels unless fp16 rounding of the bias moved
    # [min, max] by over half a step (rows far from zero): clamp only then.
    reach = torch.cat([(mn - bias) * inv, (mx - bias) * inv])
    clamp = not bool(((reach >= -0.5) & (reach < levels + 0.5)).all())
    best = _Best(ch.error(scale, _FRAME, clamp), bias, scale)
    unit = (mx - mn).div_(n_bins)
    for k in clips:
        if k:
            bias, scale = ch.stored(torch.add(mn, unit, alpha=k), torch.add(mx, unit, alpha=-k))
            inv = ch.scaled(bias, scale, _FRAME)
        lo = torch.addcmul(bias, ch.offset(), scale)
        bias1, scale1 = ch.stored(lo, torch.add(lo, scale, alpha=levels))
        if torch.equal(scale1, scale):  # the usual case: shift t rather than redo it
            ch.t.sub_(torch.sub(bias1, bias).mul_(inv).add_(_FRAME))
        else:
            inv = ch.scaled(bias1, scale1)
        err, bias2, scale2, bound = ch.polish(bias1, scale1, inv)
        best.offer(err, bias1, scale1)
        best.offer(bound, bias2, scale2)
    best.polish(ch, refine)
    return best.range(ch.levels)


def _greedy(
    ch: _Chunk, mn: torch.Tensor, mx: torch.Tensor, n_bins: int, ratio: float, stride: int
) -> _Best:
    """PyTorch's greedy walk, ``stride`` bins per move; the best range seen."""
    b_lo, s = ch.stored(mn, mx)
    ch.scaled(b_lo, s)
    best = _Best(ch.error(s), b_lo, s)
    moves = n_bins - int(n_bins * (1.0 - ratio))  # single-bin moves PyTorch makes
    unit = (mx - mn).div_(n_bins)
    lo, hi = mn, mx
    for done in range(0, moves, stride):
        step = unit * min(stride, moves - done)
        lo_up, hi_dn = lo + step, hi - step
        b_up, s_up = ch.stored(lo_up, hi)
        ch.scaled(b_up, s_up)
        e_up = ch.error(s_up)
        s_dn = ch.stored(lo, hi_dn)[1]
        ch.scaled(b_lo, s_dn)
        e_dn = ch.error(s_dn)
        up = (e_dn - e_up).gt_(0)  # 1.0: raise min; ties lower max, as PyTorch does
        lo = torch.addcmul(lo, step, up)
        hi = torch.addcmul(hi_dn, step, up)
        b_lo = torch.lerp(b_lo, b_up, up)
        best.offer(torch.minimum(e_up, e_dn), b_lo, torch.lerp(s_dn, s_up, up))
    return best


def _buffers(rows: int, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (rows, dim) fp32 work buffers, cached per thread on CPU.

    Multi-MiB CPU allocations come straight from mmap and are page-faulted in
    on first write, which costs about as much as the search itself; reusing
    them across calls avoids that. CUDA's caching allocator already does this.
    """
    if device.type != "cpu":
        t = torch.empty(rows, dim, dtype=torch.float32, device=device)
        return t, torch.empty_like(t)
    need = rows * dim
    cached = getattr(_local, "buffers", None)
    if cached is None or cached[0].numel() < need:
        cached = (torch.empty(need), torch.empty(need))
        _local.buffers = cached
    return cached[0][:need].view(rows, dim), cached[1][:need].view(rows, dim)


def compiled_search(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    bits: int,
    n_bins: int,
    ratio: float,
    refine: int | None,
    lo: torch.Tensor,
    hi: torch.Tensor,
    codes: torch.Tensor | None = None,
) -> int | None:
    """The compiled search of (N, D) contiguous fp32 ``x`` into ``lo``, ``hi``, with its
    plan; with ``codes``, also the packed codes (see :func:`_compiled.search_rows`).

    Returns:
        With ``codes``, the first row that is not finite, else ``None``.
    """
    dim = x.shape[1]
    clips, default_refine = _plan(bits, dim, n_bins, ratio, cheap=True)
    passes = default_refine if refine is None else refine
    width = padded_dim(dim, bits) if codes is not None else 0
    return _compiled.search_rows(
        lib, x, bits, clips, n_bins, passes, _OMEGA, _frame(bits), lo, hi, codes, width
    )


def search_ranges(
    x: torch.Tensor,
    bits: int,
    n_bins: int = 200,
    ratio: float = 0.16,
    *,
    stride: int | None = None,
    refine: int | None = DEFAULT_REFINE,
    compiled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Find per-row quantization ranges with low L2 error.

    Args:
        x: (N, D) rows, finite (cast to fp32 chunk by chunk).
        bits: 2, 3, 4 or 8.
        n_bins: Clipping resolution is ``(max - min) / n_bins``.
        ratio: Clipping shrinks the range by at most this fraction in all
            (the grid shift and the polish may then move it further).
        stride: ``None`` (default): the shifted-grid search of the module
            docstring. An int: PyTorch's greedy walk instead, ``stride``
            bins per move (1 is PyTorch's algorithm).
        refine: Least-squares polish passes after the search. ``None``
            (default): 1 compiled and on CUDA; in torch code on CPU 1 for rows
            of ``_WIDE`` (96) or more values, else 0; 2 after a greedy walk.
        compiled: search in the compiled library where it is built (CPU); off, in
            torch code (same ranges as the library's baseline build, ~5x slower).

    Returns:
        ``(lo, hi)``, each (N,) fp32: quantize with bias ``lo`` and
        ``scale = (hi - lo) / (2**bits - 1)``. Constant rows get ``lo == hi``.
    """
    n, dim = x.shape
    lo_out = torch.empty(n, dtype=torch.float32, device=x.device)
    hi_out = torch.empty_like(lo_out)
    if n == 0:
        return lo_out, hi_out
    lib = (
        _compiled.library(compiled)
        if stride is None and x.device.type == "cpu" and dim > 0
        else None
    )
    if lib is not None:
        # fp32 contiguous rows go in whole; others are cast chunk by chunk.
        whole = x.dtype == torch.float32 and x.is_contiguous()
        step = n if whole else max(1, _CHUNK_ELEMS // dim)
        for start in range(0, n, step):
            rows = x[start : start + step].float().contiguous()
            part = slice(start, start + rows.shape[0])
            compiled_search(lib, rows, bits, n_bins, ratio, refine, lo_out[part], hi_out[part])
        return lo_out, hi_out
    clips, default_refine = _plan(bits, dim, n_bins, ratio, cheap=x.device.type == "cuda")
    elems = _CHUNK_ELEMS_NARROW if dim < _NARROW else _CHUNK_ELEMS
    chunk = min(n, max(64, elems // max(dim, 1)))
    t_buf, q_buf = _buffers(chunk, dim, x.device)
    for start in range(0, n, chunk):
        ch = _Chunk(x[start : start + chunk].float().contiguous(), bits, t_buf, q_buf)
        mn, mx = ch.min_max()
        if stride is None:
            passes = default_refine if refine is None else refine
            lo, hi = _shifted_search(ch, mn, mx, clips, n_bins, passes)
        else:
            best = _greedy(ch, mn, mx, n_bins, ratio, stride)
            best.polish(ch, 2 if refine is None else refine)
            lo, hi = best.range(ch.levels)
        flat = mx == mn
        lo_out[start : start + chunk] = torch.where(flat, mn, lo).squeeze(1)
        hi_out[start : start + chunk] = torch.where(flat, mx, hi).squeeze(1)
    return lo_out, hi_out
