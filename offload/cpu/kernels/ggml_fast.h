/* ggml_fast.h: one sub-block's codes and scales for ggml_gemv.c's loops, with AVX-512 where the CPU has it.

Contract: `codes_of(qtype, blk, s, &lo, &hi)` and `scales_of(qtype, blk, s, sc)` give what ggml_blocks.h's
`codes` and `subscales` give (the scale pair sc[0..1]; sc must have room for 4 floats), and with
FAST_CODES (AVX-512 VBMI, BW, F16C: -march=native on recent x86) `table_values` gives a sub-block's 32
weights by table lookup for the types of at most 5-bit codes, specx's SX3/SX2 among them (returns 0
for the others), and `legacy_scales` the scale pairs of a Q4_0 / Q4_1 / Q8_0 row's blocks, 16 at a time
(0 where it does not apply: the caller then asks scales_of block by block). Every path
gives the same exact numbers; only the instructions differ. NO_FMA keeps a product rounded on its own
where the reference rounds it before a sum. */

#ifndef GGML_FAST_H
#define GGML_FAST_H

#include "ggml_blocks.h"

/* the types with the hand-tuned paths below (fp16 d at byte 0, Q4_1's m at 2, codes at the block's end) */
static FORCE int legacy(int qtype) { return qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0; }

/* NO_FMA(v): keep v's product rounded on its own (the reference's d * q, then + m) where the compiler
   would contract it into an fma; it needs v in one register (AVX-512), elsewhere it is a no-op. */
#if defined(__AVX512F__)
#define NO_FMA(v) __asm__("" : "+v"(v))
#else
#define NO_FMA(v) ((void)0)
#endif

#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512F__) && defined(__F16C__)
#define FAST_CODES 1
/* Nibble codes straight to fp32 bits, without int->float conversions: a small integer's fp32 bits are
   its bf16 bits << 16, so a table of 32 words (bf16 of code k & 15, Q4_0's minus 8) looked up by the
   nibble (vpermw reads an index word's low 5 bits) and written to the high word of each dword (the low
   words zeroed by the mask) is exactly float(code). vpermb first puts byte i of the block in the high
   word of dword i. Exact: every code is an integer below 16 in magnitude. */
static FORCE void codes4(int qtype, const uint8_t *q, v16f *lo, v16f *hi) {
    const __m512i spread = _mm512_set_epi8(
        0, 15, 0, 0, 0, 14, 0, 0, 0, 13, 0, 0, 0, 12, 0, 0, 0, 11, 0, 0, 0, 10, 0, 0, 0, 9, 0, 0, 0, 8, 0, 0,
        0, 7, 0, 0, 0, 6, 0, 0, 0, 5, 0, 0, 0, 4, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0);
    const __m512i tab4_1 = _mm512_set_epi16(
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080,
        0x4040, 0x4000, 0x3F80, 0x0000,
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080,
        0x4040, 0x4000, 0x3F80, 0x0000);                                   /* k & 15 */
    const __m512i tab4_0 = _mm512_set_epi16(
        0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040, 0xC080,
        0xC0A0, 0xC0C0, 0xC0E0, 0xC100,
        0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040, 0xC080,
        0xC0A0, 0xC0C0, 0xC0E0, 0xC100);                                   /* (k & 15) - 8 */
    __m512i tab = qtype == Q4_0 ? tab4_0 : tab4_1;
    __m512i r = _mm512_permutexvar_epi8(spread, _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)q)));
    *lo = (v16f)_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, r, tab);
    *hi = (v16f)_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, _mm512_srli_epi16(r, 4), tab);
}
/* A Q4 block's 16 possible values, w(k) = d * k + m (Q4_1) or d * (k - 8) (Q4_0), k = 0..15, as
   gguf.quants.dequantize computes them (a product, then a sum: two fp32 roundings): vpermps reads only
   an index dword's low 4 bits, so a nibble picks its value without masking or int->float conversion.
   One fma: d (an fp16, 11 significant bits) times k (4 bits) is exact in fp32, so rounding the product
   first changes nothing and fma(d, k, m) is the reference's number (one vector instruction fewer). */
static FORCE v16f values16(int qtype, float d, float m) {
    const v16f k = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    if (qtype == Q4_0) return d * (k - 8.0f);
#if defined(__AVX512F__)
    return (v16f)_mm512_fmadd_ps(_mm512_set1_ps(d), (__m512)k, _mm512_set1_ps(m));
#else
    v16f dk = d * k;
    NO_FMA(dk);
    return dk + m;
#endif
}
/* 16 int8 -> 16 floats with the sign-extending widening (exact) */
static FORCE v16f i8f_fast(const uint8_t *p) {
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static FORCE __m512i u8x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
/* d * k + m for k = k0 .. k0 + 15, product and sum rounded apart (the reference's two roundings) */
static FORCE v16f affine16(float d, float m, float k0) {
    const v16f k = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16f dk = d * (k + k0);
    NO_FMA(dk);
    return dk + m;
}
/* Sub-block s's 32 weights w_j (lo: j < 16, hi: j >= 16) by table lookup, for the types of at most 5-bit
   codes (1: done; 0: not such a type): the sub-block's 16 or 32 possible values (sc: d, m) are
   computed once, and each code picks its own (vpermps reads an index's low 4 bits, vpermt2ps its low
   5: no masking of the other nibble, no int -> float conversion). The same values as the reference. */
static FORCE int table_values(int qtype, const uint8_t *blk, int s, const float *sc, v16f *wlo, v16f *whi) {
    __m512i a, b;
    switch (qtype) {
    case Q4_0: case Q4_1: {
        v16f w16 = values16(qtype, sc[0], sc[1]);
        a = u8x16(blk + block_bytes(qtype) - 16);
        *wlo = (v16f)_mm512_permutexvar_ps(a, (__m512)w16);
        *whi = (v16f)_mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), (__m512)w16);
        return 1;
    }
    case Q4_K: {
        v16f w16 = affine16(sc[0], sc[1], 0.0f);
        const uint8_t *qs = blk + 16 + 32 * (s >> 1);
        a = u8x16(qs), b = u8x16(qs + 16);
        if (s & 1) { a = _mm512_srli_epi32(a, 4); b = _mm512_srli_epi32(b, 4); }
        *wlo = (v16f)_mm512_permutexvar_ps(a, (__m512)w16);
        *whi = (v16f)_mm512_permutexvar_ps(b, (__m512)w16);
        return 1;
    }
    case Q5_0: case Q5_1: case Q5_K: {
        const v16f k = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        v16f t0, t1;                                                         /* codes 0..15, 16..31 */
        if (qtype == Q5_0) t0 = sc[0] * (k - 16.0f), t1 = sc[0] * k;       /* d * (q - 16): no min */
        else t0 = affine16(sc[0], sc[1], 0.0f), t1 = affine16(sc[0], sc[1], 16.0f);
        __mmask16 hlo, hhi;
        if (qtype == Q5_K) {
            const uint8_t *qs = blk + 48 + 32 * (s >> 1);
            a = u8x16(qs), b = u8x16(qs + 16);
            if (s & 1) { a = _mm512_srli_epi32(a, 4); b = _mm512_srli_epi32(b, 4); }
            __m128i bit = _mm_set1_epi8((char)(1 << s));
            hlo = _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)(blk + 16)), bit);
            hhi = _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)(blk + 32)), bit);
        } else {
            uint32_t qh;
            memcpy(&qh, blk + (qtype == Q5_1 ? 4 : 2), 4);
            a = u8x16(blk + (qtype == Q5_1 ? 8 : 6));
            b = _mm512_srli_epi32(a, 4);
            hlo = (__mmask16)(qh & 0xFFFF), hhi = (__mmask16)(qh >> 16);
        }
        const __m512i c15 = _mm512_set1_epi32(15), c16 = _mm512_set1_epi32(16);
        a = _mm512_and_si512(a, c15), b = _mm512_and_si512(b, c15);
        a = _mm512_mask_or_epi32(a, hlo, a, c16), b = _mm512_mask_or_epi32(b, hhi, b, c16);
        *wlo = (v16f)_mm512_permutex2var_ps((__m512)t0, a, (__m512)t1);
        *whi = (v16f)_mm512_permutex2var_ps((__m512)t0, b, (__m512)t1);
        return 1;
    }
    case SX3: {   /* one multishift spreads 16 3-bit codes, one to a lane's low byte (bits 3j .. 3j + 7 of the
                     field: bit 3 is the next code's), and the table repeats its 8 values so bit 3 does not matter */
        const v16f k8 = {0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7};
        const __m512i at = _mm512_set_epi64(45LL << 32 | 42, 39LL << 32 | 36, 33LL << 32 | 30, 27LL << 32 | 24,
                                            21LL << 32 | 18, 15LL << 32 | 12, 9LL << 32 | 6, 3LL << 32 | 0);
        const uint8_t *q = blk + 4 + 12 * s;
        uint64_t w0, w1;
        memcpy(&w0, q, 8);                  /* values 0-15 (and 2 bytes of the next field: never selected) */
        memcpy(&w1, q + 4, 8);              /* values 16-31 at bits 16-63: within the sub-block's 12 bytes */
        v16f dk = sc[0] * k8;
        NO_FMA(dk);
        v16f w8 = dk + sc[1];
        a = _mm512_multishift_epi64_epi8(at, _mm512_set1_epi64((long long)w0));
        b = _mm512_multishift_epi64_epi8(at, _mm512_set1_epi64((long long)(w1 >> 16)));
        *wlo = (v16f)_mm512_permutexvar_ps(a, (__m512)w8);
        *whi = (v16f)_mm512_permutexvar_ps(b, (__m512)w8);
        return 1;
    }
    case SX2: {   /* 4 values: a code (0..3) picks its own from the affine table */
        v16f w16 = affine16(sc[0], sc[1], 0.0f);
        v16i lo, hi;
        sx_codes(qtype, blk, s, &lo, &hi);
        *wlo = (v16f)_mm512_permutexvar_ps((__m512i)lo, (__m512)w16);
        *whi = (v16f)_mm512_permutexvar_ps((__m512i)hi, (__m512)w16);
        return 1;
    }
    default:
        return 0;
    }
}
/* a mask of the first n of 16 lanes (n >= 0) */
static FORCE __mmask16 first16(int64_t n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }
#else
#define FAST_CODES 0
#endif

/* The scale pairs of a legacy row's blocks b0 .. b0 + nc - 1 into sc[2 i], sc[2 i + 1] (what scales_of
   writes per block: d, then m or the next two bytes, which nothing reads for the types without a min),
   16 blocks at a time: their first dwords gathered, the 32 fp16 halves in order d, m, d, m, .. converted
   by two vcvtph2ps instead of a load, a vcvtph2ps and a store per block. Returns 0 (nothing written) for
   the other types or without AVX-512. */
static FORCE int legacy_scales(int qtype, const uint8_t *row, int64_t b0, int64_t nc, float *sc) {
#if FAST_CODES
    if (!legacy(qtype)) return 0;
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)block_bytes(qtype)));
    for (int64_t i = 0; i < nc; i += 16) {
        int64_t n = nc - i < 16 ? nc - i : 16;   /* blocks now: 2 n floats out */
        __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), first16(n), at,
                                                 row + (b0 + i) * block_bytes(qtype), 1);
        _mm512_mask_storeu_ps(sc + 2 * i, first16(2 * n), _mm512_cvtph_ps(_mm512_castsi512_si256(dm)));
        if (n > 8) _mm512_mask_storeu_ps(sc + 2 * i + 16, first16(2 * n - 16), _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1)));
    }
    return 1;
#else
    (void)qtype, (void)row, (void)b0, (void)nc, (void)sc;
    return 0;
#endif
}

/* Codes of sub-block s (ggml_blocks.h's `codes`), with the table lookups where the CPU has them. */
static FORCE void codes_of(int qtype, const uint8_t *blk, int s, v16f *lo, v16f *hi) {
#if FAST_CODES
    if (qtype == Q6_K) {   /* the 6-bit codes assembled on bytes (two 16-bit shifts masked), then widened */
        int h = s >> 2, r = s & 3;
        const uint8_t *ql = blk + 64 * h + 32 * (r & 1), *qh = blk + 128 + 32 * h;
        __m128i nl = _mm_cvtsi32_si128(4 * (r >> 1)), nh = _mm_cvtsi32_si128(2 * r);
        __m128i m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(0x03), c32 = _mm_set1_epi8(32);
        for (int j = 0; j < 2; j++) {
            __m128i l = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(ql + 16 * j)), nl), m4);
            __m128i u = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(qh + 16 * j)), nh), m2);
            __m128i c = _mm_sub_epi8(_mm_or_si128(l, _mm_slli_epi16(u, 4)), c32);
            v16f f = (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
            if (j == 0) *lo = f; else *hi = f;
        }
        return;
    }
    if (qtype == Q8_0) {
        *lo = i8f_fast(blk + 2);
        *hi = i8f_fast(blk + 18);
        return;
    }
    if (qtype == Q4_0 || qtype == Q4_1) {
        codes4(qtype, blk + (qtype == Q4_1 ? 4 : 2), lo, hi);
        return;
    }
#endif
    codes(qtype, blk, s, lo, hi);
}

/* Sub-block s's scale pair (ggml_blocks.h) into sc[0..1]; the legacy types' fp16 d (and m) in one
   vcvtph2ps where the CPU has it (it writes sc[0..3]: callers leave room; Q4_0's and Q8_0's sc[1] is
   then not their m of 0 but the next bytes' value, which nothing reads: they have no min). */
static FORCE void scales_of(int qtype, const uint8_t *blk, int s, float *sc) {
#if FAST_CODES
    if (legacy(qtype)) {
        _mm_storeu_ps(sc, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)blk)));   /* [d, m, ..]: blocks are >= 18 bytes */
        return;
    }
#endif
    subscales(qtype, blk, s, sc);
}

#endif
