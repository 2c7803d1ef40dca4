/* xq24.h: Q5_0, Q4_K and Q6_K rows against a 24-bit integer image of the activations (ggml_gemv.c's
one-row schedule for those types where the CPU has AVX-512 VNNI and VBMI).

Contract: gemm() sends a Q5_0 (K a multiple of 64), Q4_K or Q6_K matmul here when it computes each
activation row as a one-row call does (T == 1, or `rowwise`): for every activation row x (K values) and
output row n,
    y[n] = sum_i s_i sum_{j in lane i} w_nj X_j      (4-value lanes i: values 4i .. 4i + 3)
where x_j = s_i X_j + e_j is the row's integer image: s_i = amax_i / XQ_M (amax_i = max |x_j| over the
lane, XQ_M = 8355000 < 127 * 65793), X_j = rint(x_j * (XQ_M / amax_i)) (ties to even; 0 where amax_i
is 0, below 2^-100 or not finite), so |X_j| < 2^23 and |e_j| <= amax_i 2^-24 + |x_j| 2^-23: the order
of fp32's own rounding of the products (2^-24 |w x|), not a low-precision quantization. A weight is
w_nj = d c_j (+ m) with c_j its integer code (Q5_0: q - 16; Q6_K: q - 32 with d its 16-value group's
d sc; Q4_K: q with d = d sc and m = -dmin mn of its sub-block, whose term m sum x_j takes the fp32 sums
of x). Each lane's sum c_j X_j is an exact integer: X is stored as three signed bytes (balanced base
256: X = 65536 l0 + 256 l1 + l2, each in [-128, 127]), one vpdpbusd per limb multiplies them into the
unsigned codes u = c + offset (Horner: (P0 * 256 + P1) * 256 + P2, less offset * sum X; every step is
exact modulo 2^32 and the true lane value is below 2^31), then it is converted to fp32 (rounded once),
times s_i, times the block's d (fp32; the K-quants' d sc is exact, as gguf.quants computes it), summed
in fp32. So the result equals dequantize-then-matmul up to fp32-level rounding (tests/test_xq24.py:
within 3x the fp32 schedule's error against float64, on outliers too), not bit for bit the fp32
schedule's numbers. The image is made once per call on the calling thread (and kept, with a copy of
x, for the next call on the same x: a layer's q|k|v and gate|up segments share it). Each output row is
computed whole by one thread in an order that depends only on the row, so thread counts, the pool,
`rowwise` and a one-row call agree bit for bit. Without VNNI + VBMI (XQ_FAST 0) these types keep the
fp32 schedule.
Why: the fp32 schedule spends 12-20 instructions per 32 weights turning 5- and 6-bit codes into floats
and multiplying them; here 64 codes become bytes in 2-7 byte operations and meet 64 activations in three
vpdpbusd (one row from L2, 1 thread: Q5_0 12.6 -> 17.9, Q4_K 10.9 -> 23.6, Q6_K 6.9 -> 23.0 G weights/s). */

#ifndef XQ24_H
#define XQ24_H

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "ggml_blocks.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__F16C__)
#define XQ_FAST 1
#include <immintrin.h>

#define XQ_M 8355000.0f

/* One activation row's image, per 64 values g: limbs[192 g ..]: l0[64], l1[64], l2[64]; per 4-value lane
   i: o16[i] = 16 sum X, o32[i] = 32 sum X (the offsets' terms of Q5_0 and Q6_K), s4[i] = s_i; per
   32-value block b: xs[b] = the fp32 sum of x over the block (Q4_K's mins) */
typedef struct {
    const int8_t *limbs; const int32_t *o16, *o32; const float *s4, *xs;
} xq_row;

typedef struct {
    const uint8_t *w; const xq_row *rows; float *y; const int32_t *rowmap; int64_t N, K, T, ldy; int qtype;
} xq_args;

static inline size_t xq_bytes(int64_t K) { return (size_t)K * 3 + (size_t)K * 3 + (size_t)K / 8 + 64; }

/* x (K) -> its image at `buf` (xq_bytes(K), 64-byte aligned), described by *r */
static void xq_quantize(const float *x, int64_t K, uint8_t *buf, xq_row *r) {
    int8_t *limbs = (int8_t *)buf;
    int32_t *o16 = (int32_t *)(buf + 3 * K), *o32 = o16 + K / 4;
    float *s4 = (float *)(o32 + K / 4), *xs = s4 + K / 4;
    const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i every4 = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t g = 0; g < K / 64; g++) {
        for (int h = 0; h < 2; h++) {
            int64_t b = 2 * g + h;
            __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
            xs[b] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
            for (int q = 0; q < 2; q++) {
                __m512 v = q ? x1 : x0, m = _mm512_abs_ps(v);   /* each lane: the max |x| of its 4 values */
                m = _mm512_max_ps(m, _mm512_permute_ps(m, 0xB1));
                m = _mm512_max_ps(m, _mm512_permute_ps(m, 0x4E));
                __mmask16 live = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0x1p-100f), _CMP_GE_OQ) &
                                 _mm512_cmp_ps_mask(m, _mm512_set1_ps(3e38f), _CMP_LE_OQ);
                __m512 inv = _mm512_maskz_div_ps(live, _mm512_set1_ps(XQ_M), m);
                __m512 sc = _mm512_maskz_div_ps(live, m, _mm512_set1_ps(XQ_M));
                _mm_storeu_ps(s4 + 8 * b + 4 * q, _mm512_castps512_ps128(_mm512_permutexvar_ps(every4, sc)));
                __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
                __m512i l2 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X, c128), c255), c128);
                __m512i X1 = _mm512_srai_epi32(_mm512_sub_epi32(X, l2), 8);
                __m512i l1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X1, c128), c255), c128);
                __m512i l0 = _mm512_srai_epi32(_mm512_sub_epi32(X1, l1), 8);
                int8_t *at = limbs + 192 * g + 32 * h + 16 * q;
                _mm_storeu_si128((__m128i *)at, _mm512_cvtepi32_epi8(l0));
                _mm_storeu_si128((__m128i *)(at + 64), _mm512_cvtepi32_epi8(l1));
                _mm_storeu_si128((__m128i *)(at + 128), _mm512_cvtepi32_epi8(l2));
            }
        }
        /* each lane's sum X from its limbs (bytes times 1: exact) */
        const int8_t *L = limbs + 192 * g;
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(L));
        s = _mm512_dpbusd_epi32(_mm512_slli_epi32(s, 8), ones, _mm512_loadu_si512(L + 64));
        s = _mm512_dpbusd_epi32(_mm512_slli_epi32(s, 8), ones, _mm512_loadu_si512(L + 128));
        _mm512_storeu_si512(o16 + 16 * g, _mm512_slli_epi32(s, 4));
        _mm512_storeu_si512(o32 + 16 * g, _mm512_slli_epi32(s, 5));
    }
    *r = (xq_row){limbs, o16, o32, s4, xs};
}

/* One 64-value step: the lanes' exact integer dots of codes u (64 unsigned bytes) with X, less `off`
   (the offset's term, NULL: none), as fp32 times the lanes' s_i */
static inline __attribute__((always_inline)) __m512 xq_dot64(__m512i u, const int8_t *L, const int32_t *off,
                                                           const float *s4) {
    __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(L));
    acc = _mm512_dpbusd_epi32(_mm512_slli_epi32(acc, 8), u, _mm512_loadu_si512(L + 64));
    acc = _mm512_dpbusd_epi32(_mm512_slli_epi32(acc, 8), u, _mm512_loadu_si512(L + 128));
    if (off) acc = _mm512_sub_epi32(acc, _mm512_loadu_si512(off));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_loadu_ps(s4));
}

/* Q5_0: 16 blocks' d at once (a gather of the blocks' first dwords; a masked one for the last < 16) */
static inline __attribute__((always_inline)) __m512 xq_q5_0_scales(const uint8_t *row, int64_t b0, int64_t nb) {
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(22));
    __mmask16 k = nb >= 16 ? 0xFFFF : (__mmask16)((1u << nb) - 1);
    __m512i dw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, at, row + 22 * b0, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dw));
}

/* Q5_0 blocks b, b + 1 (j-th pair of a 16-block chunk whose scales are ds): 64 codes as bytes in value order
   ([qs0, qs0, qs1, qs1] by one masked broadcast, each second copy's high nibbles by one multishift, the
   fifth bits added under qh's mask) against the image, scaled by the pair's s d */
static inline __attribute__((always_inline)) __m512 xq_q5_0_pair(const uint8_t *p0, const xq_row *x, int64_t b,
                                                                __m512 ds, int j, __m512 acc) {
    const __m512i nib = _mm512_set_epi64(0x3c342c241c140c04LL, 0x3c342c241c140c04LL, 0x3830282018100800LL,
                                         0x3830282018100800LL, 0x3c342c241c140c04LL, 0x3c342c241c140c04LL,
                                         0x3830282018100800LL, 0x3830282018100800LL);
    const uint8_t *p1 = p0 + 22;
    __m512i t = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p0 + 6)));
    t = _mm512_mask_broadcast_i32x4(t, 0xFF00, _mm_loadu_si128((const __m128i *)(p1 + 6)));
    t = _mm512_and_si512(_mm512_multishift_epi64_epi8(nib, t), _mm512_set1_epi8(15));
    uint32_t h0, h1;
    memcpy(&h0, p0 + 2, 4);
    memcpy(&h1, p1 + 2, 4);
    t = _mm512_mask_add_epi8(t, (__mmask64)h0 | (__mmask64)h1 << 32, t, _mm512_set1_epi8(16));
    __m512 f = xq_dot64(t, x->limbs + 96 * b, x->o16 + 8 * b, x->s4 + 8 * b);
    __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                   _mm512_set1_epi32(2 * j));
    return _mm512_fmadd_ps(f, _mm512_permutexvar_ps(idx, ds), acc);
}

static inline __attribute__((always_inline)) float xq_row_q5_0(const uint8_t *row, const xq_row *x, int64_t K) {
    __m512 acc = _mm512_setzero_ps();
    int64_t nb = K / 32;
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        __m512 ds = xq_q5_0_scales(row, b0, nb - b0);
        if (nb - b0 >= 16) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) acc = xq_q5_0_pair(row + 22 * (b0 + 2 * j), x, b0 + 2 * j, ds, j, acc);
        } else {
            for (int j = 0; b0 + 2 * j < nb; j++) acc = xq_q5_0_pair(row + 22 * (b0 + 2 * j), x, b0 + 2 * j, ds, j, acc);
        }
    }
    return _mm512_reduce_add_ps(acc);
}

/* Q4_K's 8 scales and 8 mins of one block as bytes (llama.cpp's 32-bit unpacking of the 12 packed bytes) */
static inline __attribute__((always_inline)) __m128i xq_k4_scales(const uint8_t *q) {
    uint32_t u[4];
    memcpy(u, q, 12);
    const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
    uint32_t mins_lo = u[1] & m1;
    u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
    u[2] = mins_lo;
    u[0] &= m1;
    return _mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3]);   /* 8 scales, then 8 mins */
}

static inline __attribute__((always_inline)) float xq_row_q4_k(const uint8_t *row, const xq_row *x, int64_t K) {
    __m512 acc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
    const __m512i c15 = _mm512_set1_epi8(15);
    for (int64_t kb = 0; kb < K / 256; kb++) {
        const uint8_t *blk = row + 144 * kb;
        int64_t b = 8 * kb;
        __m512 sm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(xq_k4_scales(blk + 4)));
        uint32_t dm;
        memcpy(&dm, blk, 4);
        __m512 dd = _mm512_cvtph_ps(_mm256_set1_epi32((int)dm));
        /* lanes 0..7: d sc_s (exact), 8..15: dmin mn_s: dd holds d, dmin alternately */
        const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        sm = _mm512_mul_ps(sm, _mm512_permutexvar_ps(pick, dd));
        /* the mins' term: - dmin mn_s * xsum_s, lanes 8..15 */
        __m512 xs = _mm512_castps256_ps512(_mm256_loadu_ps(x->xs + b));
        macc = _mm512_fmadd_ps(_mm512_shuffle_f32x4(sm, sm, 0xEE), xs, macc);
        __m512 ds = sm;
        for (int i = 0; i < 4; i++) {
            __m512i t = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * i)));
            t = _mm512_and_si512(_mm512_mask_srli_epi16(t, 0xFFFF0000u, t, 4), c15);
            __m512 f = xq_dot64(t, x->limbs + 96 * (b + 2 * i), NULL, x->s4 + 8 * (b + 2 * i));
            const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
            __m512i idx = _mm512_add_epi32(half, _mm512_set1_epi32(2 * i));
            acc = _mm512_fmadd_ps(f, _mm512_permutexvar_ps(idx, ds), acc);
        }
    }
    return _mm512_reduce_add_ps(acc) - _mm512_reduce_add_ps(macc);
}

static inline __attribute__((always_inline)) float xq_row_q6_k(const uint8_t *row, const xq_row *x, int64_t K) {
    __m512 acc = _mm512_setzero_ps();
    const __m512i c15 = _mm512_set1_epi8(15), c48 = _mm512_set1_epi8(48);
    /* per 16-bit word: qh's bits 0-1 (first 32 bytes) / 2-3 (next 32) into bits 4-5, and bits 4-5 / 6-7 */
    const __m512i shl = _mm512_setr_epi32(0x40004, 0x40004, 0x40004, 0x40004, 0x40004, 0x40004, 0x40004, 0x40004,
                                          0x20002, 0x20002, 0x20002, 0x20002, 0x20002, 0x20002, 0x20002, 0x20002);
    const __m512i shr = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0,
                                          0x20002, 0x20002, 0x20002, 0x20002, 0x20002, 0x20002, 0x20002, 0x20002);
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t kb = 0; kb < K / 256; kb++) {
        const uint8_t *blk = row + 210 * kb;
        int64_t b = 8 * kb;
        /* the 16 groups' d sc */
        __m512 sg = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192))));
        sg = _mm512_mul_ps(sg, _mm512_set1_ps(f16_to_f32(blk + 208)));
        __m512 ds = sg;
        for (int h = 0; h < 2; h++) {
            __m512i ql = _mm512_loadu_si512(blk + 64 * h);
            __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
            __m512i a = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, c15), _mm512_sllv_epi16(qh, shl), c48, 0xF8);
            __m512i c = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql, 4), c15),
                                                  _mm512_srlv_epi16(qh, shr), c48, 0xF8);
            for (int i = 0; i < 2; i++) {
                int64_t v = 128 * h + 64 * i;   /* the step's first value in the block */
                __m512 f = xq_dot64(i ? c : a, x->limbs + 96 * b + 3 * v, x->o32 + 8 * b + v / 4, x->s4 + 8 * b + v / 4);
                __m512i idx = _mm512_add_epi32(quad, _mm512_set1_epi32((int)(v / 16)));
                acc = _mm512_fmadd_ps(f, _mm512_permutexvar_ps(idx, ds), acc);
            }
        }
    }
    return _mm512_reduce_add_ps(acc);
}

/* the rows ith of nth split statically (whole output rows per thread), each activation row in turn */
static void xq_worker(void *p, int ith, int nth) {
    const xq_args *a = p;
    int64_t chunk = (a->N + nth - 1) / nth, lo = chunk * ith < a->N ? chunk * ith : a->N;
    int64_t hi = lo + chunk < a->N ? lo + chunk : a->N;
    size_t rb = row_bytes(a->qtype, a->K);
    for (int64_t n = lo; n < hi; n++) {
        const uint8_t *row = a->w + (size_t)n * rb;
        int64_t ycol = a->rowmap ? a->rowmap[n] : n;
        for (size_t off = 0; off < rb; off += 64) __builtin_prefetch(row + AHEAD + off, 0, 3);
        for (int64_t t = 0; t < a->T; t++) {
            float v;
            if (a->qtype == Q5_0) v = xq_row_q5_0(row, &a->rows[t], a->K);
            else if (a->qtype == Q4_K) v = xq_row_q4_k(row, &a->rows[t], a->K);
            else v = xq_row_q6_k(row, &a->rows[t], a->K);
            a->y[t * a->ldy + ycol] = v;
        }
    }
}

#else
#define XQ_FAST 0
#endif

#endif
