/* Copy-on-write staging of embedding rows, without a lock.
 *
 * Lazy staging copies a checkpoint's rows after save() returned, from two
 * threads: the background writer copies them in bulk, and the training
 * thread's lookup hook copies a row that a batch is about to update first
 * (a fused optimizer updates only rows its batch looked up, in that batch's
 * backward). Each staged row ("slot") has two bits: `claimed` (someone copies
 * it, or did) and `done` (its copy is complete). A copier sets `claimed` with
 * an atomic OR and copies only the slots whose bit it was the first to set, so
 * no row is copied twice; a lookup that finds a slot claimed by the other
 * thread waits for its `done` bit, so no row is updated while it is copied.
 * The background copy claims 64 slots with one OR and copies them as runs.
 *
 * Taking a Python lock around every chunk instead made the training thread
 * wait for the background thread's chunks and for its turns at the GIL:
 * 0.1-0.2 s lost per full checkpoint of 410 MB here, more than eager
 * staging's whole stall. Here neither thread waits for more than one 64-row
 * run, and ctypes releases the GIL for both calls.
 *
 * No Python API: loaded with ctypes (torchrec_cnr/staging/cow.py).
 */
#include <sched.h>
#include <stdint.h>
#include <string.h>

#define CNR_COW_MAX_ARRAYS 8

/* One shard staged lazily; every pointer is into tensors that Python keeps alive. */
typedef struct {
    int64_t n;                /* slots: rows the checkpoint holds */
    int64_t rows;             /* local rows of the shard */
    int64_t base;             /* where its rows start in the positions lookups report */
    const uint64_t *selected; /* (ceil(rows/64),) bitmap of the rows held; NULL: all, slot = row */
    const int64_t *before;    /* (ceil(rows/64),) set bits of `selected` before each word */
    const uint64_t *tail;     /* bits of `selected` whose rows are stored last; NULL: none */
    const int64_t *tail_before; /* (ceil(rows/64),) set bits of `tail` before each word */
    int64_t stale;            /* slots before the tail: rows held and not in it */
    const int64_t *slot_rows; /* (n,) local row of each slot; NULL: slot = row */
    uint64_t *claimed;        /* (ceil(n/64),) */
    uint64_t *done;           /* (ceil(n/64),) */
    int32_t arrays;           /* the weight and each optimizer state */
    int64_t row_bytes[CNR_COW_MAX_ARRAYS];  /* bytes of one row, contiguous in src and dst */
    int64_t src_stride[CNR_COW_MAX_ARRAYS]; /* bytes from one source row to the next */
    const char *src[CNR_COW_MAX_ARRAYS];    /* the live tensors */
    char *dst[CNR_COW_MAX_ARRAYS];          /* the staging buffers, rows packed */
} cnr_cow_shard;

static inline void relax(int spins) {
    if (spins > 64) {
        sched_yield(); /* the other copier was descheduled mid-run */
        return;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Copies `count` slots from `slot`, whose rows are consecutive from `row`. */
static void copy_run(const cnr_cow_shard *s, int64_t slot, int64_t row, int64_t count) {
    for (int a = 0; a < s->arrays; a++) {
        const int64_t rb = s->row_bytes[a], stride = s->src_stride[a];
        char *dst = s->dst[a] + slot * rb;
        const char *src = s->src[a] + row * stride;
        if (stride == rb) {
            memcpy(dst, src, (size_t)(count * rb));
        } else {
            for (int64_t i = 0; i < count; i++)
                memcpy(dst + i * rb, src + i * stride, (size_t)rb);
        }
    }
}

/* The slots of `mine` (bits of word `w`), as runs of consecutive rows. */
static void copy_bits(const cnr_cow_shard *s, int64_t w, uint64_t mine) {
    while (mine) {
        const int start = __builtin_ctzll(mine);
        const uint64_t rest = mine >> start;
        const int len = rest == ~0ull ? 64 - start : __builtin_ctzll(~rest);
        const int64_t slot = w * 64 + start;
        if (s->slot_rows == NULL) {
            copy_run(s, slot, slot, len);
        } else {
            int64_t i = 0;
            while (i < len) {
                int64_t j = i + 1;
                while (j < len && s->slot_rows[slot + j] == s->slot_rows[slot + i] + (j - i))
                    j++;
                copy_run(s, slot + i, s->slot_rows[slot + i], j - i);
                i = j;
            }
        }
        mine = len + start >= 64 ? 0 : mine & ~(((1ull << len) - 1) << start);
    }
}

/* Copies slots [a, b) that nobody has claimed; returns how many it copied. The
 * background writer's call. */
int64_t cnr_cow_range(const cnr_cow_shard *s, int64_t a, int64_t b) {
    if (a < 0 || b > s->n || a > b || (s->n > 0 && s->slot_rows == NULL && s->selected != NULL))
        return -1;
    int64_t copied = 0;
    for (int64_t w = a >> 6; w * 64 < b; w++) {
        const int64_t lo = w * 64 < a ? a - w * 64 : 0;
        const int64_t hi = (w + 1) * 64 > b ? b - w * 64 : 64;
        const uint64_t mask = (hi == 64 ? ~0ull : (1ull << hi) - 1) & ~((1ull << lo) - 1);
        if ((__atomic_load_n(&s->claimed[w], __ATOMIC_RELAXED) & mask) == mask)
            continue;
        const uint64_t mine = mask & ~__atomic_fetch_or(&s->claimed[w], mask, __ATOMIC_ACQ_REL);
        if (!mine)
            continue;
        copy_bits(s, w, mine);
        __atomic_fetch_or(&s->done[w], mine, __ATOMIC_RELEASE);
        copied += __builtin_popcountll(mine);
    }
    return copied;
}

/* Before a lookup of `k` rows (positions as lookups report them, duplicates
 * allowed): copies those held by one of `count` shards and not claimed yet, and
 * waits for those the background copy is copying. Returns how many it copied.
 * The training thread's call; after it returns, the batch may update them. */
int64_t cnr_cow_lookup(const cnr_cow_shard *shards, int32_t count, const int64_t *rows,
                       int64_t k) {
    int64_t copied = 0;
    const cnr_cow_shard *s = count > 0 ? &shards[0] : NULL;
    for (int64_t i = 0; i < k; i++) {
        const int64_t p = rows[i];
        if (s == NULL || p < s->base || p >= s->base + s->rows) {
            s = NULL; /* rows of one table come together: look further only on a change */
            for (int32_t j = 0; j < count && s == NULL; j++)
                if (p >= shards[j].base && p < shards[j].base + shards[j].rows)
                    s = &shards[j];
            if (s == NULL)
                continue;
        }
        const int64_t local = p - s->base;
        int64_t slot = local;
        if (s->selected != NULL) {
            const uint64_t word = s->selected[local >> 6];
            const int bit = (int)(local & 63);
            if (!((word >> bit) & 1))
                continue;
            const uint64_t below = (1ull << bit) - 1;
            slot = s->before[local >> 6] + __builtin_popcountll(word & below);
            if (s->tail != NULL) { /* held rows not in the tail first, then the tail's */
                const uint64_t tw = s->tail[local >> 6];
                const int64_t t = s->tail_before[local >> 6] + __builtin_popcountll(tw & below);
                slot = (tw >> bit) & 1 ? s->stale + t : slot - t;
            }
        }
        const int64_t w = slot >> 6;
        const uint64_t bit = 1ull << (slot & 63);
        if (__atomic_load_n(&s->done[w], __ATOMIC_ACQUIRE) & bit)
            continue;
        if (!(__atomic_fetch_or(&s->claimed[w], bit, __ATOMIC_ACQ_REL) & bit)) {
            copy_run(s, slot, local, 1);
            __atomic_fetch_or(&s->done[w], bit, __ATOMIC_RELEASE);
            copied++;
            continue;
        }
        for (int spins = 0; !(__atomic_load_n(&s->done[w], __ATOMIC_ACQUIRE) & bit); spins++)
            relax(spins);
    }
    return copied;
}

/* The bits of a bitmap at a checkpoint, in one pass: dst = src & mask (mask NULL: src),
 * before[i] = the set bits of dst[0..i), and the set bits of dst in all returned. On the
 * training thread during save(), where a copy, a popcount and a prefix sum as separate
 * tensor operations cost several times more. */
static inline __attribute__((always_inline)) int64_t
snapshot(const uint64_t *src, const uint64_t *mask, uint64_t *dst, int64_t *before, int64_t n) {
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint64_t w = mask == NULL ? src[i] : src[i] & mask[i];
        dst[i] = w;
        before[i] = total;
        total += __builtin_popcountll(w);
    }
    return total;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* With the popcnt instruction (not in the x86-64 baseline): 10x the portable count. */
__attribute__((target("popcnt"))) static int64_t
snapshot_popcnt(const uint64_t *src, const uint64_t *mask, uint64_t *dst, int64_t *before,
                int64_t n) {
    return snapshot(src, mask, dst, before, n);
}
#endif

int64_t cnr_cow_snapshot(const uint64_t *src, const uint64_t *mask, uint64_t *dst,
                         int64_t *before, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("popcnt"))
        return snapshot_popcnt(src, mask, dst, before, n);
#endif
    return snapshot(src, mask, dst, before, n);
}

/* Appends the rows set in `words & ~exclude` (exclude NULL: `words`), ascending, to `out`
 * from `k`, up to its `cap` entries; returns the new `k` (counting those past `cap`). */
static int64_t set_rows(const uint64_t *words, const uint64_t *exclude, int64_t nwords,
                        int64_t *out, int64_t k, int64_t cap) {
    for (int64_t i = 0; i < nwords; i++) {
        uint64_t w = exclude == NULL ? words[i] : words[i] & ~exclude[i];
        while (w) {
            if (k < cap)
                out[k] = i * 64 + __builtin_ctzll(w);
            k++;
            w &= w - 1;
        }
    }
    return k;
}

/* For the background writer's copy of a delta's shard, without the GIL: the local row of
 * each slot in the order the delta stores them (held rows not in the tail, then the
 * tail's) into `rows`, and their table ids (row + `offset`, int32 if `ids32`) into `ids`
 * (NULL: none); `rows` and `ids` hold `n` entries. Returns how many rows the bitmaps hold
 * (none is written past `n`). */
int64_t cnr_cow_stored_rows(const cnr_cow_shard *s, int64_t *rows, void *ids, int64_t offset,
                            int32_t ids32) {
    const int64_t nwords = (s->rows + 63) / 64;
    int64_t k = set_rows(s->selected, s->tail, nwords, rows, 0, s->n);
    if (s->tail != NULL)
        k = set_rows(s->tail, NULL, nwords, rows, k, s->n);
    for (int64_t i = 0; ids != NULL && i < k && i < s->n; i++) {
        if (ids32)
            ((int32_t *)ids)[i] = (int32_t)(rows[i] + offset);
        else
            ((int64_t *)ids)[i] = rows[i] + offset;
    }
    return k;
}

int32_t cnr_cow_max_arrays(void) { return CNR_COW_MAX_ARRAYS; }

/* Bumped whenever cnr_cow_shard or a function changes, so that a stale build is refused. */
int32_t cnr_cow_layout(void) { return 4; }
