/* sx_q8.h: the self-draft's SX3 / SX2 / Q8A matmuls over int8 activations (ggml_gemv.c's path for those types).

Contract: ggml_gemv.c's gemm() sends the SX3 / SX2 matmuls with K a multiple of 64 here: for t < T, n < N,
    y[t * ldy + rowmap[n]] = sum_b [ d_b * (sum_j (c_nj - C) xhat_tj)  +  (m_b + C d_b) * xsum_tb ]
over the row's 32-value blocks b (an SX3 block's two halves share its d, m), where xhat = sx * xq is
x's 8-bit image: per 64 values sx = amax / 127 (amax = max |x| there), xq = x * (127 / amax) rounded
to the nearest integer (ties to even; 0 where amax = 0); xsum_tb is the fp32 sum of block b's 32 x, and
C = 3.5 (SX3) or 1.5 (SX2) centres the codes, so the 8-bit error multiplies c - C, not c (it is
computed as d sx (c . xq) + m xsum + C d (xsum - sum xhat): one exact int32 dot a block). So it is
x W^T with x replaced by its 8-bit image in the products: about 0.5% relative error per output, which
only the draft's proposals carry (SX3 and SX2 are the self-draft's substitutes, never a target's
weights: the target's logits stay exact). lowbit_pack.matmul_reference is the same in Python. Each
output row's sums run in the same order whatever T is, so a one-row call and a many-row call give the
same row (the `rowwise` contract holds by construction).
Q8A is a Q8_0 weight (the output layer the self-draft shares with its target) read the same way: its
signed codes c_j (m = 0, C = 0) against the same 8-bit image, y = sum_b d_b sx (c . xq), with no min or
centre term; the target's own head keeps Q8_0's exact fp32 path.
Why: a one-row pass of a 3-bit draft was bound by turning codes into fp32 values (two shuffles, a
table and two FMAs per 32 weights); with AVX-512 VNNI and VBMI, 64 codes are spread into bytes by one
vpermb and one multishift and multiplied into 64 int8 activations by one vpdpbusd (exact int32),
then one conversion and one FMA: about a third of the instructions. SX3 (sxq_tile3) goes further: a row's
scales are converted 16 groups at a time before its loop, whose every group is then the codes, one
vpdpbusd, one conversion and one FMA (SmolLM2's 30 layers of draft linears at one row: 5.1 -> 3.6-4.0 ms
on 2 threads, the same numbers up to fp32 order). Without them, portable C computes the same sums
(exact integers, fp32 scaling). */

#ifndef SX_Q8_H
#define SX_Q8_H

#include <math.h>
#include "ggml_blocks.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__F16C__)
#define SXQ_FAST 1
#else
#define SXQ_FAST 0
#endif

#define SXQ_G 64                     /* activation values per int8 scale */
#define SXQ_C(qtype) ((qtype) == SX3 ? 3.5f : (qtype) == SX2 ? 1.5f : 0.0f)   /* the codes' centre C (0..7, 0..3; Q8A's are signed) */

typedef struct {
    const uint8_t *w; const int8_t *xq; const float *sx, *xsum, *xres, *xs64, *xr64; float *y; const int32_t *rowmap;
    int64_t N, K, T, ldy; int qtype;
} sxq_args;

/* x (T, K) -> xq (T, K) int8, sx (T, K/64) scales, per 32-value block xsum = sum x and xres = sum (x - xhat)
   (T, K/32 each; see the contract) */
static void sxq_quantize(const float *x, int64_t T, int64_t K, int8_t *xq, float *sx, float *xsum, float *xres,
                         float *xs64, float *xr64) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < K / SXQ_G; g++) {
            const float *p = x + t * K + g * SXQ_G;
            int8_t *q = xq + t * K + g * SXQ_G;
            float amax = 0.0f;
            for (int j = 0; j < SXQ_G; j++) amax = fmaxf(amax, fabsf(p[j]));
            float id = amax > 0.0f ? 127.0f / amax : 0.0f, s = amax / 127.0f;
            sx[t * (K / SXQ_G) + g] = s;
            for (int j = 0; j < SXQ_G; j++) q[j] = (int8_t)nearbyintf(p[j] * id);
            for (int h = 0; h < 2; h++) {
                float sum = 0.0f, res = 0.0f;
                for (int j = 32 * h; j < 32 * h + 32; j++) sum += p[j], res += p[j] - s * (float)q[j];
                xsum[t * (K / 32) + 2 * g + h] = sum;
                xres[t * (K / 32) + 2 * g + h] = res;
            }
            xs64[t * (K / SXQ_G) + g] = xsum[t * (K / 32) + 2 * g] + xsum[t * (K / 32) + 2 * g + 1];
            xr64[t * (K / SXQ_G) + g] = xres[t * (K / 32) + 2 * g] + xres[t * (K / 32) + 2 * g + 1];
        }
}

/* The 64 codes of group g (values 64 g .. 64 g + 63 of the row) and its two blocks' (d, m) */
static inline void sxq_scales(int qtype, const uint8_t *row, int64_t g, float dm[4]) {
    if (qtype == Q8A) {   /* two 34-byte blocks: fp16 d, 32 int8 codes; no min */
        dm[0] = f16_to_f32(row + g * 68), dm[1] = 0.0f, dm[2] = f16_to_f32(row + g * 68 + 34), dm[3] = 0.0f;
        return;
    }
    const uint8_t *b0 = qtype == SX3 ? row + g * 28 : row + g * 24;
    const uint8_t *b1 = qtype == SX3 ? b0 : b0 + 12;
    dm[0] = f16_to_f32(b0), dm[1] = f16_to_f32(b0 + 2), dm[2] = f16_to_f32(b1), dm[3] = f16_to_f32(b1 + 2);
}

#if SXQ_FAST
/* One byte per code, byte i = value i's code: the group's code bytes (24 of them) in one masked load,
   each 64-bit lane given the word holding its 8 codes (vpermb), shifted into bytes (vpmultishiftqb) */
static inline __m512i sxq_codes(int qtype, const uint8_t *row, int64_t g) {
    if (qtype == Q8A)   /* the two blocks' 32 signed codes each, side by side */
        return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(row + g * 68 + 2))),
                                  _mm256_loadu_si256((const __m256i *)(row + g * 68 + 36)), 1);
    if (qtype == SX3) {   /* 4 fields of 6 bytes at 4 + 6 f (16 codes each, value j at bits 3 j): lanes 2 f, 2 f + 1 */
        const __m512i ctl = _mm512_set_epi64(0x1918171615141312LL, 0x1918171615141312LL, 0x131211100f0e0d0cLL,
                                             0x131211100f0e0d0cLL, 0x0d0c0b0a09080706LL, 0x0d0c0b0a09080706LL,
                                             0x0706050403020100LL, 0x0706050403020100LL);
        const __m512i at = _mm512_set_epi64(0x2d2a2724211e1b18LL, 0x15120f0c09060300LL, 0x2d2a2724211e1b18LL,
                                            0x15120f0c09060300LL, 0x2d2a2724211e1b18LL, 0x15120f0c09060300LL,
                                            0x2d2a2724211e1b18LL, 0x15120f0c09060300LL);
        __m512i q = _mm512_permutexvar_epi8(ctl, _mm512_maskz_loadu_epi8(0xFFFFFFull, row + g * 28 + 4));
        return _mm512_and_si512(_mm512_multishift_epi64_epi8(at, q), _mm512_set1_epi8(7));
    }
    /* SX2: u32 code words (value j at bits 2 j) at bytes 4, 8 (block 0) and 16, 20 (block 1) of the 24 */
    const __m512i ctl = _mm512_set_epi64(0x1b1a191817161514LL, 0x1b1a191817161514LL, 0x1716151413121110LL,
                                         0x1716151413121110LL, 0x0f0e0d0c0b0a0908LL, 0x0f0e0d0c0b0a0908LL,
                                         0x0b0a090807060504LL, 0x0b0a090807060504LL);
    const __m512i at = _mm512_set_epi64(0x1e1c1a1816141210LL, 0x0e0c0a0806040200LL, 0x1e1c1a1816141210LL,
                                        0x0e0c0a0806040200LL, 0x1e1c1a1816141210LL, 0x0e0c0a0806040200LL,
                                        0x1e1c1a1816141210LL, 0x0e0c0a0806040200LL);
    __m512i q = _mm512_permutexvar_epi8(ctl, _mm512_maskz_loadu_epi8(0xFFFFFFull, row + g * 24));
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(at, q), _mm512_set1_epi8(3));
}
#endif

/* sum_b m_b xs_b + cd_b xr_b over a row's nb blocks (the min's and the centre's terms of one output):
   16 lanes at a time into `acc` (summed once with the products), the last nb % 16 blocks returned */
static inline float sxq_terms(v16f *acc, const float *m, const float *xs, const float *cd, const float *xr,
                              int64_t nb) {
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16) *acc += ldf(m + b) * ldf(xs + b) + ldf(cd + b) * ldf(xr + b);
    float tail = 0.0f;
    for (; b < nb; b++) tail += m[b] * xs[b] + cd[b] * xr[b];
    return tail;
}

/* the 16 lanes' sum as a tree (a serial chain of adds would cost more than a short row's products) */
static inline float sxq_hsum(v16f a) {
    for (int w = 8; w > 0; w /= 2)
        for (int j = 0; j < w; j++) a[j] += a[j + w];
    return a[0];
}

/* y[t, ycol] for nt (a constant once inlined) activation rows from one packed row */
static inline __attribute__((always_inline)) void sxq_tile(const sxq_args *a, const uint8_t *row, int64_t t0,
                                                           int64_t ycol, int nt) {
    int64_t K = a->K, G = K / SXQ_G;
    float mv[K / 32], cv[K / 32];   /* per block: m, and C d (the terms after the loop) */
#if SXQ_FAST
    __m512 acc[TB];
    for (int i = 0; i < nt; i++) acc[i] = _mm512_setzero_ps();
#else
    float acc[TB] = {0};
#endif
    for (int64_t g = 0; g < G; g++) {
        float dm[4];
        sxq_scales(a->qtype, row, g, dm);
        mv[2 * g] = dm[1], mv[2 * g + 1] = dm[3];
        cv[2 * g] = SXQ_C(a->qtype) * dm[0], cv[2 * g + 1] = SXQ_C(a->qtype) * dm[2];
#if SXQ_FAST
        __m512i c = sxq_codes(a->qtype, row, g);
        __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(dm[0]), _mm512_set1_ps(dm[2]));
        /* vpdpbusd multiplies unsigned by signed bytes: Q8A's signed codes go second, against xq + 128
           (xq ^ 0x80 read as unsigned), and 128 * (sum of each lane's 4 codes) is taken back: exact */
        int signed_codes = a->qtype == Q8A;
        __m512i bias = signed_codes ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), c)
                                    : _mm512_setzero_si512();
        for (int i = 0; i < nt; i++) {
            int64_t t = t0 + i;
            __m512i xv = _mm512_loadu_si512((const void *)(a->xq + t * K + g * SXQ_G));
            __m512i dot = signed_codes ? _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                              _mm512_xor_si512(xv, _mm512_set1_epi8((char)0x80)), c), bias)
                                       : _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, xv);
            __m512 f = _mm512_cvtepi32_ps(dot);
            acc[i] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(a->sx[t * G + g])), acc[i]);
        }
#else
        int32_t code[SXQ_G];
        for (int h = 0; h < 2 && a->qtype == Q8A; h++)   /* signed bytes after each block's fp16 d */
            for (int j = 0; j < 32; j++) code[32 * h + j] = (int8_t)row[g * 68 + 34 * h + 2 + j];
        for (int h = 0; h < 2 && a->qtype != Q8A; h++) {   /* the group's two 32-value blocks (sub-blocks) */
            v16i lo, hi;
            if (a->qtype == SX3) sx_codes(SX3, row + g * 28, h, &lo, &hi);
            else sx_codes(SX2, row + g * 24 + 12 * h, 0, &lo, &hi);
            for (int j = 0; j < 16; j++) code[32 * h + j] = lo[j], code[32 * h + 16 + j] = hi[j];
        }
        for (int i = 0; i < nt; i++) {
            int64_t t = t0 + i;
            const int8_t *xq = a->xq + t * K + g * SXQ_G;
            int32_t s0 = 0, s1 = 0;
            for (int j = 0; j < 32; j++) s0 += code[j] * xq[j], s1 += code[32 + j] * xq[32 + j];
            float sx = a->sx[t * G + g];
            acc[i] += (float)s0 * (dm[0] * sx) + (float)s1 * (dm[2] * sx);
        }
#endif
    }
    for (int i = 0; i < nt; i++) {
        int64_t t = t0 + i;
#if SXQ_FAST
        v16f v = (v16f)acc[i];
        float tail = a->qtype == Q8A ? 0.0f : sxq_terms(&v, mv, a->xsum + t * (K / 32), cv, a->xres + t * (K / 32), K / 32);
        a->y[t * a->ldy + ycol] = _mm512_reduce_add_ps((__m512)v) + tail;
#else
        v16f v = {0};
        float tail = a->qtype == Q8A ? 0.0f : sxq_terms(&v, mv, a->xsum + t * (K / 32), cv, a->xres + t * (K / 32), K / 32);
        a->y[t * a->ldy + ycol] = acc[i] + sxq_hsum(v) + tail;
#endif
    }
}


#if SXQ_FAST
/* SX3 alone (the self-draft's main type), the row's scales first: its groups' (d, m) fp16 pairs gathered
   16 at a time and converted in two vcvtph2ps, each activation row's products d_g sx_tg and its min's
   and centre's terms m_g xs_tg + C d_g xr_tg (lanes = groups, the accumulator's starting value) computed
   as vectors; the loop over groups is then the codes (vpermb, vpmultishiftqb), one vpdpbusd, one
   conversion and one FMA whose scale is a broadcast from memory. Each row's sums run in the same order
   whatever nt is (the rowwise contract). */
static inline __attribute__((always_inline)) void sxq_tile3(const sxq_args *a, const uint8_t *row, int64_t t0,
                                                            int64_t ycol, int nt) {
    int64_t K = a->K, G = K / SXQ_G, GP = (G + 15) & ~(int64_t)15;
    float d[GP], m[GP], ds[nt * GP];
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(28));
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t g0 = 0; g0 < G; g0 += 16) {
        __mmask16 k = G - g0 >= 16 ? 0xFFFF : (__mmask16)((1u << (G - g0)) - 1);
        __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, at, row + g0 * 28, 1);
        __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(pairs)), hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(pairs, 1));
        _mm512_storeu_ps(d + g0, _mm512_permutex2var_ps(lo, even, hi));
        _mm512_storeu_ps(m + g0, _mm512_permutex2var_ps(lo, odd, hi));
    }
    __m512 acc[TB];
    for (int i = 0; i < nt; i++) {
        int64_t t = t0 + i;
        __m512 tail = _mm512_setzero_ps();
        for (int64_t g0 = 0; g0 < G; g0 += 16) {
            __mmask16 k = G - g0 >= 16 ? 0xFFFF : (__mmask16)((1u << (G - g0)) - 1);
            __m512 dv = _mm512_maskz_loadu_ps(k, d + g0), mv = _mm512_maskz_loadu_ps(k, m + g0);
            _mm512_storeu_ps(ds + i * GP + g0, _mm512_mul_ps(dv, _mm512_maskz_loadu_ps(k, a->sx + t * G + g0)));
            tail = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, a->xs64 + t * G + g0), tail);
            tail = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(3.5f)), _mm512_maskz_loadu_ps(k, a->xr64 + t * G + g0), tail);
        }
        acc[i] = tail;
    }
    for (int64_t g = 0; g < G; g++) {
        __m512i c = sxq_codes(SX3, row, g);
        for (int i = 0; i < nt; i++) {
            __m512i xv = _mm512_loadu_si512((const void *)(a->xq + (t0 + i) * K + g * SXQ_G));
            __m512 f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), c, xv));
            acc[i] = _mm512_fmadd_ps(f, _mm512_set1_ps(ds[i * GP + g]), acc[i]);
        }
    }
    for (int i = 0; i < nt; i++) a->y[(t0 + i) * a->ldy + ycol] = _mm512_reduce_add_ps(acc[i]);
}
#endif

#if SXQ_FAST
#define SXQ_ONE(n) (sx3 ? sxq_tile3(a, row, t0, ycol, n) : sxq_tile(a, row, t0, ycol, n))
#else
#define SXQ_ONE(n) sxq_tile(a, row, t0, ycol, n)
#endif
#define SXQ_TILE(n) case n: SXQ_ONE(n); break;
/* worker ith of nth: its share of the output rows, every activation row, TB at a time */
static void sxq_worker(void *p, int ith, int nth) {
    const sxq_args *a = p;
    int64_t chunk = (a->N + nth - 1) / nth, lo = chunk * ith < a->N ? chunk * ith : a->N;
    int64_t hi = lo + chunk < a->N ? lo + chunk : a->N;
    size_t rb = row_bytes(a->qtype, a->K);
    int sx3 = a->qtype == SX3;
    (void)sx3;
    for (int64_t n = lo; n < hi; n++) {
        const uint8_t *row = a->w + (size_t)n * rb;
        int64_t ycol = a->rowmap ? a->rowmap[n] : n;
        /* the row AHEAD bytes on, a line at a time, into every cache level: weights streamed from DRAM
           (46 MB of a draft's forward) ran at 2.4 GB/s a thread without a prefetch; a non-temporal one
           (locality 0) held SmolLM2's 30 MB Q8A head at 2.4 ms a one-row call on 2 threads, 0.77 with
           locality 3 (this VM, gemv micro-benchmark) */
        for (size_t off = 0; off < rb; off += 64) __builtin_prefetch(row + AHEAD + off, 0, 3);
        for (int64_t t0 = 0; t0 < a->T; t0 += TB) {
            switch (a->T - t0 < TB ? a->T - t0 : TB) {
            SXQ_TILE(1) SXQ_TILE(2) SXQ_TILE(3) SXQ_TILE(4) SXQ_TILE(5) SXQ_TILE(6) SXQ_TILE(7)
#if TB > 8
            SXQ_TILE(8) SXQ_TILE(9) SXQ_TILE(10) SXQ_TILE(11) SXQ_TILE(12) SXQ_TILE(13) SXQ_TILE(14) SXQ_TILE(15)
#endif
            default: SXQ_ONE(TB); break;
            }
        }
    }
}
#undef SXQ_TILE
#undef SXQ_ONE

#endif
