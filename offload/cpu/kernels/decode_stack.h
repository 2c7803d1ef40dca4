/* decode_stack.h: the structs and entry point of the one-call decoder stack (decode_stack.c).

Contract: the layouts here are the ones offload/cpu/leanstack.py mirrors by hand as ctypes
structures (_Seg, _Layer, _LaneT, _Dims, field for field); tests/test_kernel_layouts.py compiles
this header and compares every sizeof and offsetof with them. Change a field here and there together.
decode_stack_lanes' contract (what it computes, its flags and return codes): decode_stack.c. */

#ifndef DECODE_STACK_H
#define DECODE_STACK_H

#include <stdint.h>

typedef struct {                /* one matmul's packed weight, or an unused slot (rows 0) */
    const uint8_t *w;           /* packed GGUF bytes, (rows, K) */
    const int32_t *map;         /* HF column (within this segment) of each stored row, or NULL */
    int32_t type;               /* ggml type id */
    int64_t rows;               /* output columns */
} seg_t;

typedef struct {
    const float *attn_norm, *ffn_norm;                 /* (D) RMSNorm weights (Gemma: 1 + w, folded) */
    const float *q_norm, *k_norm;                      /* (hd) per-head RMSNorms of q and k, or NULL */
    const float *post_attn_norm, *post_ffn_norm;       /* (D) sandwich norms of the two branches, or NULL */
    seg_t qkv[3];      /* q|k|v side by side: one segment of all rows when they share a type and lie back
                          to back (formats/qfuse.py), else q, k and v (a Q4_K_M file's v has more bits) */
    seg_t o, gu[2], down;                              /* gate|up: one segment, or gate and up */
    int64_t rope;                                      /* which of the lane's rotary tables this layer uses */
    float *k, *v;                                      /* KV slabs (Hkv, cap, hd), rows [0, past) valid */
    int64_t cap, past;                                 /* slab rows; rows valid before this call */
} layer_t;

typedef struct {
    int64_t D, H, Hkv, hd, F;   /* hidden, query heads, KV heads, head dim, MLP width */
    float eps, scale;           /* RMSNorm epsilon; attention scale (Llama hd^-0.5, Gemma-3 query_pre_attn_scalar^-0.5) */
    int32_t act;                /* MLP activation: ACT_SILU or ACT_GELU_TANH */
} dims_t;

/* One sequence's share of a pass (decode_stack_lanes): its rows of h and its own cache. */
typedef struct {
    const layer_t *layers;          /* nl layers: its slabs and past (the weights are lane 0's) */
    int64_t T;                      /* its tokens: rows [row0, row0 + T) of h */
    const float *cos, *sin;         /* (n, T, hd) rotary tables of its positions: table r for layers of rope r */
    const float *mask;              /* (T, mask_cols) additive, or NULL: causal */
    int64_t mask_cols;
} lane_t;

#define ACT_SILU 0               /* dims_t.act: silu(g) = g / (1 + exp(-g)) (Llama) */
#define ACT_GELU_TANH 1          /* dims_t.act: GELU, tanh approximation (Gemma-3's gelu_pytorch_tanh) */

#define MATMULS_ONLY 1           /* flags: only each layer's four matmuls, nothing written to h or the slabs */
#define ROWWISE 2                /* flags: every matmul row computed as a one-row call does (ggml_gemm_pool_rows) */

int decode_stack_lanes(const lane_t *lanes, int64_t L, int64_t nl, const dims_t *d, float *h, int nthreads,
                       int flags);

#endif
