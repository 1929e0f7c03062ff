/* CRC-32 (the zlib/gzip polynomial, reflected) by carry-less multiplication.
 *
 * Every stored tensor's bytes get a CRC-32 when written and again when read;
 * zlib's table-driven loop runs ~3 GB/s on one core here, which makes the
 * checksum a quarter of a restore's CPU time and half of a commit's. This folds
 * the message 128 bytes at a time with PCLMULQDQ (eight 128-bit lanes, each
 * multiplied forward by x^(8*128) mod P and added to the next 128 bytes: eight
 * independent chains keep the multiplier busy), then the lanes into one, then
 * reduces 128 bits to the 32-bit remainder (Barrett).
 * The constants are x^k mod P for the distances folded, bit-reflected; the
 * tests recompute each one from the polynomial.
 *
 * cnr_crc32(crc, data, n) returns what zlib.crc32(data, crc) returns, or
 * updates nothing and returns -1 where the CPU lacks PCLMULQDQ/SSE4.1 (the
 * caller then uses zlib). No Python API: loaded with ctypes, which releases
 * the GIL for the call.
 */
#include <stddef.h>
#include <stdint.h>
#include <immintrin.h>

#define POLY 0xEDB88320u /* x^32 + x^26 + ... + 1, reflected */

/* Bitwise CRC for the few bytes that do not fill a 16-byte block. */
static uint32_t crc_bytes(uint32_t crc, const unsigned char *p, size_t n) {
    while (n--) {
        crc ^= *p++;
        for (int k = 0; k < 8; k++)
            crc = (crc >> 1) ^ (POLY & (0u - (crc & 1u)));
    }
    return crc;
}

/* Fold distances (see the header); each pair is (low lane, high lane). */
static const uint64_t FOLD_1024[2] = {0x1e88ef372ull, 0x14a7fe880ull}; /* x^(1024+32), x^(1024-32) */
static const uint64_t FOLD_128[2] = {0x1751997d0ull, 0xccaa009eull}; /* x^(128+32), x^(128-32) */
static const uint64_t FOLD_64 = 0x163cd6124ull;                       /* x^64 */
static const uint64_t BARRETT[2] = {0x1db710641ull, 0x1f7011641ull};  /* P, x^64 / P */

__attribute__((target("pclmul,sse4.1")))
static __m128i fold(__m128i acc, __m128i k, __m128i next) {
    __m128i lo = _mm_clmulepi64_si128(acc, k, 0x00);
    __m128i hi = _mm_clmulepi64_si128(acc, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

/* The raw (not inverted) CRC of n >= 16 bytes, n a multiple of 16. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc_folded(uint32_t crc, const unsigned char *p, size_t n) {
    __m128i k = _mm_loadu_si128((const __m128i *)FOLD_128);
    __m128i a = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)crc));
    if (n >= 128) {
        __m128i x[8];
        x[0] = a;
        for (int i = 1; i < 8; i++)
            x[i] = _mm_loadu_si128((const __m128i *)(p + 16 * i));
        const __m128i k8 = _mm_loadu_si128((const __m128i *)FOLD_1024);
        for (p += 128, n -= 128; n >= 128; p += 128, n -= 128)
            for (int i = 0; i < 8; i++)
                x[i] = fold(x[i], k8, _mm_loadu_si128((const __m128i *)(p + 16 * i)));
        a = x[0];
        for (int i = 1; i < 8; i++)
            a = fold(a, k, x[i]);
    } else {
        p += 16;
        n -= 16;
    }
    for (; n >= 16; p += 16, n -= 16)
        a = fold(a, k, _mm_loadu_si128((const __m128i *)p));

    /* 128 -> 64 bits: the low lane times x^(128-32), added to the high lane. */
    const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
    __m128i t = _mm_clmulepi64_si128(a, k, 0x10);
    a = _mm_xor_si128(_mm_srli_si128(a, 8), t);
    /* 64 -> 32 bits + 32: the low word times x^64. */
    __m128i k64 = _mm_cvtsi64_si128((long long)FOLD_64);
    t = _mm_srli_si128(a, 4);
    a = _mm_clmulepi64_si128(_mm_and_si128(a, low32), k64, 0x00);
    a = _mm_xor_si128(a, t);
    /* Barrett: q = floor(a / P) from x^64 / P, then a - q * P. */
    __m128i bk = _mm_loadu_si128((const __m128i *)BARRETT);
    t = _mm_clmulepi64_si128(_mm_and_si128(a, low32), bk, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), bk, 0x00);
    a = _mm_xor_si128(a, t);
    return (uint32_t)_mm_extract_epi32(a, 1);
}

int64_t cnr_crc32(uint32_t crc, const unsigned char *data, int64_t n) {
    if (n < 0)
        return -1;
    if (!__builtin_cpu_supports("pclmul") || !__builtin_cpu_supports("sse4.1"))
        return -1;
    uint32_t c = ~crc;
    size_t len = (size_t)n;
    if (len >= 16) {
        size_t bulk = len & ~(size_t)15;
        c = crc_folded(c, data, bulk);
        data += bulk;
        len -= bulk;
    }
    return (int64_t)(uint32_t)~crc_bytes(c, data, len);
}

/* a * b modulo P, both bit-reflected (bit 31 holds the coefficient of x^0). */
static uint32_t times_mod_p(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (int i = 0; i < 32 && a; i++, a <<= 1) {
        if (a & 0x80000000u)
            product ^= b; /* a holds x^i: add b * x^i */
        b = (b >> 1) ^ (POLY & (0u - (b & 1u))); /* b * x, reduced */
    }
    return product;
}

/* The CRC-32 of A + B from crc(A), crc(B) and len(B): crc(A) * x^(8 len(B)) + crc(B)
 * modulo P, the power built by squaring (the pre- and post-inversions cancel). What
 * Python's crc32_combine computes, in microseconds instead of a millisecond or two of
 * Python that holds the GIL. -1 for a negative length. */
int64_t cnr_crc32_combine(uint32_t crc1, uint32_t crc2, int64_t len2) {
    if (len2 < 0)
        return -1;
    uint32_t power = 1u << 30; /* x */
    for (int i = 0; i < 3; i++)
        power = times_mod_p(power, power); /* x^8: one byte */
    uint32_t shift = 1u << 31;         /* x^0 */
    for (uint64_t n = (uint64_t)len2; n; n >>= 1) {
        if (n & 1)
            shift = times_mod_p(shift, power);
        power = times_mod_p(power, power);
    }
    return (int64_t)(times_mod_p(shift, crc1) ^ crc2);
}
