"""Per-row clipping-range search for uniform quantization ("adaptive").

The reference algorithm is PyTorch's greedy search behind
``embedding_bag_4bit_prepack(w, optimized_qparams=True)``: start from
``[min, max]``, step ``= range / n_bins``; at each move try raising ``min``
and lowering ``max`` by one step, take whichever gives the lower L2
quantize-dequantize error, stop once the range has shrunk by ``ratio`` and
keep the best range seen. PyTorch runs it row by row in scalar C++.

Here every move is evaluated for all rows of a chunk at once with a handful
of whole-chunk tensor ops per candidate, and the work is cut further in two
ways (defaults of :func:`search_ranges`):

* ``stride``: each greedy move jumps several bins, so PyTorch's 32
  single-bin moves (64 error evaluations) become 4 moves of 4, 4, 8 and 16
  bins by default (8 moves of 4 bins for rows of 96+ elements).
  ``stride=1`` is the exact greedy.
* ``refine``: least-squares polish from the best range found. With the codes
  fixed, the (scale, bias) minimising the L2 error is a linear regression of
  the row on its codes; re-deriving the codes and repeating lowers the error
  further (alternating minimisation, over-relaxed). This finds the
  fine-grained optima the exact greedy reaches by brute force at a fraction of
  the evaluations, and may leave the greedy's ``[min, max]`` box since any
  (scale, bias) is storable.

Every candidate competes on its true error with scale and bias rounded as the
stored format rounds them (fp16 for 2/3/4 bits, like PyTorch's loss), and
``[min, max]`` is the first candidate, so the result is never worse than
plain asymmetric quantization beyond fp32 noise.
"""

from __future__ import annotations

import threading

import torch

# Rows per chunk scale with D so one (rows, D) fp32 buffer is ~4 MiB: large
# enough to amortise per-op dispatch on the small per-row vectors, small
# enough to stay in cache.
_CHUNK_ELEMS = 1 << 20
# Over-relaxation of the least-squares step; 1.0 is plain alternation.
_OMEGA = 1.5
# Floor for the search's scale so (near-)constant rows give finite errors;
# their stored parameters come from the encoder's own fix-ups.
_TINY = 2.0**-24

_local = threading.local()

DEFAULT_REFINE = 2
# Rows at least this wide take 4-bin greedy moves instead of the front-loaded
# schedule: with many elements per row the path itself matters more and the
# polish recovers less (measured on Gaussian rows at 4 bits).
_WIDE_ROW = 96


def _fp(v: torch.Tensor, fp16: bool) -> torch.Tensor:
    """``v`` rounded to the stored parameter precision."""
    return v.half().float() if fp16 else v


def _stored(lo: torch.Tensor, hi: torch.Tensor, ch: _Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """(bias, scale) for range [lo, hi] as the stored format holds them."""
    bias = _fp(lo, ch.fp16)
    # Divide (not multiply by 1/levels) to round exactly as FBGEMM does; the
    # clamp keeps (near-)constant rows from turning errors into NaN.
    return bias, _fp((hi - bias).div_(ch.levels), ch.fp16).clamp_min_(_TINY)


class _Chunk:
    """One chunk of rows plus the buffers its error evaluations reuse."""

    def __init__(self, x: torch.Tensor, bits: int, t: torch.Tensor, q: torch.Tensor) -> None:
        self.x = x
        self.levels = (1 << bits) - 1
        self.fp16 = bits < 8
        # The 8-bit encoder (like FloatToFused8BitRowwiseQuantized) divides
        # by range + 1e-8, i.e. by scale + 1e-8/255.
        self.eps = 0.0 if self.fp16 else 1e-8 / 255.0
        # Buffers are shared across chunks: fresh multi-MiB allocations are
        # page-faulted in on first write, which costs as much as the math.
        self.t = t[: x.shape[0]]
        self.q = q[: x.shape[0]]

    def codes(self, bias: torch.Tensor, scale: torch.Tensor) -> None:
        """t <- (x - bias) / scale; q <- clamp(round(t), 0, levels). Args (C, 1)."""
        inv = (scale + self.eps).reciprocal_() if self.eps else scale.reciprocal()
        torch.sub(self.x, bias, out=self.t).mul_(inv)
        torch.clamp(self.t, 0, self.levels, out=self.q).round_()

    def error(self, bias: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """(C, 1) squared L2 error of quantizing each row with (bias, scale), (C, 1) each."""
        self.codes(bias, scale)
        return self.t.sub_(self.q).square_().sum(1, keepdim=True).mul_(scale * scale)


# The per-row bookkeeping below uses float 0/1 masks with lerp/addcmul: on
# CPU those are ~5x cheaper than bool masks with torch.where, which matters
# because there are dozens of such small ops per full-chunk error evaluation.


def _schedule(moves: int, stride: int | None, dim: int) -> list[int]:
    """Bins per greedy move, summing to ``moves``.

    A fixed ``stride`` gives equal moves. The default (``None``) front-loads
    resolution, 1/8, 1/8, 1/4, 1/2 of the walk (4, 4, 8, 16 bins for PyTorch's
    32): the first moves decide which end gets clipped, the later ones only
    how far, which the least-squares polish then settles finely. Rows of
    ``_WIDE_ROW``+ elements get eight equal moves instead.
    """
    if stride is None and dim >= _WIDE_ROW:
        stride = max(1, moves // 8)
    if stride is not None:
        return [min(stride, moves - d) for d in range(0, moves, stride)]
    first = [moves // 8, moves // 8, moves // 4]
    return [k for k in (*first, moves - sum(first)) if k > 0]


def _greedy(
    ch: _Chunk, mn: torch.Tensor, mx: torch.Tensor, n_bins: int, ratio: float, stride: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Strided greedy walk. Args (C, 1); returns the best (lo, hi, err2) seen."""
    b_lo, s = _stored(mn, mx, ch)
    best_e = ch.error(b_lo, s)
    best_lo, best_hi = mn, mx
    moves = n_bins - int(n_bins * (1.0 - ratio))  # single-bin moves PyTorch makes
    unit = (mx - mn).div_(n_bins)
    lo, hi = mn, mx
    for k in _schedule(moves, stride, ch.x.shape[1]):
        step = unit * k
        lo_up, hi_dn = lo + step, hi - step
        b_up, s_up = _stored(lo_up, hi, ch)
        e_up = ch.error(b_up, s_up)
        e_dn = ch.error(b_lo, _stored(lo, hi_dn, ch)[1])
        up = (e_dn - e_up).gt_(0)  # 1.0: raise min; ties lower max, as PyTorch does
        lo = torch.addcmul(lo, step, up)
        hi = torch.addcmul(hi_dn, step, up)
        b_lo = torch.lerp(b_lo, b_up, up)
        cur_e = torch.minimum(e_up, e_dn)
        better = (best_e - cur_e).gt_(0)
        best_e = torch.minimum(best_e, cur_e)
        best_lo = torch.lerp(best_lo, lo, better)
        best_hi = torch.lerp(best_hi, hi, better)
    return best_lo, best_hi, best_e


def _refine(
    ch: _Chunk, lo: torch.Tensor, hi: torch.Tensor, err: torch.Tensor, iters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares polish of the range [lo, hi] (C, 1) whose error is ``err``.

    Each pass derives the codes of the current (bias, scale) and regresses the
    row on them (sums of q, q^2 and q*x; sum x is fixed), then steps
    ``_OMEGA`` times towards that optimum. The final point is checked with an
    exact error evaluation and only replaces the start where it is better, so
    the polish can never make a row worse.
    """
    fp16, lv = ch.fp16, ch.levels
    x, t, q = ch.x, ch.t, ch.q
    dim = float(x.shape[1])
    s_x = x.sum(1, keepdim=True)
    start_b, start_s = _stored(lo, hi, ch)
    cur_b, cur_s = start_b, start_s
    for _ in range(iters):
        ch.codes(cur_b, cur_s)
        s_q = q.sum(1, keepdim=True)
        s_qx = torch.mul(q, x, out=t).sum(1, keepdim=True)
        s_qq = q.square_().sum(1, keepdim=True)
        var = s_qq * dim - s_q * s_q
        ok = (var > 0).float()
        ls_s = torch.lerp(cur_s, (s_qx * dim - s_q * s_x) / (var + 1.0 - ok), ok)
        ls_b = (s_x - ls_s * s_q).mul_(1.0 / dim)
        # Rows whose codes are all equal (var 0) keep their scale.
        cur_b = _fp(torch.lerp(cur_b, ls_b, _OMEGA), fp16)
        cur_s = _fp(torch.lerp(cur_s, ls_s, _OMEGA), fp16).clamp_min_(_TINY)
    e = ch.error(cur_b, cur_s)
    better = (err - e).gt_(0)
    b = torch.lerp(start_b, cur_b, better)
    sc = torch.lerp(start_s, cur_s, better)
    return b, b + sc * lv


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


def search_ranges(
    x: torch.Tensor,
    bits: int,
    n_bins: int = 200,
    ratio: float = 0.16,
    *,
    stride: int | None = None,
    refine: int = DEFAULT_REFINE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Find per-row quantization ranges with low L2 error.

    Args:
        x: (N, D) rows, finite (cast to fp32 chunk by chunk).
        bits: 2, 3, 4 or 8.
        n_bins: Greedy step is ``(max - min) / n_bins``.
        ratio: The greedy walk stops once the range shrank by this fraction.
        stride: Bins per greedy move; 1 is PyTorch's exact greedy. ``None``
            (default) uses 4/4/8/16-bin moves, or 4-bin moves for rows of 96+
            elements (see :func:`_schedule`).
        refine: Least-squares polish iterations after the walk (0 = none).

    Returns:
        ``(lo, hi)``, each (N,) fp32: quantize with bias ``lo`` and
        ``scale = (hi - lo) / (2**bits - 1)``. Constant rows get ``lo == hi``.
    """
    n, dim = x.shape
    lo_out = torch.empty(n, dtype=torch.float32, device=x.device)
    hi_out = torch.empty_like(lo_out)
    chunk = min(n, max(64, _CHUNK_ELEMS // max(dim, 1)))
    t_buf, q_buf = _buffers(chunk, dim, x.device)
    for start in range(0, n, chunk):
        ch = _Chunk(x[start : start + chunk].float().contiguous(), bits, t_buf, q_buf)
        mn = ch.x.amin(1, keepdim=True)  # amin+amax beat aminmax(dim=1) ~10x on CPU
        mx = ch.x.amax(1, keepdim=True)
        lo, hi, err = _greedy(ch, mn, mx, n_bins, ratio, stride)
        if refine > 0:
            lo, hi = _refine(ch, lo, hi, err, refine)
        flat = mx == mn
        lo_out[start : start + chunk] = torch.where(flat, mn, lo).squeeze(1)
        hi_out[start : start + chunk] = torch.where(flat, mx, hi).squeeze(1)
    return lo_out, hi_out
