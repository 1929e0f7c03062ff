/*
 * The AVX-512 build of the range search in _rowsearch.c (see there): the same
 * code for 16 rows at a time, one per lane of a 512-bit register, with the
 * one-instruction min, max and rounding of the AVX2 build. _rowsearch.c's
 * entry point calls it on CPUs that have AVX-512F.
 */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx512f")
#define CNR_AVX512
#include "_rowsearch.c"
#else
typedef int cnr_no_avx512_build; /* ISO C wants something in a translation unit */
#endif
