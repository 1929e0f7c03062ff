/*
 * The AVX2 build of the range search in _rowsearch.c (see there): the same
 * code, compiled for AVX2 registers, with minps, maxps and roundps where the
 * baseline composes them from compares and adds. _rowsearch.c's entry point
 * calls it on CPUs that have AVX2.
 */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2")
#define CNR_AVX2
#include "_rowsearch.c"
#else
typedef int cnr_no_avx2_build; /* ISO C wants something in a translation unit */
#endif
