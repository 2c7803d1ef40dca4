/* ggml_blocks.h: one 32-value sub-block of a GGUF weight row as fp32 codes and scales (ggml_gemv.c).

Contract: every supported type is read as 32-value sub-blocks b = 0 .. K/32 - 1 of a row, each
    w_j = dlo * c_j + m   (j < 16),     w_j = dhi * c_j + m   (j >= 16)
with c_j an exact small integer (the type's offset already subtracted), dlo/dhi/m fp32 scalars and
m = 0 for types without a min. These are exactly the numbers gguf.quants.dequantize computes: the
scale product d * sc of the K-quants is exact in fp32 (11-bit by 6- or 8-bit mantissas), and
d * c + m rounds the product, then the sum (K-quants' "- dmin * mn" is "+ (-(dmin * mn))"). Layouts
(little-endian; "nibbles": byte i holds value i in its low 4 bits, value i + 16 in its high 4 bits):
    Q4_0 (2)  18 B / 32:  fp16 d, 16 B nibbles                      w = d * (q - 8)
    Q4_1 (3)  20 B / 32:  fp16 d, fp16 m, 16 B nibbles              w = d * q + m
    Q5_0 (6)  22 B / 32:  fp16 d, u32 qh, 16 B nibbles              w = d * (q | qh.bit(j) << 4 - 16)
    Q5_1 (7)  24 B / 32:  fp16 d, fp16 m, u32 qh, 16 B nibbles      w = d * (q | qh.bit(j) << 4) + m
    Q8_0 (8)  34 B / 32:  fp16 d, 32 int8                           w = d * q
    Q4_K (12) 144 B / 256: fp16 d, fp16 dmin, 12 B of 6-bit (sc, mn) x 8, 128 B qs: sub-block s takes
              the low (s even) or high (s odd) nibbles of qs[32 (s/2) .. + 32]; w = d sc * q - dmin mn
    Q5_K (13) 176 B / 256: Q4_K's header, 32 B qh (bit s of byte i: value i of sub-block s), 128 B qs
    Q6_K (14) 210 B / 256: 128 B ql, 64 B qh, 16 int8 scales (one per 16 values), fp16 d at 208:
              sub-block s = 4 h + r: low 4 bits from ql[64 h + 32 (r & 1) + i] >> 4 (r >> 1), high 2
              from qh[32 h + i] >> 2 r; w = d * sc * (q - 32)
Two specx types (not GGUF's: the self-draft's HQQ substitutes, offload/quant/lowbit_pack.py), whose
codes are fields of little-endian words (SX2: value j of a 16-lane half at bits 2j .. 2j + 1 of a u32):
    SX3 (130)  28 B / 64: fp16 d, fp16 m, then per 32-value sub-block s (12 B at 4 + 12 s): two
              little-endian 48-bit fields (6 B each: values 0-15, then 16-31), value j of a half
              at bits 3j .. 3j + 2; q (0..7), w = d * q + m (one VBMI multishift spreads 16 codes)
    SX2 (131)  12 B / 32: fp16 d, fp16 m, u32 (values 0-15), u32 (values 16-31): w = d * q + m
and one specx view of a GGUF type: Q8A (136) is Q8_0's bytes read by the self-draft (its head over
8-bit activations, sx_q8.h); with K not a multiple of 64 it is Q8_0 exactly.
`sub(qtype, row, b, &s)`: the stored block holding sub-block b and b's index s in it; `codes` and
`subscales` then give c_j (lo = j < 16, hi = j >= 16) and the pair sc = (d, m), dlo = dhi = d, for
every type but Q6_K, whose pair is (dlo, dhi), m = 0. */

#ifndef GGML_BLOCKS_H
#define GGML_BLOCKS_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QK 32
/* FORCE: every helper of a sub-block's codes, scales and products is inlined into the per-type loops
   (ggml_gemv.c's KERNEL), so `qtype` is a constant there and the type switches fold away. GCC 12 left
   dot_rows and codes_of out of line once the SX types grew them: every sub-block then paid a call, a
   vzeroupper and the switches (the Q8_0 262144 x 640 head at one row: 39 -> 20 ms on one thread). */
#define FORCE inline __attribute__((always_inline))
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, SX3 = 130, SX2 = 131,
       Q8A = 136 };
/* GCC's -Wpsabi says a 64-byte vector passed or returned without AVX-512 has another ABI: true across
   translation units, moot here, where every function taking or returning one is static inline. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef uint8_t v16b_u __attribute__((vector_size(16), aligned(1), may_alias));   /* unaligned load */
typedef float v16f_u __attribute__((vector_size(64), aligned(4), may_alias));

static FORCE float f16_to_f32(const uint8_t *p) {
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

static FORCE v16f ldf(const float *p) { return *(const v16f_u *)p; }
static FORCE v16b ldb(const uint8_t *p) { return *(const v16b_u *)p; }
static FORCE v16f b2f(v16b q) { return __builtin_convertvector(__builtin_convertvector(q, v16i), v16f); }
/* 16 int8 -> 16 floats: bytes ^ 0x80 (= q + 128, unsigned), widened, converted, minus 128 (all exact;
   GCC 12 widens a signed byte vector with scalar code) */
static FORCE v16f i8f(const uint8_t *p) { return b2f(ldb(p) ^ 0x80) - 128.0f; }

static FORCE int is_k(int qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K; }
static FORCE int has_min(int qtype) {
    return qtype == Q4_1 || qtype == Q5_1 || qtype == Q4_K || qtype == Q5_K || qtype == SX3 || qtype == SX2;
}
/* bytes of one stored block (32 values, or 256 for the K-quants); 0: unsupported type */
static FORCE size_t block_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: case Q8A: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case SX3: return 28;
    case SX2: return 12;
    default: return 0;
    }
}
static FORCE int64_t block_values(int qtype) { return is_k(qtype) ? 256 : qtype == SX3 ? 64 : QK; }
static FORCE size_t row_bytes(int qtype, int64_t K) { return (size_t)(K / block_values(qtype)) * block_bytes(qtype); }

static FORCE const uint8_t *sub(int qtype, const uint8_t *row, int64_t b, int *s) {
    int64_t per = block_values(qtype) / QK;   /* sub-blocks per stored block: 1, 2 (SX3) or 8 */
    if (per == 1) {
        *s = 0;
        return row + b * block_bytes(qtype);
    }
    *s = (int)(b % per);
    return row + (b / per) * block_bytes(qtype);
}

/* 16 bytes widened to 32-bit lanes: every shift and mask below runs on 32-bit lanes (x86 has no
   byte shifts: a byte vector shifted by a variable count is emulated element by element) */
static FORCE v16i w32(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));   /* GCC 12 widens bytes with scalar code */
#else
    return __builtin_convertvector(ldb(p), v16i);
#endif
}
static FORCE v16f i2f(v16i q) { return __builtin_convertvector(q, v16f); }

/* the 5th bits of a Q5_0/Q5_1 block: bit j of qh for lanes j (lo) and 16 + j (hi), as 0 or 16 */
static FORCE void fifth_bits(const uint8_t *qh4, v16i *lo, v16i *hi) {
    const v16u lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    uint32_t qh;
    memcpy(&qh, qh4, 4);
    v16u bits = (v16u){0} + qh;
    *lo = (v16i)(((bits >> lane) & 1) << 4);
    *hi = (v16i)(((bits >> (lane + 16)) & 1) << 4);
}

/* SX3/SX2: 16 codes of 2 bits from one u32 (value j at bits 2j), plus SX3's third bits from hb >> h0 */
static FORCE v16i bits2(const uint8_t *p) {
    const v16u twice = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    uint32_t w;
    memcpy(&w, p, 4);
    return (v16i)((((v16u){0} + w) >> twice) & 3);
}
/* SX3: 16 codes of 3 bits from one 48-bit field (value j at bits 3j): values 0-7 from its low 32 bits,
   8-15 from bits 24-55, so every shift stays within a 32-bit lane */
static FORCE v16i bits3(const uint8_t *p) {
    const v16u shift = {0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21};
    const v16u upper = {0, 0, 0, 0, 0, 0, 0, 0, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u};
    uint64_t w = 0;
    memcpy(&w, p, 6);
    v16u base = (((v16u){0} + (uint32_t)w) & ~upper) | (((v16u){0} + (uint32_t)(w >> 24)) & upper);
    return (v16i)((base >> shift) & 7);
}

/* SX3/SX2 sub-block s's integer codes (0..7 or 0..3) in 16-lane halves */
static FORCE void sx_codes(int qtype, const uint8_t *blk, int s, v16i *lo, v16i *hi) {
    if (qtype == SX2) {
        *lo = bits2(blk + 4);
        *hi = bits2(blk + 8);
        return;
    }
    const uint8_t *q = blk + 4 + 12 * s;
    *lo = bits3(q);
    *hi = bits3(q + 6);
}

/* Integer codes of sub-block s of stored block `blk` as floats, the type's offset subtracted (exact) */
static FORCE void codes(int qtype, const uint8_t *blk, int s, v16f *lo, v16f *hi) {
    v16i a, b, h0, h1;
    switch (qtype) {
    case SX3: case SX2:
        sx_codes(qtype, blk, s, &a, &b);
        *lo = i2f(a);
        *hi = i2f(b);
        return;
    case Q8_0:
        *lo = i8f(blk + 2);
        *hi = i8f(blk + 18);
        return;
    case Q4_0: case Q4_1:
        a = w32(blk + (qtype == Q4_1 ? 4 : 2));
        *lo = i2f(a & 0x0F) - (qtype == Q4_0 ? 8.0f : 0.0f);
        *hi = i2f(a >> 4) - (qtype == Q4_0 ? 8.0f : 0.0f);
        return;
    case Q5_0: case Q5_1:
        a = w32(blk + (qtype == Q5_1 ? 8 : 6));
        fifth_bits(blk + (qtype == Q5_1 ? 4 : 2), &h0, &h1);
        *lo = i2f((a & 0x0F) | h0) - (qtype == Q5_0 ? 16.0f : 0.0f);
        *hi = i2f((a >> 4) | h1) - (qtype == Q5_0 ? 16.0f : 0.0f);
        return;
    case Q4_K: case Q5_K: {
        const uint8_t *qs = blk + (qtype == Q5_K ? 48 : 16) + 32 * (s >> 1);
        int sh = 4 * (s & 1);
        a = (w32(qs) >> sh) & 0x0F;
        b = (w32(qs + 16) >> sh) & 0x0F;
        if (qtype == Q5_K) {
            a |= ((w32(blk + 16) >> s) & 1) << 4;
            b |= ((w32(blk + 32) >> s) & 1) << 4;
        }
        *lo = i2f(a);
        *hi = i2f(b);
        return;
    }
    default: {   /* Q6_K */
        int h = s >> 2, r = s & 3;
        const uint8_t *ql = blk + 64 * h + 32 * (r & 1), *qh = blk + 128 + 32 * h;
        int sl = 4 * (r >> 1), shh = 2 * r;
        a = ((w32(ql) >> sl) & 0x0F) | (((w32(qh) >> shh) & 3) << 4);
        b = ((w32(ql + 16) >> sl) & 0x0F) | (((w32(qh + 16) >> shh) & 3) << 4);
        *lo = i2f(a - 32);
        *hi = i2f(b - 32);
        return;
    }
    }
}

/* Q4_K/Q5_K: sub-block s's 6-bit scale and min from the 12 packed bytes (llama.cpp's get_scale_min_k4) */
static FORCE void scale_min_k4(const uint8_t *q, int s, int *sc, int *mn) {
    if (s < 4) {
        *sc = q[s] & 63;
        *mn = q[s + 4] & 63;
    } else {
        *sc = (q[s + 4] & 0x0F) | ((q[s - 4] >> 6) << 4);
        *mn = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    }
}

/* sub-block s's scale pair sc[0..1] (see the contract): (d, m), or Q6_K's (dlo, dhi) */
static FORCE void subscales(int qtype, const uint8_t *blk, int s, float *sc) {
    int c, mn;
    switch (qtype) {
    case Q4_K: case Q5_K:
        scale_min_k4(blk + 4, s, &c, &mn);
        sc[0] = f16_to_f32(blk) * (float)c;
        sc[1] = -(f16_to_f32(blk + 2) * (float)mn);
        return;
    case Q6_K: {
        float d = f16_to_f32(blk + 208);
        sc[0] = d * (float)(int8_t)blk[192 + 2 * s];
        sc[1] = d * (float)(int8_t)blk[193 + 2 * s];
        return;
    }
    default:
        sc[0] = f16_to_f32(blk);
        sc[1] = has_min(qtype) ? f16_to_f32(blk + 2) : 0.0f;
        return;
    }
}

/* All 8 sub-blocks' scale pairs of a K-quant block at once (sc[2 s], sc[2 s + 1]), the fp16 d (and
   dmin) converted once: the same numbers as 8 `subscales` calls */
static FORCE void k_scales8(int qtype, const uint8_t *blk, float *sc) {
    if (qtype == Q6_K) {
        float d = f16_to_f32(blk + 208);
        for (int j = 0; j < 16; j++) sc[j] = d * (float)(int8_t)blk[192 + j];
        return;
    }
    float d = f16_to_f32(blk), dmin = f16_to_f32(blk + 2);
    for (int s = 0; s < 8; s++) {
        int c, mn;
        scale_min_k4(blk + 4, s, &c, &mn);
        sc[2 * s] = d * (float)c;
        sc[2 * s + 1] = -(dmin * (float)mn);
    }
}

#endif
