/* kernel_driver.c: the CPU kernels' real code paths, driven from C for AddressSanitizer and UBSan
(tests/test_kernel_sanitizers.py builds it with the kernel sources under -fsanitize=address,undefined).

Contract: `kernel_driver` runs, and exits 0 only if every check holds (else it prints each failure
and exits 1; a sanitizer report exits non-zero by itself):
  ggml_gemm for every type the kernel reads (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K, specx's SX3 SX2
  and Q8A), random blocks with finite fp16 scales, N = 37 rows (groups of 4 and a tail), K = 512 (and
  K = 96 where the type's blocks allow: SX2 and Q8A then leave the 8-bit-activation path), T = 1, 3
  and 17 (more than one pass of 16 rows). Every buffer is malloc'd to its exact size, so a read or
  write one byte outside is a heap-buffer-overflow. Checked: outputs finite; 3 OpenMP threads, the
  pool (2 threads) and ggml_gemm_slice (a row map into a wider output whose extra columns stay
  untouched) equal the one-thread call bit for bit; ggml_gemm_pool_rows' row t equals a one-row
  call on row t bit for bit; a type or K the kernel refuses returns -1.
  decode_stack_lanes over two layers of Q4_1 / Q8_0 weights (layer 0: q|k|v and gate|up one segment
  each, Llama; layer 1: q, k, v three segments of two types with a row map, gate and up two, and
  Gemma-3's q/k norms, sandwich norms and the second of each lane's two rotary tables): three lanes
  (8 tokens over 60 past rows, causal, long enough for attention on the pool; 1 token with an
  additive mask holding -inf; 1 token causal), each with its own slabs of exactly past + T rows.
  Checked: h finite; 1 and 2 threads equal bit for bit; with ROWWISE a one-token lane's h equals
  that lane run alone; MATMULS_ONLY leaves h as it was; with GELU (ACT_GELU_TANH) h is finite and
  differs from SiLU's; an unknown type returns -1.
`kernel_driver plant-overflow` reads one block past a weight buffer through ggml_gemm and
`kernel_driver plant-ub` overflows a signed int: each must be reported (the sanitizers are live). */

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decode_stack.h"

int ggml_gemm(int, const uint8_t *, const float *, float *, const int32_t *, int64_t, int64_t, int64_t, int);
int ggml_gemm_pool(int, const uint8_t *, const float *, float *, const int32_t *, int64_t, int64_t, int64_t, int);
int ggml_gemm_pool_rows(int, const uint8_t *, const float *, float *, const int32_t *, int64_t, int64_t, int64_t,
                        int);
int ggml_gemm_slice(int, const uint8_t *, const float *, float *, const int32_t *, int64_t, int64_t, int64_t,
                    int64_t, int, int);

/* Each type's block as GGUF (and specx's lowbit_pack.py) define it, written here independently of the
   kernel's own tables: values and bytes per block, the byte offsets of its fp16 scale fields. */
typedef struct { const char *name; int id, values, bytes, fp16[2], nfp16; } qtype_t;
static const qtype_t TYPES[] = {
    {"Q4_0", 2, 32, 18, {0}, 1},   {"Q4_1", 3, 32, 20, {0, 2}, 2},  {"Q5_0", 6, 32, 22, {0}, 1},
    {"Q5_1", 7, 32, 24, {0, 2}, 2}, {"Q8_0", 8, 32, 34, {0}, 1},    {"Q4_K", 12, 256, 144, {0, 2}, 2},
    {"Q5_K", 13, 256, 176, {0, 2}, 2}, {"Q6_K", 14, 256, 210, {208}, 1}, {"SX3", 130, 64, 28, {0, 2}, 2},
    {"SX2", 131, 32, 12, {0, 2}, 2}, {"Q8A", 136, 32, 34, {0}, 1},
};
#define NTYPES ((int)(sizeof TYPES / sizeof TYPES[0]))

static int failures = 0, checks = 0;
#define CHECK(cond, ...)                                                                            \
    do {                                                                                            \
        checks++;                                                                                   \
        if (!(cond)) {                                                                              \
            failures++;                                                                             \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                    \
            fprintf(stderr, __VA_ARGS__);                                                           \
            fputc('\n', stderr);                                                                    \
        }                                                                                           \
    } while (0)

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) {   /* xorshift64* */
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return (uint32_t)((rng * 2685821657736338717ull) >> 32);
}
static float uniform(void) { return (float)next() / 4294967296.0f * 2.0f - 1.0f; }   /* [-1, 1) */

static void *must(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (p == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

static float *randf(size_t n, float lo, float span) {
    float *p = must(n * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = lo + span * uniform();
    return p;
}

/* (n, k) weight of type q: random bytes, every fp16 field a finite normal of magnitude 2^-10 .. 2^-4 */
static uint8_t *blocks(const qtype_t *q, int64_t n, int64_t k) {
    size_t nb = (size_t)(n * (k / q->values)), bytes = nb * (size_t)q->bytes;
    uint8_t *w = must(bytes);
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)next();
    for (size_t b = 0; b < nb; b++)
        for (int f = 0; f < q->nfp16; f++) {
            uint16_t h = (uint16_t)((next() & 1) << 15 | (5 + next() % 6) << 10 | (next() & 0x3FF));
            memcpy(w + b * (size_t)q->bytes + q->fp16[f], &h, 2);
        }
    return w;
}

static const qtype_t *type_of(int id) {
    for (int i = 0; i < NTYPES; i++)
        if (TYPES[i].id == id) return &TYPES[i];
    return NULL;
}

static int all_finite(const float *y, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(y[i])) return 0;
    return 1;
}

/* One (type, K, T): the one-thread call as reference, then every other entry point against it. */
static void gemm_case(const qtype_t *q, int64_t N, int64_t K, int64_t T) {
    uint8_t *w = blocks(q, N, K);
    float *x = randf((size_t)(T * K), 0.f, 1.f), *y1 = must(sizeof(float) * (size_t)(T * N));
    float *y = must(sizeof(float) * (size_t)(T * N)), *row = must(sizeof(float) * (size_t)N);
    int64_t ldy = N + 5;
    float *ys = must(sizeof(float) * (size_t)(T * ldy));
    int32_t *map = must(sizeof(int32_t) * (size_t)N);
    for (int64_t n = 0; n < N; n++) map[n] = (int32_t)(N - 1 - n);
    size_t bytes = sizeof(float) * (size_t)(T * N);

    CHECK(ggml_gemm(q->id, w, x, y1, NULL, N, K, T, 1) == 0, "%s K=%lld T=%lld refused", q->name, (long long)K,
          (long long)T);
    CHECK(all_finite(y1, (size_t)(T * N)), "%s K=%lld T=%lld: not finite", q->name, (long long)K, (long long)T);
    CHECK(ggml_gemm(q->id, w, x, y, NULL, N, K, T, 3) == 0 && !memcmp(y, y1, bytes), "%s T=%lld: 3 threads differ",
          q->name, (long long)T);
    CHECK(ggml_gemm_pool(q->id, w, x, y, NULL, N, K, T, 2) == 0 && !memcmp(y, y1, bytes), "%s T=%lld: pool differs",
          q->name, (long long)T);
    CHECK(ggml_gemm_pool_rows(q->id, w, x, y, NULL, N, K, T, 2) == 0, "%s rows refused", q->name);
    for (int64_t t = 0; t < T; t++) {
        CHECK(ggml_gemm(q->id, w, x + t * K, row, NULL, N, K, 1, 1) == 0, "%s one row refused", q->name);
        CHECK(!memcmp(y + t * N, row, sizeof(float) * (size_t)N), "%s T=%lld: pool_rows row %lld != a one-row call",
              q->name, (long long)T, (long long)t);
    }
    for (int64_t i = 0; i < T * ldy; i++) ys[i] = -7.f;   /* sentinel: the columns past N stay as they are */
    CHECK(ggml_gemm_slice(q->id, w, x, ys, map, N, K, T, ldy, 2, 0) == 0, "%s slice refused", q->name);
    int same = 1;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t n = 0; n < N; n++) same &= ys[t * ldy + map[n]] == y1[t * N + n];
        for (int64_t c = N; c < ldy; c++) same &= ys[t * ldy + c] == -7.f;
    }
    CHECK(same, "%s K=%lld T=%lld: slice with a row map differs", q->name, (long long)K, (long long)T);
    free(w), free(x), free(y1), free(y), free(row), free(ys), free(map);
}

static void gemm_all(void) {
    const int64_t Ts[] = {1, 3, 17};
    for (int i = 0; i < NTYPES; i++)
        for (int t = 0; t < 3; t++) {
            gemm_case(&TYPES[i], 37, 512, Ts[t]);
            if (96 % TYPES[i].values == 0) gemm_case(&TYPES[i], 37, 96, Ts[t]);   /* K % 64 != 0 */
        }
    uint8_t *w = blocks(type_of(3), 4, 64);
    float x[64] = {0}, y[4];
    CHECK(ggml_gemm(99, w, x, y, NULL, 4, 64, 1, 1) == -1, "an unknown type was not refused");
    CHECK(ggml_gemm(3, w, x, y, NULL, 4, 48, 1, 1) == -1, "K = 48 of Q4_1 was not refused");
    CHECK(ggml_gemm(12, w, x, y, NULL, 1, 64, 1, 1) == -1, "K = 64 of Q4_K was not refused");
    free(w);
}

/* ---- decode_stack_lanes ---- */
enum { D = 64, H = 4, HKV = 2, HD = 16, F = 128, NL = 2, NLANE = 3 };

static seg_t seg(int id, int64_t rows, int64_t k, int32_t *map) {
    seg_t s = {blocks(type_of(id), rows, k), map, id, rows};
    return s;
}

static void weights(layer_t *l, int which) {
    l->attn_norm = randf(D, 1.f, 0.1f);
    l->ffn_norm = randf(D, 1.f, 0.1f);
    int32_t *map = NULL;
    if (which == 0) {
        l->qkv[0] = seg(3, (H + 2 * HKV) * HD, D, NULL);   /* Q4_1, q|k|v stacked */
        l->o = seg(8, D, H * HD, NULL);
        l->gu[0] = seg(3, 2 * F, D, NULL);
        l->down = seg(8, D, F, NULL);
        return;
    }
    map = must(sizeof(int32_t) * H * HD);
    for (int i = 0; i < H * HD; i++) map[i] = H * HD - 1 - i;
    l->qkv[0] = seg(8, H * HD, D, map);   /* q Q8_0 with a row map, k Q4_1, v Q8_0 */
    l->qkv[1] = seg(3, HKV * HD, D, NULL);
    l->qkv[2] = seg(8, HKV * HD, D, NULL);
    l->o = seg(3, D, H * HD, NULL);
    l->gu[0] = seg(8, F, D, NULL);
    l->gu[1] = seg(3, F, D, NULL);
    l->down = seg(3, D, F, NULL);
    l->q_norm = randf(HD, 1.f, 0.5f);   /* Gemma-3: per-head q/k norms, sandwich norms, rotary table 1 */
    l->k_norm = randf(HD, 1.f, 0.5f);
    l->post_attn_norm = randf(D, 4.f, 1.f);
    l->post_ffn_norm = randf(D, 4.f, 1.f);
    l->rope = 1;
}

static void free_weights(layer_t *l) {
    free((void *)l->attn_norm), free((void *)l->ffn_norm), free((void *)l->qkv[0].map);
    free((void *)l->q_norm), free((void *)l->k_norm), free((void *)l->post_attn_norm), free((void *)l->post_ffn_norm);
    seg_t *all[] = {&l->qkv[0], &l->qkv[1], &l->qkv[2], &l->o, &l->gu[0], &l->gu[1], &l->down};
    for (int i = 0; i < 7; i++) free((void *)all[i]->w);
}

typedef struct { lane_t lane; layer_t layers[NL]; } lane_box;

/* Lane j: T tokens over `past` rows of its own slabs (random), its rotary tables, its mask or NULL. */
static void make_lane(lane_box *b, const layer_t *w, int64_t T, int64_t past, int masked) {
    for (int i = 0; i < NL; i++) {
        b->layers[i] = w[i];
        b->layers[i].cap = past + T;
        b->layers[i].past = past;
        b->layers[i].k = randf((size_t)(HKV * (past + T) * HD), 0.f, 1.f);
        b->layers[i].v = randf((size_t)(HKV * (past + T) * HD), 0.f, 1.f);
    }
    /* two rotary tables (T, HD) back to back: bases 1e4 (layer 0) and 1e6 (layer 1, its rope = 1) */
    float *cs = must(sizeof(float) * (size_t)(2 * T * HD)), *sn = must(sizeof(float) * (size_t)(2 * T * HD));
    for (int r = 0; r < 2; r++)
        for (int64_t t = 0; t < T; t++)
            for (int i = 0; i < HD; i++) {
                float a = (float)(past + t) / powf(r ? 1e6f : 1e4f, (float)(2 * (i % (HD / 2))) / HD);
                cs[(r * T + t) * HD + i] = cosf(a), sn[(r * T + t) * HD + i] = sinf(a);
            }
    float *mask = NULL;
    if (masked) {   /* (T, past + T): row 0 hidden, the rest visible */
        mask = randf((size_t)(T * (past + T)), 0.f, 0.5f);
        for (int64_t t = 0; t < T; t++) mask[t * (past + T)] = -INFINITY;
    }
    lane_t l = {b->layers, T, cs, sn, mask, masked ? past + T : 0};
    b->lane = l;
}

static void free_lane(lane_box *b) {
    for (int i = 0; i < NL; i++) free(b->layers[i].k), free(b->layers[i].v);
    free((void *)b->lane.cos), free((void *)b->lane.sin), free((void *)b->lane.mask);
}

static int run(lane_box *boxes, int first, int n, const dims_t *d, float *h, int threads, int flags) {
    lane_t lanes[NLANE];
    for (int j = 0; j < n; j++) lanes[j] = boxes[first + j].lane;
    return decode_stack_lanes(lanes, n, NL, d, h, threads, flags);
}

static void stack_all(void) {
    dims_t d = {D, H, HKV, HD, F, 1e-5f, 0.25f, ACT_SILU};
    layer_t w[NL];
    memset(w, 0, sizeof w);
    weights(&w[0], 0);
    weights(&w[1], 1);
    lane_box boxes[NLANE];
    make_lane(&boxes[0], w, 8, 60, 0);   /* 4 heads x 8 tokens x 68 rows >= ATTN_PAR: attention on the pool */
    make_lane(&boxes[1], w, 1, 2, 1);
    make_lane(&boxes[2], w, 1, 5, 0);
    const int64_t T = 10;
    size_t bytes = sizeof(float) * T * D;
    float *h0 = randf(T * D, 0.f, 1.f), *h1 = must(bytes), *h2 = must(bytes), *alone = must(sizeof(float) * D);

    memcpy(h1, h0, bytes);
    CHECK(run(boxes, 0, NLANE, &d, h1, 1, 0) == 0, "decode_stack_lanes refused");
    CHECK(all_finite(h1, T * D), "decode_stack: h not finite");
    memcpy(h2, h0, bytes);
    CHECK(run(boxes, 0, NLANE, &d, h2, 2, 0) == 0 && !memcmp(h1, h2, bytes), "decode_stack: 2 threads differ");

    memcpy(h1, h0, bytes);
    CHECK(run(boxes, 0, NLANE, &d, h1, 2, ROWWISE) == 0, "ROWWISE refused");
    memcpy(alone, h0 + 8 * D, sizeof(float) * D);   /* lane 1's row, run alone */
    CHECK(run(boxes, 1, 1, &d, alone, 2, 0) == 0 && !memcmp(alone, h1 + 8 * D, sizeof(float) * D),
          "ROWWISE: a one-token lane differs from the lane alone");

    memcpy(h1, h0, bytes);
    CHECK(run(boxes, 0, NLANE, &d, h1, 2, MATMULS_ONLY) == 0 && !memcmp(h1, h0, bytes), "MATMULS_ONLY wrote h");

    dims_t gelu = d;
    gelu.act = ACT_GELU_TANH;
    memcpy(h1, h0, bytes), memcpy(h2, h0, bytes);
    CHECK(run(boxes, 0, NLANE, &d, h1, 2, 0) == 0 && run(boxes, 0, NLANE, &gelu, h2, 2, 0) == 0, "GELU refused");
    CHECK(all_finite(h2, T * D) && memcmp(h1, h2, bytes), "GELU: h not finite, or equal to SiLU's");

    int32_t good = boxes[0].layers[1].qkv[1].type;
    boxes[0].layers[1].qkv[1].type = 99;
    CHECK(run(boxes, 0, NLANE, &d, h1, 2, 0) == -1, "an unknown type in a layer was not refused");
    boxes[0].layers[1].qkv[1].type = good;

    for (int j = 0; j < NLANE; j++) free_lane(&boxes[j]);
    free_weights(&w[0]), free_weights(&w[1]);
    free(h0), free(h1), free(h2), free(alone);
}

static int plant(const char *what, int argc) {
    if (!strcmp(what, "plant-overflow")) {   /* Q4_1 (4, 64): 8 blocks allocated, 7 of them given */
        const qtype_t *q = type_of(3);
        uint8_t *w = blocks(q, 4, 64), *short_w = must(7 * (size_t)q->bytes);
        memcpy(short_w, w, 7 * (size_t)q->bytes);
        float x[64] = {0}, y[4];
        int rc = ggml_gemm(3, short_w, x, y, NULL, 4, 64, 1, 1);
        free(w), free(short_w);
        return rc;
    }
    volatile int big = INT_MAX - 1;
    return big + argc + 1 > 0;   /* plant-ub: INT_MAX - 1 + 2 + 1 overflows */
}

int main(int argc, char **argv) {
    if (argc > 1) {
        plant(argv[1], argc);
        fprintf(stderr, "%s: not reported\n", argv[1]);
        return 3;
    }
    gemm_all();
    int after_gemm = checks;
    stack_all();
    printf("checks: %d gemm, %d stack, %d failed\n", after_gemm, checks - after_gemm, failures);
    return failures ? 1 : 0;
}
