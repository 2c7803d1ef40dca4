/* decode_stack.c: a Llama (or Gemma-3) decoder stack over GGUF blocks for a few tokens, in one call
(offload/cpu/leanstack.py). Compiled into one library with ggml_gemv.c, whose ggml_gemm it calls.
Its structs (seg_t, layer_t, lane_t, dims_t), flags and prototype: decode_stack.h.

Contract: decode_stack_lanes(lanes, L, nl, dims, h, nthreads, flags) runs decoder layers [0, nl) in order
over the hidden states h, in place. For one lane (a sequence: its layer_t array `layers` with its
slabs, T tokens, rotary tables cos/sin (n, T, hd), mask) over h (T, D), exactly as transformers'
LlamaDecoderLayer computes them (fp32 throughout, up to the order of fp32 roundings):
    x  = rmsnorm(h) * attn_norm              rmsnorm(h) = h * 1/sqrt(mean(h^2) + eps), per token
    q|k|v = x Wqkv^T                         one ggml_gemm over the stacked q, k, v rows (row map
                                             puts each stored row at its HF column), or one each
                                             where their types differ (layer_t's segments)
    q, k = rope(q), rope(k)                  q * cos + rotate_half(q) * sin, cos/sin (T, hd)
    K[past + t], V[past + t] = k_t, v_t      written into the layer's slabs (Hkv, cap, hd)
    a_t = softmax(scale * q_t K^T + m_t) V   per head over rows [0, past + T) of its KV head
                                             (GQA: head h reads KV head h / (H / Hkv));
                                             m = mask (T, mask_cols) additive, or NULL: causal
                                             (row j visible to token t iff j <= past + t)
    h += a Wo^T
    x  = rmsnorm(h) * ffn_norm
    g|u = x Wgu^T;  h += (silu(g) * u) Wdown^T        silu(g) = g / (1 + exp(-g))
Gemma-3 (transformers' Gemma3DecoderLayer) takes the same steps with four more, each where its
layer_t pointer is not NULL, and dims' act = ACT_GELU_TANH:
    q, k = rmsnorm(q) * q_norm, rmsnorm(k) * k_norm   per head over hd, before rope (q_norm, k_norm)
    h += rmsnorm(a Wo^T) * post_attn_norm            (post_attn_norm)
    h += rmsnorm((act(g) * u) Wdown^T) * post_ffn_norm   (post_ffn_norm)
    act(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
with every norm weight already the multiplier (Gemma's 1 + w, folded by the caller), the scale
query_pre_attn_scalar^-0.5, and layer i rotated with its lane's table layers[i].rope (Gemma-3's local
and global layers have different RoPE bases). With AVX-512 the exps of softmax, SiLU and GELU are 16 at a
time (exp16: within 2 ulp of libm's expf; a softmax weight below e^-87 of the largest is 0) and the dot
products are 16-lane sums reduced as a tree: fp32 numbers again, in another order of roundings. Sliding windows are not applied: the caller runs a
pass here only when the window cannot hide a row (leanstack.py: past + T <= sliding_window).
With L lanes (offload/stream/multi.py: the requests `specx serve --parallel` decodes together) h holds
their rows back to back, lane j its T_j rows with its own layer_t array (its slabs and past; the
weights are read from lane 0's), rotary tables and mask. The norms, matmuls and MLP run over all rows together, so each
packed weight is read once per pass, not once per sequence; rope, the K/V rows and attention run per
lane over its own slabs. flags ROWWISE (2) has the matmuls compute every row as a one-row call does
(ggml_gemm_pool_rows), so one-token lanes sharing a call each get, bit for bit, the h and K/V rows a
call with that lane alone computes (a lane of several tokens alone takes the faster several-row
schedule, whose roundings differ).
The caller checks capacity (past + T <= cap), shapes and types; the slabs' `length` bookkeeping
stays the caller's. flags MATMULS_ONLY (1): each layer's four matmuls alone, on zeroed scratch,
h and the slabs untouched (a timing probe). Returns 0, -1 when a ggml_gemm refuses (an unsupported
type), -2 when scratch cannot be allocated.
Threads: the matmuls split rows over `nthreads` (ggml_gemm); attention splits (head, token)
pairs over pool.c's workers once the context is long enough to pay for the hand-off. Scratch is one malloc per call. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "decode_stack.h"   /* seg_t, layer_t, dims_t, lane_t, the flags */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

int ggml_gemm_slice(int, const uint8_t *, const float *, float *, const int32_t *, int64_t, int64_t, int64_t,
                    int64_t, int, int);   /* ggml_gemv.c, on pool.c's workers, into a slice of a wider y */
void pool_run(void (*fn)(void *, int, int), void *arg, int nth);   /* pool.c */

#define ATTN_PAR 512            /* (head, token) x context rows below which attention stays on one thread: a
                                   one-row draft pass of 9 heads over 150 rows (~27 us a layer) gains from two */

#define LANES 16
#define KV_AHEAD 8             /* K/V rows prefetched ahead of attention's scores */

/* sum_i a_i b_i over n values: in one 16-lane register summed as a tree (AVX-512: a 64-wide head dot is 4
   FMAs and one reduction, not a serial chain of 16 scalar adds), else in LANES interleaved partial sums. */
static inline float dot(const float *a, const float *b, int64_t n) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
#else
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.f;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
#endif
}

static void rmsnorm(const float *h, const float *w, float *out, int64_t T, int64_t D, float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float *x = h + t * D;
        float ss = dot(x, x, D);
        float inv = 1.f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++) out[t * D + i] = w[i] * (x[i] * inv);
    }
}

/* The MLP's activation of the gate: SiLU (Llama) or GELU's tanh approximation as torch computes it. */
static inline float act(float g, int32_t which) {
    if (which == ACT_GELU_TANH) {
        const float beta = 0.7978845608028654f, kappa = 0.044715f;   /* sqrt(2 / pi) */
        float inner = beta * (g + kappa * (g * g * g));
        return 0.5f * g * (1.f + tanhf(inner));
    }
    return g / (1.f + expf(-g));
}

#if defined(__AVX512F__)
/* exp(t) of 16 values, t clamped to [-88, 88]: a Cody-Waite reduction to [-ln2/2, ln2/2] and a degree-6
   polynomial (under 2 ulp of libm's expf), 2^n by vscalefps */
static inline __m512 exp16(__m512 t) {
    t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), t);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The activation of 16 gates: SiLU g / (1 + exp(-g)), or GELU's tanh approximation as g * sigmoid(2 inner)
   = g / (1 + exp(-2 inner)), the same function as 0.5 g (1 + tanh(inner)) without its cancellation where
   tanh is near -1 (libm's scalar tanhf was 0.4 ms of a Gemma-3 270M token) */
static inline __m512 act16(__m512 g, int32_t which) {
    __m512 t = _mm512_sub_ps(_mm512_setzero_ps(), g);
    if (which == ACT_GELU_TANH) {
        const __m512 beta = _mm512_set1_ps(0.7978845608028654f), kappa = _mm512_set1_ps(0.044715f);
        __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(g, _mm512_mul_ps(kappa, _mm512_mul_ps(_mm512_mul_ps(g, g), g))));
        t = _mm512_mul_ps(_mm512_set1_ps(-2.0f), inner);
    }
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(t)));
}
#endif

/* x (hd) rotated in place: x_i cos_i - x_{i+half} sin_i ; x_{i+half} cos_{i+half} + x_i sin_{i+half} */
static void rope(float *x, const float *c, const float *s, int64_t hd) {
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * c[i] + (-b) * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
    }
}

/* One (head, token): out (hd) = softmax(scale q K^T + m) V over rows [0, n); p: n floats of scratch.
   A row whose score is -inf (masked), or more than 87 below the largest (weight under 2e-38), weighs 0. */
static void attend(const float *q, const float *K, const float *V, int64_t n, int64_t hd, float scale,
                   const float *m, int64_t causal_end, float *p, float *out) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        float s;
        if (j + KV_AHEAD < n)   /* the slabs come from memory each token (the weights' stream evicts them) */
            for (int64_t c = 0; c < hd; c += 16) {
                __builtin_prefetch(K + (j + KV_AHEAD) * hd + c, 0, 3);
                __builtin_prefetch(V + (j + KV_AHEAD) * hd + c, 0, 3);
            }
        if (m == NULL && j > causal_end) s = -INFINITY;
        else {
            s = dot(q, K + j * hd, hd) * scale + (m ? m[j] : 0.f);
        }
        p[j] = s;
        if (s > mx) mx = s;
    }
    float sum = 0.f;
    int64_t j = 0;
#if defined(__AVX512F__)   /* 16 rows at a time (exp16) */
    __m512 vsum = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
    for (; j + 16 <= n; j += 16) {
        __m512 t = _mm512_sub_ps(_mm512_loadu_ps(p + j), vmx);
        __mmask16 live = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
        __m512 e = _mm512_maskz_mov_ps(live, exp16(t));
        _mm512_storeu_ps(p + j, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    sum = _mm512_reduce_add_ps(vsum);
#endif
    for (; j < n; j++) {
        float e = p[j] == -INFINITY ? 0.f : expf(p[j] - mx);
        p[j] = e;
        sum += e;
    }
    float inv = 1.f / sum;
#if defined(__AVX512F__)
    if (hd % 16 == 0 && hd <= 256) {   /* the weighted rows summed in registers, 16 values of out each */
        __m512 acc[16];
        int64_t c = hd / 16;
        for (int64_t i = 0; i < c; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t r = 0; r < n; r++) {
            if (p[r] == 0.f) continue;
            __m512 w = _mm512_set1_ps(p[r] * inv);
            for (int64_t i = 0; i < c; i++) acc[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(V + r * hd + 16 * i), acc[i]);
        }
        for (int64_t i = 0; i < c; i++) _mm512_storeu_ps(out + 16 * i, acc[i]);
        return;
    }
#endif
    for (int64_t i = 0; i < hd; i++) out[i] = 0.f;
    for (int64_t r = 0; r < n; r++) {
        if (p[r] == 0.f) continue;
        const float *vr = V + r * hd;
        float w = p[r] * inv;
        for (int64_t i = 0; i < hd; i++) out[i] += w * vr[i];
    }
}

typedef struct {
    const layer_t *l; const dims_t *d; const float *qkv, *mask; int64_t T, mask_cols; float *attn_out, *probs;
} attn_args;

/* (head, token) pairs pr = h T + t in nth contiguous runs, run ith here: a thread's heads share KV heads
   (GQA), so each reads fewer slabs from memory */
static void attention_share(void *p, int ith, int nth) {
    const attn_args *a = p;
    const layer_t *l = a->l;
    const dims_t *d = a->d;
    int64_t T = a->T, H = d->H, hd = d->hd, n = l->past + T, width = (d->H + 2 * d->Hkv) * hd;
    int64_t group = d->H / d->Hkv;
    int64_t chunk = (H * T + nth - 1) / nth, end = chunk * (ith + 1) < H * T ? chunk * (ith + 1) : H * T;
    for (int64_t pr = chunk * ith; pr < end; pr++) {
        int64_t h = pr / T, t = pr % T, g = h / group;
        const float *q = a->qkv + t * width + h * hd;
        const float *m = a->mask ? a->mask + t * a->mask_cols : NULL;
        attend(q, l->k + (size_t)g * l->cap * hd, l->v + (size_t)g * l->cap * hd, n, hd, d->scale, m,
               l->past + t, a->probs + (size_t)pr * n, a->attn_out + t * H * hd + h * hd);
    }
}

static void attention(const layer_t *l, const dims_t *d, const float *qkv, int64_t T, const float *mask,
                      int64_t mask_cols, float *attn_out, float *probs, int nthreads) {
    attn_args a = {l, d, qkv, mask, T, mask_cols, attn_out, probs};
    int64_t pairs = d->H * T, n = l->past + T;
    pool_run(attention_share, &a, pairs * n >= ATTN_PAR ? nthreads : 1);
}

/* q|k|v of every token: the q and k heads normed (where the layer has q_norm / k_norm) and rotated with
   table l->rope of cos/sin, then k and v into slab rows past .. past + T - 1. */
static void rope_and_store(const layer_t *l, const dims_t *d, float *qkv, int64_t T, const float *cos,
                           const float *sin) {
    int64_t hd = d->hd, width = (d->H + 2 * d->Hkv) * hd;
    cos += l->rope * T * hd, sin += l->rope * T * hd;
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * width;
        const float *c = cos + t * hd, *s = sin + t * hd;
        if (l->q_norm != NULL)
            for (int64_t h = 0; h < d->H + d->Hkv; h++)
                rmsnorm(row + h * hd, h < d->H ? l->q_norm : l->k_norm, row + h * hd, 1, hd, d->eps);
        for (int64_t h = 0; h < d->H + d->Hkv; h++) rope(row + h * hd, c, s, hd);
        for (int64_t g = 0; g < d->Hkv; g++) {
            size_t at = ((size_t)g * l->cap + l->past + t) * hd;
            memcpy(l->k + at, row + (d->H + g) * hd, hd * sizeof(float));
            memcpy(l->v + at, row + (d->H + d->Hkv + g) * hd, hd * sizeof(float));
        }
    }
}

/* y (T, ldy) = x W^T for the first n segments side by side (segment i at the columns after those
   before it; they must fill ldy), each row as a one-row call computes it when `rowwise` */
static int mm(const seg_t *s, int n, const float *x, float *y, int64_t ldy, int64_t K, int64_t T, int nthreads,
              int rowwise) {
    int64_t col = 0;
    for (int i = 0; i < n && s[i].rows > 0; col += s[i].rows, i++)
        if (ggml_gemm_slice(s[i].type, s[i].w, x, y + col, s[i].map, s[i].rows, K, T, ldy, nthreads, rowwise))
            return -1;
    return col == ldy ? 0 : -1;
}

/* The four matmuls of a layer alone, on zeroed scratch (MATMULS_ONLY: what bench/pass_breakdown.py
   subtracts from a whole pass to find the rest). */
static int matmuls(int rw, const layer_t *l, const dims_t *d, int64_t T, float *x, float *qkv, float *a,
                   float *y, float *gu, int nthreads) {
    int64_t D = d->D, F = d->F, qd = d->H * d->hd, width = qd + 2 * d->Hkv * d->hd;
    return mm(l->qkv, 3, x, qkv, width, D, T, nthreads, rw) || mm(&l->o, 1, a, y, D, qd, T, nthreads, rw)
        || mm(l->gu, 2, x, gu, 2 * F, D, T, nthreads, rw) || mm(&l->down, 1, gu, y, D, F, T, nthreads, rw) ? -1 : 0;
}

/* Decoder layer i over every lane: the row-wise steps (norms, matmuls, SiLU, residuals) over all rows
   at once, each lane's rope, K/V rows and attention over its own slabs and mask. */
static int layer(const lane_t *lanes, int64_t L, int64_t i, const dims_t *d, float *h, int64_t T, float *scr,
                 int nthreads, int flags) {
    const layer_t *l = &lanes[0].layers[i];
    int64_t D = d->D, F = d->F, qd = d->H * d->hd, width = qd + 2 * d->Hkv * d->hd;
    float *x = scr, *qkv = x + T * D, *a = qkv + T * width, *y = a + T * qd, *gu = y + T * D;
    float *probs = gu + T * 2 * F;
    int rw = (flags & ROWWISE) != 0;
    if (flags & MATMULS_ONLY) return matmuls(rw, l, d, T, x, qkv, a, y, gu, nthreads);
    rmsnorm(h, l->attn_norm, x, T, D, d->eps);
    if (mm(l->qkv, 3, x, qkv, width, D, T, nthreads, rw)) return -1;
    for (int64_t j = 0, row = 0; j < L; row += lanes[j].T, j++) {
        const lane_t *ln = &lanes[j];
        rope_and_store(&ln->layers[i], d, qkv + row * width, ln->T, ln->cos, ln->sin);
        attention(&ln->layers[i], d, qkv + row * width, ln->T, ln->mask, ln->mask_cols, a + row * qd, probs,
                  nthreads);
    }
    if (mm(&l->o, 1, a, y, D, qd, T, nthreads, rw)) return -1;
    if (l->post_attn_norm != NULL) rmsnorm(y, l->post_attn_norm, y, T, D, d->eps);   /* in place: row by row */
    for (int64_t k = 0; k < T * D; k++) h[k] += y[k];
    rmsnorm(h, l->ffn_norm, x, T, D, d->eps);
    if (mm(l->gu, 2, x, gu, 2 * F, D, T, nthreads, rw)) return -1;
    for (int64_t t = 0; t < T; t++) {           /* act (T, F) over the gate half's place */
        int64_t k = 0;
#if defined(__AVX512F__)   /* 16 at a time (act16) */
        for (; k + 16 <= F; k += 16)
            _mm512_storeu_ps(gu + t * F + k, _mm512_mul_ps(act16(_mm512_loadu_ps(gu + t * 2 * F + k), d->act),
                                                           _mm512_loadu_ps(gu + t * 2 * F + F + k)));
#endif
        for (; k < F; k++) {
            float g = gu[t * 2 * F + k];
            gu[t * F + k] = act(g, d->act) * gu[t * 2 * F + F + k];
        }
    }
    if (mm(&l->down, 1, gu, y, D, F, T, nthreads, rw)) return -1;
    if (l->post_ffn_norm != NULL) rmsnorm(y, l->post_ffn_norm, y, T, D, d->eps);
    for (int64_t k = 0; k < T * D; k++) h[k] += y[k];
    return 0;
}

int decode_stack_lanes(const lane_t *lanes, int64_t L, int64_t nl, const dims_t *d, float *h, int nthreads,
                       int flags) {
    int64_t width = (d->H + 2 * d->Hkv) * d->hd, T = 0, most = 0;
    for (int64_t j = 0; j < L; j++) {
        T += lanes[j].T;
        for (int64_t i = 0; i < nl; i++)   /* attention scratch: the widest lane's (head, token) x rows */
            if (lanes[j].T * (lanes[j].layers[i].past + lanes[j].T) > most)
                most = lanes[j].T * (lanes[j].layers[i].past + lanes[j].T);
    }
    size_t floats = (size_t)T * (d->D + width + d->H * d->hd + d->D + 2 * d->F) + (size_t)d->H * most;
    float *scr = (flags & MATMULS_ONLY) ? calloc(floats, sizeof(float)) : malloc(floats * sizeof(float));
    if (scr == NULL) return -2;
    int rc = 0;
    for (int64_t i = 0; i < nl && rc == 0; i++) rc = layer(lanes, L, i, d, h, T, scr, nthreads, flags);
    free(scr);
    return rc;
}
