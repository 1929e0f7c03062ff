/* Writes rows of a table by index: dst[index[i]] = src[i], rows of row_bytes each.
 *
 * A follower writes every update so, a restore every delta, compaction every merged
 * delta. The rows land scattered over a table much larger than the caches, so each
 * write waits on its cache lines; requesting the lines of the row PREFETCH rows ahead
 * keeps several in flight: 80k rows of 256 bytes into a 1M-row table take 3.5 ms here
 * against 7.9 ms for numpy's record assignment and 1.6 ms for a memcpy of their bytes.
 *
 * cnr_put_rows checks every index first and writes nothing if one is out of range,
 * returning -1 - i for the first such i; otherwise it returns n. Strides are in bytes
 * (a column slice of a table has a row stride above its row's bytes). No Python API:
 * loaded with ctypes, which releases the GIL for the call.
 */
#include <stdint.h>
#include <string.h>

#define PREFETCH 16       /* rows ahead */
#define PREFETCH_BYTES 512 /* of each row at most */

int64_t cnr_put_rows(char *dst, int64_t dst_rows, int64_t dst_stride, const char *src,
                     int64_t src_stride, const int64_t *index, int64_t n, int64_t row_bytes) {
    for (int64_t i = 0; i < n; i++)
        if (index[i] < 0 || index[i] >= dst_rows)
            return -1 - i;
    int64_t ahead = row_bytes < PREFETCH_BYTES ? row_bytes : PREFETCH_BYTES;
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) {
            const char *next = dst + index[i + PREFETCH] * dst_stride;
            for (int64_t at = 0; at < ahead; at += 64)
                __builtin_prefetch(next + at, 1);
        }
        memcpy(dst + index[i] * dst_stride, src + i * src_stride, (size_t)row_bytes);
    }
    return n;
}
