/*
 * Per-row clipping-range search for uniform quantization, compiled.
 *
 * The same search as the whole-chunk torch code in _adaptive.py (its module
 * docstring explains the method), for LANES (8 or 16) rows at a time, one row per
 * vector lane: the rows of a batch are transposed into a (dim, LANES) block that stays in
 * L1 cache, every candidate grid costs one loop over it, and the per-row
 * arithmetic between loops (divisions, fp16 rounding, the choice of the best
 * candidate) runs for the LANES rows at once, without branches. For each row:
 *
 *   1. one loop finds min and max; a constant row gets lo == hi;
 *   2. [min, max] is evaluated, so the result is never worse than plain
 *      asymmetric quantization;
 *   3. for each clipping of the plan (k bins of range / n_bins off each end),
 *      the grid is shifted by the circular mean of the row's fractional parts
 *      in that grid's units (measured in the loop of the previous
 *      evaluation), then evaluated;
 *   4. every evaluation yields, from the same loop, the exact error of its
 *      (bias, scale) as the encoder stores them and the sums of a
 *      least-squares polish: with the codes fixed, the best (bias, scale) is a
 *      regression of the row on its codes (over-relaxed by omega); the
 *      polished point's error with the same codes bounds its true error from
 *      above, so it competes without a loop of its own;
 *   5. `refine` more polish passes from the best point.
 *
 * With an output buffer it also encodes: while the batch is still in cache, each row's
 * codes under its chosen range are packed into the stored layout (_packing.py), so the
 * encoder's own pass over the rows (and the encoder's read of them from memory) is gone.
 * The minimum and maximum loop also finds rows that are not finite.
 *
 * Parameters are compared as the encoder stores them: fp16 bias and scale for
 * 2/3/4 bits (FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf), fp32 with the
 * 1e-8 range epsilon for 8 bits (FloatToFused8BitRowwiseQuantized), and the
 * returned (lo, hi) make the encoder derive exactly the winner's parameters.
 *
 * Plain C with GCC vector extensions, built twice: as the baseline here
 * (pairs of SSE registers), and with AVX2 by _rowsearch_avx2.c, which
 * includes this file and adds one-instruction min, max and rounding; the
 * entry point at the end picks the build the CPU can run. Both builds return
 * the same ranges; no float semantics are relaxed. No Python API:
 * _compiled.py loads it with ctypes, which releases the GIL for the call.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CNR_HAVE_AVX2 /* _rowsearch_avx2.c and _rowsearch_avx512.c build the wider entries */
#endif
#if defined(CNR_AVX512) /* included by _rowsearch_avx512.c: 16 rows at a time */
#include <immintrin.h>
#define CNR_ENTRY cnr_quantize_rows_avx512
#define LANES 16
#elif defined(CNR_AVX2) /* included by _rowsearch_avx2.c */
#include <immintrin.h>
#define CNR_ENTRY cnr_quantize_rows_avx2
#define LANES 8
#else
#define CNR_ENTRY cnr_quantize_rows_base
#define LANES 8
#endif
/* Everything below the entry point is inlined into each of its builds. */
#define CNR_INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef double vd __attribute__((vector_size(8 * LANES)));
typedef int64_t vl __attribute__((vector_size(8 * LANES)));

/* Adding then subtracting 1.5 * 2**23 rounds a float to the nearest integer,
 * ties to even, for |v| < 2**22. Codes are clamped to [0, levels] first; an
 * offset measured far outside that range is only a worse guess. */
#define MAGIC 12582912.0f

/* Stand-ins for cos(2 pi f) and sin(2 pi f), |f| <= 1/2 (see _adaptive.py). */
#define COS0 1.0f
#define COS2 (-11.6f)
#define SIN1 7.78f
#define SIN3 (-32.0f)

/* Floor of candidate scales: fp16's smallest step, 2**-24. */
#define TINY 5.9604644775390625e-08f

typedef struct {
    vf bias, scale, inv; /* as stored, and the encoder's 1 / scale */
    vf lo, hi;           /* the range from which the encoder derives them */
} cand;

typedef struct {
    vd err;
    vf lo, hi;
} best_t;

typedef struct {
    float levels;
    int fp16;
    double omega;
    float frame; /* offsets measured from grid points (0) or midpoints (1/2) */
} plan;

CNR_INLINE vf splat(float a) { return (vf){0} + a; }
CNR_INLINE vi splat_i(int32_t a) { return (vi){0} + a; }
CNR_INLINE vf sel(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }
CNR_INLINE vd seld(vl m, vd a, vd b) { return (vd)((m & (vl)a) | (~m & (vl)b)); }
#if defined(CNR_AVX512)
CNR_INLINE vf vmin(vf a, vf b) { return (vf)_mm512_min_ps((__m512)a, (__m512)b); }
CNR_INLINE vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
CNR_INLINE vf round_code(vf t) {
    return (vf)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#elif defined(CNR_AVX2)
/* minps and maxps return their second operand unless the comparison holds: the
 * same as the select below, in one instruction (the AVX-512 forms above too). */
CNR_INLINE vf vmin(vf a, vf b) { return (vf)_mm256_min_ps((__m256)a, (__m256)b); }
CNR_INLINE vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
/* A code in [0, levels] rounded to the nearest integer, ties to even. */
CNR_INLINE vf round_code(vf t) {
    return (vf)_mm256_round_ps((__m256)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#else
CNR_INLINE vf vmin(vf a, vf b) { return sel(a < b, a, b); }
CNR_INLINE vf vmax(vf a, vf b) { return sel(a > b, a, b); }
CNR_INLINE vf round_code(vf t) { return (t + MAGIC) - MAGIC; }
#endif
CNR_INLINE vd widen(vf a) { return __builtin_convertvector(a, vd); }
CNR_INLINE vf narrow(vd a) { return __builtin_convertvector(a, vf); }
CNR_INLINE vi is_inf(vf a) { return ((vi)a & 0x7fffffff) == 0x7f800000; }

/* v rounded to the nearest fp16 value (ties to even), as floats. fp16 keeps
 * 11 significant bits from 2**-14 up, a fixed step of 2**-24 below it, and
 * magnitudes that round to 65536 or more overflow to inf. In the normal range
 * rounding float's 24-bit significand to 11 bits is an integer add on its bits
 * (a carry into the exponent is right); below it, scaling by 2**24 is exact. */
CNR_INLINE vf fp16_round(vf v) {
    vi u = (vi)v;
    vi sign = u & INT32_MIN, mag = u & 0x7fffffff;
    vi normal = (mag + 0xfff + ((mag >> 13) & 1)) & -8192;
    normal = (vi)sel(normal >= 0x47800000, (vf)splat_i(0x7f800000), (vf)normal);
    vf small = (vf)mag * 16777216.0f;
    vi tiny = (vi)((((small + MAGIC) - MAGIC)) * TINY);
    vi r = (vi)sel(mag < 0x38800000, (vf)tiny, (vf)normal);
    r = (vi)sel(mag >= 0x7f800000, (vf)mag, (vf)r); /* inf, nan */
    return (vf)(r | sign);
}

/* (bias, scale, inv) the encoder derives from [lo, hi]: _uniform.nbit_params
 * for 2/3/4 bits, _encode_8bit_torch for 8. */
CNR_INLINE cand stored(vf lo, vf hi, const plan *p) {
    cand c;
    c.lo = lo;
    c.hi = hi;
    if (p->fp16) {
        c.bias = fp16_round(lo);
        vf span = hi - c.bias;
        vf scale = fp16_round(sel(span == 0.0f, splat(1.0f), span / p->levels));
        scale = sel((scale == 0.0f) | is_inf(1.0f / scale), splat(1.0f), scale);
        c.scale = scale;
        c.inv = 1.0f / scale;
    } else {
        vf span = hi - lo;
        c.bias = lo;
        c.scale = span / p->levels;
        c.inv = p->levels / (span + 1e-8f);
    }
    return c;
}

/* The stored candidate closest to bias b and scale s, with the [lo, hi] that
 * gives it. At 2/3/4 bits hi = bias + levels * scale is exact unless the row
 * lies ~2**13 steps from zero, which the final check in search_batch catches. */
CNR_INLINE cand params(vd b, vd s, const plan *p) {
    vf sf = narrow(s);
    sf = sel(sf >= TINY, sf, splat(TINY)); /* nan too */
    if (p->fp16) {
        cand c;
        c.bias = fp16_round(narrow(b));
        c.scale = fp16_round(sf);
        c.inv = 1.0f / c.scale;
        c.lo = c.bias;
        c.hi = c.bias + c.scale * p->levels;
        return c;
    }
    vf lo = narrow(b);
    return stored(lo, lo + sf * p->levels, p);
}

/* atan2(y, x) / (2 pi) to within ~6e-4 turns (a fraction of a grid step that
 * the polish absorbs), without a libm call. */
CNR_INLINE vf turns(vf y, vf x) {
    vf ax = sel(x < 0.0f, -x, x), ay = sel(y < 0.0f, -y, y);
    vi flat = ay <= ax;
    vf a = vmin(ax, ay) / vmax(ax, ay);
    vf t = a * (0.125f + 0.0434507f * (1.0f - a));
    t = sel(flat, t, 0.25f - t);
    t = sel(x < 0.0f, 0.5f - t, t);
    t = sel(y >= 0.0f, t, -t);
    return sel((ax == 0.0f) & (ay == 0.0f), splat(0.0f), t);
}

CNR_INLINE void offer(best_t *best, vd err, vf lo, vf hi) {
    vl better = err < best->err;
    vi m = __builtin_convertvector(better, vi);
    best->err = seld(better, err, best->err);
    best->lo = sel(m, lo, best->lo);
    best->hi = sel(m, hi, best->hi);
}

/* Evaluate candidate c on the rows of block xt (dim, LANES) and polish it: offers
 * both to best and replaces c by the polished candidate. With `offsets`, also
 * returns the shift (in steps, within +-1/2) that best aligns the grid
 * (o_bias, 1 / o_inv) with each row. */
CNR_INLINE vf polish(const vf *xt, int64_t dim, const plan *p, cand *c, best_t *best, int offsets,
                     vf o_bias, vf o_inv) {
    const vf bias = c->bias, scale = c->scale, inv = c->inv, top = splat(p->levels);
    vf err = {0}, s_q = {0}, s_qq = {0}, s_r = {0}, s_qr = {0}, f1 = {0}, f2 = {0}, f3 = {0};
    for (int64_t i = 0; i < dim; i++) {
        vf v = xt[i];
        vf d = v - bias;
        vf t = vmin(vmax(d * inv, splat(0.0f)), top);
        vf q = round_code(t);
        vf r = d - scale * q;
        err += r * r;
        s_q += q;
        s_qq += q * q;
        s_r += r;
        s_qr += q * r;
        if (offsets) {
            vf u = (v - o_bias) * o_inv - p->frame;
            vf f = u - ((u + MAGIC) - MAGIC);
            vf ff = f * f;
            f1 += f;
            f2 += ff;
            f3 += ff * f;
        }
    }
    const vd e = widen(err), q1 = widen(s_q), qq = widen(s_qq), r1 = widen(s_r), qr = widen(s_qr);
    const double n = (double)dim;
    offer(best, e, c->lo, c->hi);
    vd var = n * qq - q1 * q1;
    /* var = 0 when all codes are equal: the scale stays. */
    vd d_s = seld(var > 0.5, (n * qr - r1 * q1) / var, (vd){0});
    vd d_b = (r1 - d_s * q1) / n;
    cand c2 = params(widen(bias) + p->omega * d_b, widen(scale) + p->omega * d_s, p);
    /* Residuals with the same codes: r + u + v q. */
    vd u = widen(bias) - widen(c2.bias), w = widen(scale) - widen(c2.scale);
    vd bound = e + 2.0 * (u * r1 + w * qr + u * w * q1) + n * u * u + w * w * qq;
    offer(best, bound, c2.lo, c2.hi);
    *c = c2;
    if (!offsets)
        return splat(0.0f);
    /* The mean angle of the fractional parts measured from the midpoints,
     * plus a half turn, is that of the values' own fractional parts. */
    vf shift = turns(SIN1 * f1 + SIN3 * f3, COS0 * (float)dim + COS2 * f2) + p->frame;
    return sel(shift > 0.5f, shift - 1.0f, shift);
}

/* The search for the LANES rows of block xt (dim, LANES) into lo_out, hi_out. */
CNR_INLINE void search_batch(const vf *xt, int64_t dim, const plan *p, const int32_t *clips,
                             int n_clips, int n_bins, int refine, vf *lo_out, vf *hi_out) {
    vf mn = xt[0], mx = xt[0];
    for (int64_t i = 1; i < dim; i++) {
        mn = vmin(mn, xt[i]);
        mx = vmax(mx, xt[i]);
    }
    cand c = stored(mn, mx, p);
    /* Constant rows, and rows whose parameters overflow fp16 (the caller sees
     * and rejects those), keep [min, max]. */
    const vi live = (mn != mx) & ~is_inf(c.bias) & ~is_inf(c.scale);
    best_t best = {(vd){0} + INFINITY, mn, mx};
    const vf unit = (mx - mn) / (float)n_bins;
    /* Each evaluation also measures the shift of the next clipping's grid. */
    cand o = c;
    if (n_clips > 0)
        o = stored(mn + (float)clips[0] * unit, mx - (float)clips[0] * unit, p);
    vf shift = polish(xt, dim, p, &c, &best, n_clips > 0, o.bias, o.inv);
    for (int j = 0; j < n_clips; j++) {
        c = params(widen(o.bias) + widen(shift) * widen(o.scale), widen(o.scale), p);
        if (j + 1 < n_clips) {
            float k = (float)clips[j + 1];
            o = stored(mn + k * unit, mx - k * unit, p);
            shift = polish(xt, dim, p, &c, &best, 1, o.bias, o.inv);
        } else {
            polish(xt, dim, p, &c, &best, 0, o.bias, o.inv);
        }
    }
    c = stored(best.lo, best.hi, p);
    for (int j = 0; j < refine; j++)
        polish(xt, dim, p, &c, &best, 0, o.bias, o.inv);
    vi ok = live;
    if (p->fp16) { /* the encoder must derive exactly the evaluated parameters */
        cand e = stored(best.lo, best.hi, p);
        ok &= (e.bias == best.lo) & (best.hi == e.bias + e.scale * p->levels);
    }
    *lo_out = sel(ok, best.lo, mn);
    *hi_out = sel(ok, best.hi, mx);
}

/* Lanes whose row holds an infinity or a NaN: v - v is 0 for every finite v. */
CNR_INLINE vi nonfinite(const vf *xt, int64_t dim) {
    vf z = {0};
    for (int64_t i = 0; i < dim; i++)
        z += xt[i] - xt[i];
    return z != z;
}

/* The codes of the rows of block xt (dim, LANES) under ranges [lo, hi], as the encoder
 * derives them (_uniform.encode_range: clamp(round((x - bias) * inv)), ties to even),
 * packed into the first `nrows` rows out[l] in _packing.py's layout: code k of a group at
 * bits [bits k, bits (k + 1)) of a little-endian word, a group being 32 / bits codes in 4
 * bytes, or 8 codes in 3 bytes at 3 bits; columns from dim up to width get code 0. */
CNR_INLINE void encode_batch(const vf *xt, int64_t dim, int64_t width, int bits, const plan *p,
                             vf lo, vf hi, uint8_t *const *out, int nrows) {
    const cand e = stored(lo, hi, p);
    const vf top = splat(p->levels);
    const int64_t group = bits == 3 ? 8 : 32 / bits, gbytes = bits == 3 ? 3 : 4;
    const int64_t nbytes = width * bits / 8;
    for (int64_t g = 0; g * group < width; g++) {
        vu word = {0};
        const int64_t end = (g + 1) * group < dim ? (g + 1) * group : dim;
        for (int64_t i = g * group; i < end; i++) {
            vf t = vmin(vmax((xt[i] - e.bias) * e.inv, splat(0.0f)), top);
            word |= __builtin_convertvector(round_code(t), vu) << (uint32_t)(bits * (i - g * group));
        }
        const int64_t at = g * gbytes;
        const int64_t take = nbytes - at < gbytes ? nbytes - at : gbytes;
        for (int l = 0; l < nrows; l++) {
            const uint32_t w = word[l];
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            if (take == 4) {
                memcpy(out[l] + at, &w, 4);
                continue;
            }
#endif
            for (int64_t b = 0; b < take; b++)
                out[l][at + b] = (uint8_t)(w >> (8 * b));
        }
    }
}

#if !defined(CNR_AVX2) && !defined(CNR_AVX512)
/* fp16_round of one value, for the tests. */
float cnr_fp16_round(float v) { return fp16_round(splat(v))[0]; }
#endif

/* Ranges (lo, hi) for rows x (n, dim), contiguous fp32, and with `codes`, the rows
 * encoded under them.
 *
 * bits: 2, 3, 4 or 8; clips: n_clips clippings (bins of range / n_bins per
 * side) to shift and polish; refine: polish passes from the best point at the
 * end; omega: over-relaxation of the least-squares step; frame: 0 or 1/2, the
 * offsets' fractional parts are measured from the grid points or from the
 * midpoints between them (the stand-ins for cos and sin are crude, so the two
 * choose different shifts); codes: NULL, or where row r's packed codes go, at
 * codes + r * stride, `width` (dim padded, see _packing.padded_dim) codes of it; bad_row:
 * NULL, or where the first row that is not finite is reported (-1 if none; then nothing
 * past its batch is written). Returns 0; -1 for arguments out of range, -2 when a work
 * block cannot be allocated, -3 for a row that is not finite. */
int CNR_ENTRY(const float *x, int64_t n, int64_t dim, int bits, const int32_t *clips,
              int n_clips, int n_bins, int refine, double omega, float frame, float *lo_out,
              float *hi_out, uint8_t *codes, int64_t stride, int64_t width, int64_t *bad_row) {
    if (n < 0 || dim <= 0 || !(bits == 2 || bits == 3 || bits == 4 || bits == 8) || n_bins <= 0 ||
        n_clips < 0 || refine < 0 || !(frame == 0.0f || frame == 0.5f) ||
        (codes != NULL && (width < dim || width * bits % 8 != 0 || stride < width * bits / 8)))
        return -1;
    if (bad_row != NULL)
        *bad_row = -1;
    const plan p = {(float)((1 << bits) - 1), bits < 8, omega, frame};
    vf *xt = aligned_alloc(sizeof(vf), (size_t)dim * sizeof(vf));
    if (xt == NULL)
        return -2;
    for (int64_t row = 0; row < n; row += LANES) {
        /* Transpose LANES rows into xt (a short last batch repeats its last row). */
        const float *src[LANES];
        for (int l = 0; l < LANES; l++)
            src[l] = x + (row + l < n ? row + l : n - 1) * dim;
        for (int64_t i = 0; i < dim; i++)
            for (int l = 0; l < LANES; l++)
                xt[i][l] = src[l][i];
        const int nrows = n - row < LANES ? (int)(n - row) : LANES;
        if (bad_row != NULL) {
            const vi bad = nonfinite(xt, dim);
            for (int l = 0; l < nrows; l++)
                if (bad[l]) {
                    *bad_row = row + l;
                    free(xt);
                    return -3;
                }
        }
        vf lo, hi;
        search_batch(xt, dim, &p, clips, n_clips, n_bins, refine, &lo, &hi);
        for (int l = 0; l < nrows; l++) {
            lo_out[row + l] = lo[l];
            hi_out[row + l] = hi[l];
        }
        if (codes != NULL) {
            uint8_t *out[LANES];
            for (int l = 0; l < nrows; l++)
                out[l] = codes + (row + l) * stride;
            encode_batch(xt, dim, width, bits, &p, lo, hi, out, nrows);
        }
    }
    free(xt);
    return 0;
}

#if !defined(CNR_AVX2) && !defined(CNR_AVX512)
#define CNR_ARGS                                                                                   \
    const float *x, int64_t n, int64_t dim, int bits, const int32_t *clips, int n_clips,          \
        int n_bins, int refine, double omega, float frame, float *lo_out, float *hi_out,           \
        uint8_t *codes, int64_t stride, int64_t width, int64_t *bad_row
#define CNR_PASS                                                                                   \
    x, n, dim, bits, clips, n_clips, n_bins, refine, omega, frame, lo_out, hi_out, codes, stride, \
        width, bad_row
#ifdef CNR_HAVE_AVX2
int cnr_quantize_rows_avx2(CNR_ARGS);
int cnr_quantize_rows_avx512(CNR_ARGS);
#endif

/* The build cnr_quantize_rows runs, for the tests: 2 AVX-512, 1 AVX2, 0 the baseline. */
int cnr_search_build(void) {
#ifdef CNR_HAVE_AVX2
    if (__builtin_cpu_supports("avx512f"))
        return 2;
    if (__builtin_cpu_supports("avx2"))
        return 1;
#endif
    return 0;
}

/* The entry point: the widest build the CPU runs; every build returns the same
 * ranges and codes (the tests compare them). */
int cnr_quantize_rows(CNR_ARGS) {
#ifdef CNR_HAVE_AVX2
    const int build = cnr_search_build();
    if (build == 2)
        return cnr_quantize_rows_avx512(CNR_PASS);
    if (build == 1)
        return cnr_quantize_rows_avx2(CNR_PASS);
#endif
    return cnr_quantize_rows_base(CNR_PASS);
}
#endif
