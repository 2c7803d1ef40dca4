/* ggml_gemv.c: y = x W^T straight from GGUF block bytes, in fp32 (offload/cpu/ggml_kernel.py).

Contract: ggml_gemm(qtype, w, x, y, rowmap, N, K, T, nthreads) computes, for t < T and n < N,
    y[t * N + rowmap[n]] = sum_k x[t * K + k] * W[n, k]
where W[n, :] is row n of the (N, K) weight stored as GGUF blocks (`w`: N rows of K/32 blocks, or
K/256 for the K-quants; rowmap NULL = identity). W is dequantized in fp32 registers exactly as
gguf.quants.dequantize defines it and every product and sum is fp32: the same number as
dequantize-then-matmul up to the order of fp32 roundings (as one BLAS vs another). Where the CPU
has AVX-512 VNNI and VBMI, Q5_0 (K a multiple of 64), Q4_K and Q6_K rows computed one activation row
at a time (T == 1, `rowwise`) run xq24.h instead: exact int32 products of the codes with a 24-bit
integer image of the activations (each 4-value lane scaled by its own max), whose error is of fp32
rounding's order (xq24.h's contract; tests/test_xq24.py against float64). Activations are never
quantized to low precision, except for specx's own SX3 / SX2 (the self-draft's substitutes, never a target's
weights) and Q8A (a Q8_0 head as the self-draft reads it) with K a multiple of 64: those run sx_q8.h's
8-bit-activation path (its contract). Types and block layouts: ggml_blocks.h (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K, and specx's 3- and 2-bit SX3, SX2), each read as 32-value sub-blocks w_j = d * c_j (+ m).
ggml_gemm_slice writes into a slice of a wider output instead (row stride ldy >= N).
Returns 0, or -1 for an unsupported qtype / K not a whole number of blocks (nothing written).
Two schedules, both reading each packed row from memory once per call:
  T == 1: per sub-block, the algebraic form d * (sum_j c_j x_j) (+ m * sum_j x_j, lane-wise):
          4 rows at a time sharing each activation load, their scales converted to fp32 in chunks
          of CH blocks first, 16-lane partial sums, one horizontal sum per row;
  T > 1:  per sub-block, the 32 reference values w_j (d * c_j + m) in two 16-lane registers,
          multiplied into up to TB activation rows at a time (16 with AVX-512: one accumulator
          register each; T > TB in even passes), the row's bytes in L1 between passes;
          ggml_gemm_pool_rows instead computes every activation row with the T == 1 schedule (a
          group's packed rows re-read from L1 for the next activation row), so row t of y is the
          number a one-row call gives: one-token sequences that share a pass (decode_stack.c's
          lanes) each get exactly what they get alone.
Threads: output rows split statically over `nthreads`: an OpenMP team (when compiled with it: the
runtime torch's own ops use, so a linear called between them shares their threads), or pool.c's
workers for ggml_gemm_pool (decode_stack.c: a whole pass of matmuls with no torch op between them,
from whichever thread decodes); one thread below MIN_PAR products, where handing work to another
thread would cost more than it saves.
With AVX-512 VBMI (x86 -march=native on recent Xeons) the codes of at most 5 bits pick their weight
from a per-sub-block table of its 16 or 32 possible values (vpermps / vpermt2ps), Q8_0's and Q6_K's
are widened and converted, and the legacy types' fp16 scales come in one vcvtph2ps (ggml_fast.h):
the same exact values.
Portable C: GCC/Clang vector extensions (16 fp32 lanes), which the compiler maps onto AVX-512,
AVX2, SSE or NEON; fp16 -> fp32 uses F16C / __fp16 where present, else exact bit manipulation. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "ggml_blocks.h"

#if defined(__AVX512F__)
#define TB 16           /* activation rows per pass (T > 1): one accumulator register each */
#else
#define TB 8
#endif
/* software prefetch distance in bytes: +20-45% on weights streamed from DRAM (against none). 16 KB
   rather than 4: past a matmul's last rows it fetches the next weight's first ones (a pass's weights
   are read in order), and it covers more of the DRAM latency at full speed. Gemma-3 270M --method ar,
   2 threads, in-process timers, interleaved: the 18-layer stack 11.4 -> 8.8 ms a token, the Q8_0
   262144 x 640 head 10.1 -> 9.2 ms (32 KB: stack 8.5, head 9.8) */
#ifndef AHEAD
#define AHEAD 16384
#endif
#ifndef PF_LOC
#define PF_LOC 3   /* prefetch locality: into every cache level */
#endif
/* below this many (row, block, activation row) products one thread is faster than two: an OpenMP
   fork/join costs ~0.5-1 us, one product ~2.5 ns (measured, 2 cores, K = 576) */
#define MIN_PAR 512
#include "ggml_fast.h"
#include "sx_q8.h"
#include "xq24.h"

/* The 16 lanes' sum as a tree (a serial chain of 15 adds cost ~60 cycles per output: more than the
   18 blocks of a 576-wide row took to multiply). */
static FORCE float hsum(v16f a) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)a);
#else
    float s[16];
    for (int j = 0; j < 16; j++) s[j] = a[j];
    for (int w = 8; w > 0; w /= 2)
        for (int j = 0; j < w; j++) s[j] += s[j + w];
    return s[0];
#endif
}

/* One sub-block's contribution in the algebraic form: dlo * (lo . x0) + dhi * (hi . x1) (one scale
   when they are equal: every type but Q6_K), + m * (x0 + x1) for the types with a min. */
static FORCE v16f term(int qtype, const float *sc, v16f lo, v16f hi, v16f x0, v16f x1, v16f xsum) {
    if (qtype == Q6_K) return sc[0] * (lo * x0) + sc[1] * (hi * x1);
    v16f t = sc[0] * (lo * x0 + hi * x1);
    return has_min(qtype) ? t + sc[1] * xsum : t;
}

/* T == 1: one output from one packed row, per sub-block `term`, in 16 lanes summed once at the end. */
static FORCE float dot_row(int qtype, const uint8_t *row, const float *x, int64_t nb) {
    v16f acc = {0}, lo, hi;
    float sc[4];
    for (int64_t b = 0; b < nb; b++) {
        int s;
        const uint8_t *blk = sub(qtype, row, b, &s);
        v16f x0 = ldf(x + b * QK), x1 = ldf(x + b * QK + 16);
        __builtin_prefetch(blk + AHEAD, 0, PF_LOC);
        codes_of(qtype, blk, s, &lo, &hi);
        scales_of(qtype, blk, s, sc);
        acc += term(qtype, sc, lo, hi, x0, x1, x0 + x1);
    }
    return hsum(acc);
}

/* T == 1, R rows at once: R independent accumulator chains sharing each activation load. The rows'
   scale pairs of CH sub-blocks are converted to fp32 first (sc[r][2i], sc[r][2i + 1]), so the inner
   loop broadcasts them from memory (a load, no shuffle) next to the codes' lookups. */
#define R 4
#define CH 64
static FORCE void dot_rows(int qtype, const uint8_t *row, size_t rb, const float *x, int64_t nb, float *out) {
    v16f acc[R] = {{0}}, lo, hi;
    float sc[R][2 * CH + 2];
    for (int64_t b0 = 0; b0 < nb; b0 += CH) {
        int64_t nc = nb - b0 < CH ? nb - b0 : CH;
        for (int r = 0; r < R; r++)   /* legacy types: legacy_scales (ggml_fast.h) fills the row's at once */
            for (int64_t i = 0; !legacy_scales(qtype, row + r * rb, b0, nc, sc[r]) && i < nc; i += is_k(qtype) ? 8 : 1) {
                int s;
                const uint8_t *blk = sub(qtype, row + r * rb, b0 + i, &s);
                if (is_k(qtype)) k_scales8(qtype, blk, &sc[r][2 * i]);
                else scales_of(qtype, blk, s, &sc[r][2 * i]);
            }
        for (int64_t i = 0; i < nc; i++) {
            int64_t b = b0 + i;
            v16f x0 = ldf(x + b * QK), x1 = ldf(x + b * QK + 16), xsum = x0 + x1;
            for (int r = 0; r < R; r++) {
                int s;
                const uint8_t *blk = sub(qtype, row + r * rb, b, &s);
                __builtin_prefetch(blk + AHEAD, 0, PF_LOC);
#if FAST_CODES
                v16f wlo, whi;                          /* the sub-block's values, looked up by code */
                if (table_values(qtype, blk, s, &sc[r][2 * i], &wlo, &whi)) {
                    acc[r] += wlo * x0;
                    acc[r] += whi * x1;
                    continue;
                }
#endif
                codes_of(qtype, blk, s, &lo, &hi);
                acc[r] += term(qtype, &sc[r][2 * i], lo, hi, x0, x1, xsum);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]);
}

/* Sub-block s's 32 dequantized values w_j (lo = j < 16, hi = j >= 16) as gguf.quants.dequantize has
   them: the product d * c, then + m, rounded apart (no fma contraction). */
static FORCE void values32(int qtype, const uint8_t *blk, int s, v16f *wlo, v16f *whi) {
    v16f lo, hi;
    float sc[4];
    scales_of(qtype, blk, s, sc);
#if FAST_CODES
    if (table_values(qtype, blk, s, sc, wlo, whi)) return;
#endif
    codes_of(qtype, blk, s, &lo, &hi);
    *wlo = sc[0] * lo;
    *whi = (qtype == Q6_K ? sc[1] : sc[0]) * hi;
    if (has_min(qtype)) {
        NO_FMA(*wlo);
        NO_FMA(*whi);
        *wlo += sc[1];
        *whi += sc[1];
    }
}

/* T > 1: y[t, ycol] for nt (a constant once inlined: the switch below) activation rows from one packed
   row: each sub-block's 32 reference values w_j are built once and multiply all nt rows, each row's
   accumulator its own register. Every output's sums run in the same order whatever nt is, so a row's
   result does not depend on how many rows share its pass. */
static inline __attribute__((always_inline)) void rows_tile(int qtype, const uint8_t *row, const float *xt,
                                                            float *y, int64_t ycol, int64_t ldy, int64_t K,
                                                            int nt, int fetch) {
    int64_t nb = K / QK;
    v16f acc[TB] = {{0}};
    for (int64_t b = 0; b < nb; b++) {
        int s;
        const uint8_t *blk = sub(qtype, row, b, &s);
        if (fetch) __builtin_prefetch(blk + AHEAD, 0, PF_LOC);
        v16f wlo, whi;                                    /* the reference values w_j */
        values32(qtype, blk, s, &wlo, &whi);
        for (int i = 0; i < nt; i++)
            acc[i] += wlo * ldf(xt + i * K + b * QK) + whi * ldf(xt + i * K + b * QK + 16);
    }
    for (int i = 0; i < nt; i++) y[i * ldy + ycol] = hsum(acc[i]);
}

/* T > 1: y[t, ycol] for every t from one packed row, in passes of at most TB activation rows over the
   row, as even as they can be (T = 9: 5 + 4, not 8 + 1: a pass costs its dequantization plus its rows). */
#define TILE(n) case n: rows_tile(qtype, row, xt, yt, ycol, ldy, K, n, f); break;
static inline void rows_multi(int qtype, const uint8_t *row, const float *x, float *y, int64_t ycol,
                              int64_t ldy, int64_t K, int64_t T) {
    int64_t passes = (T + TB - 1) / TB;
    for (int64_t p = 0, t0 = 0; p < passes; p++) {
        int64_t nt = (T - t0) / (passes - p) + ((T - t0) % (passes - p) != 0);
        const float *xt = x + t0 * K;
        float *yt = y + t0 * ldy;
        int f = p == 0;
        switch (nt) {
        TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7)
#if TB > 8
        TILE(8) TILE(9) TILE(10) TILE(11) TILE(12) TILE(13) TILE(14) TILE(15)
#endif
        default: rows_tile(qtype, row, xt, yt, ycol, ldy, K, TB, f); break;
        }
        t0 += nt;
    }
}
#undef TILE

/* One qtype's loops, so `qtype` is a constant inside them (the branches above fold away): the share
   ith of nth of the output rows (a static split, as OpenMP's schedule(static) makes it). */
typedef struct {
    const uint8_t *w; const float *x; float *y; const int32_t *rowmap; int64_t N, K, T;
    int64_t ldy;   /* floats from one activation row's outputs to the next (N, or wider: a slice of y) */
    int rowwise;   /* every activation row computed exactly as a T == 1 call computes it */
} gemm_args;

static inline void share(int64_t count, int ith, int nth, int64_t *lo, int64_t *hi) {
    int64_t chunk = (count + nth - 1) / nth;
    *lo = chunk * ith < count ? chunk * ith : count;
    *hi = *lo + chunk < count ? *lo + chunk : count;
}

#define KERNEL(NAME, QT)                                                                            \
    static void NAME(void *p, int ith, int nth) {                                                   \
        const gemm_args *a = p;                                                                     \
        const uint8_t *w = a->w; const float *x = a->x; float *y = a->y;                            \
        const int32_t *rowmap = a->rowmap; int64_t N = a->N, K = a->K, T = a->T, ldy = a->ldy, lo, hi; \
        size_t rb = row_bytes(QT, K);                                                               \
        if (T == 1 || a->rowwise) {      /* groups of R rows, then the N % R last rows one by one; \
                                            rowwise: each activation row as T == 1 computes it, the \
                                            group's packed rows re-read from L1 for the next one */ \
            int64_t groups = N / R;                                                                 \
            share(groups + 1, ith, nth, &lo, &hi);                                                  \
            for (int64_t g = lo; g < hi; g++)                                                       \
                for (int64_t t = 0; t < T; t++) {                                                   \
                    float out[R];                                                                   \
                    const float *xt = x + t * K;                                                    \
                    int64_t n0 = g * R, cnt = g < groups ? R : N - n0;                              \
                    if (cnt == R) dot_rows(QT, w + (size_t)n0 * rb, rb, xt, K / QK, out);          \
                    else                                                                            \
                        for (int64_t i = 0; i < cnt; i++) out[i] = dot_row(QT, w + (size_t)(n0 + i) * rb, xt, K / QK); \
                    for (int64_t i = 0; i < cnt; i++) y[t * ldy + (rowmap ? rowmap[n0 + i] : n0 + i)] = out[i]; \
                }                                                                                   \
        } else {                                                                                    \
            share(N, ith, nth, &lo, &hi);                                                           \
            for (int64_t n = lo; n < hi; n++)                                                       \
                rows_multi(QT, w + (size_t)n * rb, x, y, rowmap ? rowmap[n] : n, a->ldy, K, T);     \
        }                                                                                           \
    }
KERNEL(gemm_q4_0, Q4_0)
KERNEL(gemm_q4_1, Q4_1)
KERNEL(gemm_q5_0, Q5_0)
KERNEL(gemm_q5_1, Q5_1)
KERNEL(gemm_q8_0, Q8_0)
KERNEL(gemm_q4_k, Q4_K)
KERNEL(gemm_q5_k, Q5_K)
KERNEL(gemm_q6_k, Q6_K)
KERNEL(gemm_sx3, SX3)
KERNEL(gemm_sx2, SX2)

static void (*kernel_of(int qtype))(void *, int, int) {
    switch (qtype) {
    case Q4_0: return gemm_q4_0;
    case Q4_1: return gemm_q4_1;
    case Q5_0: return gemm_q5_0;
    case Q5_1: return gemm_q5_1;
    case Q8_0: case Q8A: return gemm_q8_0;
    case Q4_K: return gemm_q4_k;
    case Q5_K: return gemm_q5_k;
    case SX3: return gemm_sx3;
    case SX2: return gemm_sx2;
    default: return gemm_q6_k;
    }
}

void pool_run(void (*fn)(void *, int, int), void *arg, int nth);   /* pool.c */

/* The self-draft's types over int8 activations (sx_q8.h), quantized once per call by the calling thread
   into its own buffer (grown as needed, kept for its next call) that the workers read. */
static int sx_gemm(int qtype, const uint8_t *w, const float *x, float *y, const int32_t *rowmap, int64_t N,
                   int64_t K, int64_t T, int64_t ldy, int nthreads, int on_pool) {
    static __thread void *buf = NULL;
    static __thread size_t have = 0;
    size_t need = (size_t)(T * K) + sizeof(float) * (size_t)(3 * T * (K / SXQ_G) + 2 * T * (K / 32)) + 64;
    if (need > have) {
        void *grown = realloc(buf, need);
        if (grown == NULL) return -2;
        buf = grown, have = need;
    }
    float *sx = buf, *xsum = sx + T * (K / SXQ_G), *xres = xsum + T * (K / 32);
    float *xs64 = xres + T * (K / 32), *xr64 = xs64 + T * (K / SXQ_G);
    int8_t *xq = (int8_t *)(xr64 + T * (K / SXQ_G));
    sxq_quantize(x, T, K, xq, sx, xsum, xres, xs64, xr64);
    sxq_args a = {w, xq, sx, xsum, xres, xs64, xr64, y, rowmap, N, K, T, ldy, qtype};
    if (on_pool) {
        pool_run(sxq_worker, &a, nthreads);
        return 0;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(nthreads)
    sxq_worker(&a, omp_get_thread_num(), omp_get_num_threads());
#else
    for (int i = 0; i < nthreads; i++) sxq_worker(&a, i, nthreads);
#endif
    return 0;
}

/* ggml_xq(0) sends Q5_0 / Q4_K / Q6_K back to the fp32 schedule in this process (tests and benchmarks compare
   the two); returns 1 when the 24-bit path is built (XQ_FAST), else 0 */
static int xq_on = 1;
int ggml_xq(int on) {
    __atomic_store_n(&xq_on, on, __ATOMIC_RELAXED);
    return XQ_FAST;
}
static inline int xq_off(void) { return !__atomic_load_n(&xq_on, __ATOMIC_RELAXED); }

#if XQ_FAST
/* Q5_0 / Q4_K / Q6_K rows against the activations' 24-bit image (xq24.h), made once per call by the calling
   thread into its own buffer (kept with a copy of x: the next call on the same x, the layer's next
   segment, reuses it) that the workers read */
static int xq_gemm(int qtype, const uint8_t *w, const float *x, float *y, const int32_t *rowmap, int64_t N,
                   int64_t K, int64_t T, int64_t ldy, int nthreads, int on_pool) {
    static __thread uint8_t *buf = NULL;
    static __thread size_t have = 0;
    static __thread int64_t last_k = -1, last_t = -1;
    size_t per = (xq_bytes(K) + 63) & ~(size_t)63, xb = sizeof(float) * (size_t)(T * K);
    size_t need = per * (size_t)T + xb + sizeof(xq_row) * (size_t)T;
    if (need > have) {
        free(buf);
        have = 0, last_k = -1;
        buf = aligned_alloc(64, (need + 63) & ~(size_t)63);
        if (buf == NULL) return -2;
        have = need;
    }
    float *xc = (float *)(buf + per * (size_t)T);
    xq_row *rows = (xq_row *)(buf + per * (size_t)T + xb);
    if (K != last_k || T != last_t || memcmp(xc, x, xb) != 0) {
        for (int64_t t = 0; t < T; t++) xq_quantize(x + t * K, K, buf + per * (size_t)t, &rows[t]);
        memcpy(xc, x, xb);
        last_k = K, last_t = T;
    }
    xq_args a = {w, rows, y, rowmap, N, K, T, ldy, qtype};
    if (on_pool) {
        pool_run(xq_worker, &a, nthreads);
        return 0;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(nthreads)
    xq_worker(&a, omp_get_thread_num(), omp_get_num_threads());
#else
    for (int i = 0; i < nthreads; i++) xq_worker(&a, i, nthreads);
#endif
    return 0;
}
#endif

/* on_pool: split over pool.c's workers (the decoder stack) rather than an OpenMP team (a linear called
   alone from Python, between torch's own OpenMP ops, shares torch's threads: the same runtime). */
static int gemm(int qtype, const uint8_t *w, const float *x, float *y, const int32_t *rowmap,
                int64_t N, int64_t K, int64_t T, int64_t ldy, int nthreads, int on_pool, int rowwise) {
    if (block_bytes(qtype) == 0 || K % block_values(qtype) != 0 || K <= 0 || N < 0 || T < 0 || ldy < N) return -1;
    if (nthreads < 1 || N * (K / QK) * T < MIN_PAR) nthreads = 1;   /* tiny products: fork/join costs more */
    if ((qtype == SX3 || qtype == SX2 || qtype == Q8A) && K % SXQ_G == 0) return sx_gemm(qtype, w, x, y, rowmap, N, K, T, ldy, nthreads, on_pool);
#if XQ_FAST
    if ((T == 1 || rowwise) && (qtype == Q4_K || qtype == Q6_K || (qtype == Q5_0 && K % 64 == 0)) && !xq_off())
        return xq_gemm(qtype, w, x, y, rowmap, N, K, T, ldy, nthreads, on_pool);
#endif
    gemm_args a = {w, x, y, rowmap, N, K, T, ldy, rowwise};
    void (*fn)(void *, int, int) = kernel_of(qtype);
    if (on_pool) {
        pool_run(fn, &a, nthreads);
        return 0;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(nthreads)
    fn(&a, omp_get_thread_num(), omp_get_num_threads());
#else
    for (int i = 0; i < nthreads; i++) fn(&a, i, nthreads);
#endif
    return 0;
}

int ggml_gemm(int qtype, const uint8_t *w, const float *x, float *y, const int32_t *rowmap,
              int64_t N, int64_t K, int64_t T, int nthreads) {
    return gemm(qtype, w, x, y, rowmap, N, K, T, N, nthreads, 0, 0);
}

int ggml_gemm_pool(int qtype, const uint8_t *w, const float *x, float *y, const int32_t *rowmap,
                   int64_t N, int64_t K, int64_t T, int nthreads) {
    return gemm(qtype, w, x, y, rowmap, N, K, T, N, nthreads, 1, 0);
}

/* ggml_gemm_pool with every activation row computed as a T == 1 call computes it (see the contract) */
int ggml_gemm_pool_rows(int qtype, const uint8_t *w, const float *x, float *y, const int32_t *rowmap,
                        int64_t N, int64_t K, int64_t T, int nthreads) {
    return gemm(qtype, w, x, y, rowmap, N, K, T, N, nthreads, 1, 1);
}

/* ggml_gemm_pool into a slice of a wider output: y[t * ldy + rowmap[n]] (ldy >= N), every row as a
   one-row call computes it when `rowwise` (decode_stack.c: q, k and v of different types side by side) */
int ggml_gemm_slice(int qtype, const uint8_t *w, const float *x, float *y, const int32_t *rowmap,
                    int64_t N, int64_t K, int64_t T, int64_t ldy, int nthreads, int rowwise) {
    return gemm(qtype, w, x, y, rowmap, N, K, T, ldy, nthreads, 1, rowwise);
}
