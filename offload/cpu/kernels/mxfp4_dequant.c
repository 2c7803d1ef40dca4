/* mxfp4_dequant.c: one gpt-oss MXFP4 expert matrix rebuilt transposed, in one pass
   (offload/cpu/mxfp4_kernel.py calls it; offload/formats/mxfp4.py defines the layout and the numbers).

Contract: mxfp4_dequant_t(blocks, scales, table, out, N, G, width, nthreads) writes the (K, N) row-major
matrix, K = 32 G:
    out[(32 g + j) * N + n] = table[16 * scales[n * G + g] + code(n, g, j)]    for n < N, g < G, j < 32
where code(n, g, j) is the low (j even) or high (j odd) nibble of blocks[(n * G + g) * 16 + j / 2]: the
stored (N, G, 16) blocks and (N, G) E8M0 scales of one expert matrix. `table` (256 x 16 entries of `width`
bytes, 2 or 4) holds for each exponent s and FP4 code c the bits of FP4_VALUES[c] x 2^(s - 127) in the
output dtype, computed by the caller with torch's own arithmetic: every output is the reference path's
bits, subnormals, overflow and the NaN of 0 x 2^128 included. Returns 0, or -1 for a width other than 2 or 4
(nothing written).
Schedule: columns n in tiles of NB; per tile, group by group, each of its NB rows' 16 bytes and scale give
32 outputs, one in each of 32 output rows, so every output row receives NB adjacent values per group (a
cache line for fp32 at NB = 16) while the tile's 32 lines stay in L1. The 16-entry sub-table of a scale is
32 or 64 bytes: every lookup hits L1.
Threads: tiles split statically over `nthreads` (an OpenMP team when compiled with it, else one thread);
one thread below MIN_OUT outputs, where a fork/join would cost more than it saves. */

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NB 16               /* output columns per tile */
#define MIN_OUT (1 << 18)   /* outputs below which one thread does it all */

/* Columns [n0, n1) of every output row: one tile (T the output width's integer type). */
#define TILE(T)                                                                                   \
    static void tile_##T(const uint8_t *blocks, const uint8_t *scales, const T *table, T *out,     \
                         int64_t N, int64_t G, int64_t n0, int64_t n1) {                          \
        for (int64_t g = 0; g < G; g++) {                                                         \
            T *o = out + 32 * g * N; /* output row 32 g: the group's first input */               \
            for (int64_t n = n0; n < n1; n++) {                                                   \
                const uint8_t *b = blocks + (n * G + g) * 16;                                     \
                const T *t = table + 16 * scales[n * G + g]; /* this group's 16 values */         \
                for (int j = 0; j < 16; j++) {                                                    \
                    o[(2 * j) * N + n] = t[b[j] & 15];    /* input 32 g + 2 j: low nibble */      \
                    o[(2 * j + 1) * N + n] = t[b[j] >> 4]; /* input 32 g + 2 j + 1: high nibble */ \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }
TILE(uint16_t)
TILE(uint32_t)

typedef struct {
    const uint8_t *blocks, *scales;
    const void *table;
    void *out;
    int64_t N, G;
    int width;
} args;

/* Worker i of n: a contiguous share of the tiles. */
static void worker(const args *a, int i, int n) {
    int64_t tiles = (a->N + NB - 1) / NB;
    int64_t lo = tiles * i / n, hi = tiles * (i + 1) / n;
    for (int64_t t = lo; t < hi; t++) {
        int64_t n0 = t * NB, n1 = n0 + NB < a->N ? n0 + NB : a->N;
        if (a->width == 2)
            tile_uint16_t(a->blocks, a->scales, a->table, a->out, a->N, a->G, n0, n1);
        else
            tile_uint32_t(a->blocks, a->scales, a->table, a->out, a->N, a->G, n0, n1);
    }
}

int mxfp4_dequant_t(const uint8_t *blocks, const uint8_t *scales, const void *table, void *out, int64_t N,
                    int64_t G, int width, int nthreads) {
    if (width != 2 && width != 4) return -1;
    args a = {blocks, scales, table, out, N, G, width};
    if (nthreads < 1 || N * G * 32 < MIN_OUT) nthreads = 1;
    if (nthreads == 1) {
        worker(&a, 0, 1);
        return 0;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(nthreads)
    worker(&a, omp_get_thread_num(), omp_get_num_threads());
#else
    worker(&a, 0, 1);
#endif
    return 0;
}
