/* ggml_gemv.c: y = x W^T straight from GGUF block bytes, in fp32 (offload/formats/ggml_kernel.py).

Contract: ggml_gemm(qtype, w, x, y, rowmap, N, K, T, nthreads) computes, for t < T and n < N,
    y[t * N + rowmap[n]] = sum_k x[t * K + k] * W[n, k]
where W[n, :] is row n of the (N, K) weight stored as ggml blocks of 32 values (`w`: N rows of
K/32 blocks; rowmap NULL = identity). W is dequantized in fp32 registers exactly as
gguf.quants.dequantize defines it and every product and sum is fp32: the same number as
dequantize-then-matmul up to the order of fp32 roundings (as one BLAS vs another). Activations
are never quantized. Block layouts (little-endian):
    Q4_0 (2): 18 bytes = fp16 d, 16 bytes of nibbles; value j = d * (q_j - 8)
    Q4_1 (3): 20 bytes = fp16 d, fp16 m, 16 bytes of nibbles; value j = d * q_j + m
    Q8_0 (8): 34 bytes = fp16 d, 32 int8; value j = d * q_j
    nibbles: byte i holds value i (low 4 bits) and value i + 16 (high 4 bits).
Returns 0, or -1 for an unsupported qtype / K not a multiple of 32 (nothing written).
Two schedules, both reading each packed row from memory once per call:
  T == 1: per block, the algebraic form d * (sum_j q_j x_j) (+ m * sum(x) for Q4_1, sum(x) per
          block precomputed once): 16-lane partial sums, one horizontal sum per row;
  T > 1:  per block, the 32 reference values w_j (d * q_j + m, ...) in two 16-lane registers,
          multiplied into TB activation rows at a time (the row's bytes stay in L1 between passes).
Threads: output rows split statically over `nthreads` (OpenMP when compiled with it).
Portable C: GCC/Clang vector extensions (16 fp32 lanes), which the compiler maps onto AVX-512,
AVX2, SSE or NEON; fp16 -> fp32 uses F16C / __fp16 where present, else exact bit manipulation. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif

#define QK 32
#define TB 4                                   /* activation rows per pass (T > 1) */
#define AHEAD 4096        /* software prefetch distance in bytes: +20-45% on weights streamed from DRAM */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef uint8_t v16b_u __attribute__((vector_size(16), aligned(1), may_alias));   /* unaligned load */
typedef float v16f_u __attribute__((vector_size(64), aligned(4), may_alias));

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 v;
    memcpy(&v, &h, 2);
    return (float)v;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);                  /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);           /* normal: rebias 15 -> 127 */
    } else if (man == 0) {
        bits = sign;                                               /* +-0 */
    } else {                                                       /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline v16f ldf(const float *p) { return *(const v16f_u *)p; }
static inline v16b ldb(const uint8_t *p) { return *(const v16b_u *)p; }
/* 16 int8 -> 16 floats: bytes ^ 0x80 (= q + 128, unsigned), widened, converted, minus 128 (all exact;
   GCC 12 widens a signed byte vector with scalar code) */
static inline v16f i8f(const uint8_t *p) {
    return __builtin_convertvector(__builtin_convertvector(ldb(p) ^ 0x80, v16i), v16f) - 128.0f;
}

static size_t block_bytes(int qtype) {
    return qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : 0;
}

/* Integer codes of one block as floats (exact: |q| <= 128): lo = values 0..15, hi = 16..31;
   Q4_0's offset 8 is subtracted here (exact), so every type is then w = d * code (+ m). */
static inline void codes(int qtype, const uint8_t *blk, v16f *lo, v16f *hi) {
    if (qtype == Q8_0) {
        *lo = i8f(blk + 2);
        *hi = i8f(blk + 18);
        return;
    }
    v16b q = ldb(blk + (qtype == Q4_1 ? 4 : 2));
    *lo = __builtin_convertvector(__builtin_convertvector(q & 0x0F, v16i), v16f);
    *hi = __builtin_convertvector(__builtin_convertvector(q >> 4, v16i), v16f);
    if (qtype == Q4_0) {
        *lo -= 8.0f;
        *hi -= 8.0f;
    }
}

static inline float hsum(v16f a) {
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s += a[j];
    return s;
}

/* T == 1: one output from one packed row; xs[b] = sum of x over block b (Q4_1's m term). */
static inline float dot_row(int qtype, const uint8_t *row, const float *x, const float *xs, int64_t nb) {
    v16f acc = {0}, lo, hi;
    float accm = 0.0f;
    size_t bb = block_bytes(qtype);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        __builtin_prefetch(blk + AHEAD, 0, 3);
        codes(qtype, blk, &lo, &hi);
        acc += f16_to_f32(blk) * (lo * ldf(x + b * QK) + hi * ldf(x + b * QK + 16));
        if (qtype == Q4_1) accm += f16_to_f32(blk + 2) * xs[b];
    }
    return hsum(acc) + accm;
}

/* T == 1, R rows at once: R independent accumulator chains sharing each activation load. */
#define R 4
static inline void dot_rows(int qtype, const uint8_t *row, size_t rb, const float *x, const float *xs, int64_t nb,
                            float *out) {
    v16f acc[R] = {{0}}, lo, hi;
    float accm[R] = {0};
    size_t bb = block_bytes(qtype);
    for (int64_t b = 0; b < nb; b++) {
        v16f x0 = ldf(x + b * QK), x1 = ldf(x + b * QK + 16);
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = row + r * rb + b * bb;
            __builtin_prefetch(blk + AHEAD, 0, 3);
            codes(qtype, blk, &lo, &hi);
            acc[r] += f16_to_f32(blk) * (lo * x0 + hi * x1);
            if (qtype == Q4_1) accm[r] += f16_to_f32(blk + 2) * xs[b];
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]) + accm[r];
}

/* T > 1: y[t, ycol] for every t from one packed row, TB activation rows per pass over the row. */
static inline void rows_multi(int qtype, const uint8_t *row, const float *x, float *y, int64_t ycol,
                              int64_t N, int64_t K, int64_t T) {
    size_t bb = block_bytes(qtype);
    int64_t nb = K / QK;
    for (int64_t t0 = 0; t0 < T; t0 += TB) {
        int64_t nt = T - t0 < TB ? T - t0 : TB;
        v16f acc[TB] = {{0}}, lo, hi;
        const float *xt = x + t0 * K;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
            if (t0 == 0) __builtin_prefetch(blk + AHEAD, 0, 3);
            codes(qtype, blk, &lo, &hi);
            float d = f16_to_f32(blk);
            v16f wlo = d * lo, whi = d * hi;                  /* the reference values w_j */
            if (qtype == Q4_1) {
                float m = f16_to_f32(blk + 2);
                wlo += m;
                whi += m;
            }
            if (nt == TB) {
                for (int i = 0; i < TB; i++)
                    acc[i] += wlo * ldf(xt + i * K + b * QK) + whi * ldf(xt + i * K + b * QK + 16);
            } else {
                for (int i = 0; i < nt; i++)
                    acc[i] += wlo * ldf(xt + i * K + b * QK) + whi * ldf(xt + i * K + b * QK + 16);
            }
        }
        for (int i = 0; i < nt; i++) y[(t0 + i) * N + ycol] = hsum(acc[i]);
    }
}

/* One qtype's loops, so `qtype` is a constant inside them (the branches above fold away). */
#define KERNEL(NAME, QT)                                                                            \
    static void NAME(const uint8_t *w, const float *x, const float *xs, float *y, const int32_t *rowmap, \
                     int64_t N, int64_t K, int64_t T, int nthreads) {                               \
        size_t rb = (size_t)(K / QK) * block_bytes(QT);                                             \
        if (T == 1) {                    /* groups of R rows, then the N % R last rows one by one */ \
            int64_t groups = N / R;                                                                 \
            _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                      \
            for (int64_t g = 0; g <= groups; g++) {                                                 \
                float out[R];                                                                       \
                int64_t n0 = g * R, cnt = g < groups ? R : N - n0;                                  \
                if (cnt == R) dot_rows(QT, w + (size_t)n0 * rb, rb, x, xs, K / QK, out);            \
                else                                                                                \
                    for (int64_t i = 0; i < cnt; i++) out[i] = dot_row(QT, w + (size_t)(n0 + i) * rb, x, xs, K / QK); \
                for (int64_t i = 0; i < cnt; i++) y[rowmap ? rowmap[n0 + i] : n0 + i] = out[i];     \
            }                                                                                       \
        } else {                                                                                    \
            _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                      \
            for (int64_t n = 0; n < N; n++)                                                         \
                rows_multi(QT, w + (size_t)n * rb, x, y, rowmap ? rowmap[n] : n, N, K, T);          \
        }                                                                                           \
    }
KERNEL(gemm_q4_0, Q4_0)
KERNEL(gemm_q4_1, Q4_1)
KERNEL(gemm_q8_0, Q8_0)

int ggml_gemm(int qtype, const uint8_t *w, const float *x, float *y, const int32_t *rowmap,
              int64_t N, int64_t K, int64_t T, int nthreads) {
    if (block_bytes(qtype) == 0 || K % QK != 0 || K <= 0 || N < 0 || T < 0) return -1;
    if (nthreads < 1) nthreads = 1;
    int64_t nb = K / QK;
    float *xs = NULL;
    if (T == 1 && qtype == Q4_1) {                      /* per-block sums of x: the m * sum(x) term */
        xs = (float *)malloc(sizeof(float) * (size_t)nb);
        if (xs == NULL) return -2;
        for (int64_t b = 0; b < nb; b++) xs[b] = hsum(ldf(x + b * QK) + ldf(x + b * QK + 16));
    }
    if (qtype == Q4_0) gemm_q4_0(w, x, xs, y, rowmap, N, K, T, nthreads);
    else if (qtype == Q4_1) gemm_q4_1(w, x, xs, y, rowmap, N, K, T, nthreads);
    else gemm_q8_0(w, x, xs, y, rowmap, N, K, T, nthreads);
    free(xs);
    return 0;
}
