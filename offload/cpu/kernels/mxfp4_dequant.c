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
Schedule: columns n in tiles of one cache line of outputs (NB = 16 fp32 or 32 16-bit values); per tile, group
by group, each of its NB rows' 16 bytes and scale give 32 outputs, one for each of 32 output rows, gathered in
a local 32 x NB block, then each output row's NB values stored at once (a whole line). The 16-entry sub-table
of a scale is 32 or 64 bytes: every lookup hits L1.
Threads: tiles split statically over `nthreads` (an OpenMP team when compiled with it, else one thread);
one thread below MIN_OUT outputs, where a fork/join would cost more than it saves. */

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LINE 64             /* bytes of a cache line: a tile is one line of output columns wide */
#define MIN_OUT (1 << 18)   /* outputs below which one thread does it all */

/* Columns [n0, n1) of every output row: one tile (T the output width's integer type, NB = LINE / sizeof(T)).
   A group's 32 x NB values are built in `buf` first, then each output row's NB values are stored at once: a
   line written whole and in order (filling 32 lines value by value thrashes L1 where N is a power of two,
   whose row stride maps every one of them to the same few cache sets). */
#define TILE(T)                                                                                   \
    static void tile_##T(const uint8_t *blocks, const uint8_t *scales, const T *table, T *out,     \
                         int64_t N, int64_t G, int64_t n0, int64_t n1) {                          \
        enum { NB = LINE / sizeof(T) };                                                           \
        T buf[32 * NB];                                                                           \
        int64_t w = n1 - n0;                                                                      \
        for (int64_t g = 0; g < G; g++) {                                                         \
            for (int64_t c = 0; c < w; c++) {                                                     \
                const uint8_t *b = blocks + ((n0 + c) * G + g) * 16;                              \
                const T *t = table + 16 * scales[(n0 + c) * G + g]; /* this group's 16 values */  \
                for (int j = 0; j < 16; j++) {                                                    \
                    buf[(2 * j) * NB + c] = t[b[j] & 15];    /* input 32 g + 2 j: low nibble */   \
                    buf[(2 * j + 1) * NB + c] = t[b[j] >> 4]; /* input 32 g + 2 j + 1: high */    \
                }                                                                                 \
            }                                                                                     \
            T *o = out + 32 * g * N + n0; /* output row 32 g: the group's first input */          \
            for (int r = 0; r < 32; r++)                                                          \
                for (int64_t c = 0; c < w; c++) o[r * N + c] = buf[r * NB + c];                   \
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
    int64_t nb = LINE / a->width, tiles = (a->N + nb - 1) / nb;
    int64_t lo = tiles * i / n, hi = tiles * (i + 1) / n;
    for (int64_t t = lo; t < hi; t++) {
        int64_t n0 = t * nb, n1 = n0 + nb < a->N ? n0 + nb : a->N;
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
