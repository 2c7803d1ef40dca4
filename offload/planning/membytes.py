"""Byte formulas of the memory plan: model shapes, KV caches, NF4 quant states, pass activations
(and what each other request's tree adds to a forest pass), the static draft step's buffers and graphs.

Contract: pure functions of config.json values (`Arch`), dtypes and token counts; no I/O.
`req` arguments are `memplan.PlanRequest`s (only dtype, device, ctx, attn, draft_dtype, max_beams,
temperature, self_draft and draft_bits are read). Every formula states the tensors it counts; memplan.py sums them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from offload.errors import OffloadError

NF4_BLOCK, NF4_NESTED_BLOCK = 64, 256
PREFILL_CHUNK = 256  # prompt tokens per target pass at least (bigger when the tree is)
_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass(frozen=True)
class Arch:
    """Shapes the plan needs, from config.json (text_config for multimodal wrappers)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    max_positions: int
    packed: bool = False  # linears stored packed int4 (AWQ/GPTQ/compressed-tensors/GGUF): dequantized per pass
    method: str = ""  # quantization_config.quant_method of a packed checkpoint ("gguf", "awq", ...) or "mxfp4"


def arch_of(config: dict) -> Arch:
    c = config.get("text_config") or config
    try:
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        return Arch(
            hidden,
            int(c["intermediate_size"]),
            int(c["num_hidden_layers"]),
            heads,
            int(c.get("num_key_value_heads") or heads),
            int(c.get("head_dim") or hidden // heads),
            int(c["vocab_size"]),
            bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", False))),
            int(c.get("max_position_embeddings") or 2048),
            _packed(config),
            _method(config),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise OffloadError(f"config.json lacks {exc}; cannot plan memory for this model") from None


PACKED_METHODS = ("awq", "gptq", "compressed-tensors", "gguf")  # offload/formats readers that dequantize per pass


def _packed(config: dict) -> bool:
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") in PACKED_METHODS


def _method(config: dict) -> str:
    """quant_method of a packed checkpoint, or "mxfp4" (gpt-oss's experts, formats/mxfp4.py; linears plain)."""
    method = (config.get("quantization_config") or {}).get("quant_method", "")
    return method if _packed(config) or method == "mxfp4" else ""


def dtype_bytes(name: str) -> int:
    if name.lower() not in _BYTES:
        raise OffloadError(f"unsupported dtype {name!r}; use bf16, fp16, fp32 or nf4")
    return _BYTES[name.lower()]


def compute_bytes(req) -> int:
    """Bytes per element of the target's compute dtype (nf4 computes in bf16 on CUDA, fp32 on CPU)."""
    if req.dtype == "nf4":
        return 2 if req.device == "cuda" else 4
    return dtype_bytes(req.dtype)


def compute_dtype(req) -> torch.dtype:
    """The 16-bit or fp32 dtype of compute_bytes(req): what the GGUF kernel checks, nf4's pinned parts."""
    return torch.float32 if compute_bytes(req) == 4 else torch.bfloat16


def kv_rows(ctx: int, budget: int, max_beams: int) -> tuple[int, int]:
    """(target, draft) cache rows: the context plus the largest tree each cache ever holds.

    Target: committed tokens (< ctx) + root + `budget` verified nodes. Draft: committed tokens +
    every node tree growth runs; nodes that drop out of the top-`budget` after running stay in the
    cache, so allow twice the budget plus one batch of beams.
    """
    return ctx + budget + 1, ctx + 2 * budget + max_beams + 1


def pass_tokens(budget: int) -> int:
    """Largest target pass: a verify pass (budget + 1) or a prefill chunk, whichever is bigger."""
    return max(budget + 1, PREFILL_CHUNK)


def nf4_state_bytes(numel: int) -> int:
    """QuantState of one NF4 weight (blocksize 64, double-quantized), as the loader keeps it:
    uint8 absmax per block + fp32 nested absmax per 256 blocks + 256-entry fp32 nested code
    + 16-entry fp32 NF4 code + fp32 offset."""
    blocks = math.ceil(numel / NF4_BLOCK)
    return blocks + 4 * math.ceil(blocks / NF4_NESTED_BLOCK) + 256 * 4 + 16 * 4 + 4


def torch_dtype(name: str) -> torch.dtype:
    half = torch.float16 if "16" in name and "b" not in name else torch.bfloat16
    return {2: half, 4: torch.float32}[dtype_bytes(name)]


def draft_bytes(ck, dtype: str) -> int:
    """Draft parameters in `dtype` (a tied lm_head shares the embedding) + rotary buffers;
    `ck` is a formats.Checkpoint (its config and tensor headers)."""
    a, b = arch_of(ck.config), dtype_bytes(dtype)
    total = 0
    for name, e in ck.tensors.items():
        if name.endswith("inv_freq") or (a.tied and name == "lm_head.weight"):
            continue
        total += math.prod(e.shape) * b
    return total + rotary_bytes(a)


def rotary_bytes(a: Arch) -> int:
    """HF rotary embedding buffers: inv_freq and original_inv_freq, head_dim/2 fp32 each."""
    return 2 * (a.head_dim // 2) * 4


def kv_bytes(a: Arch, rows: int, elem: int) -> int:
    """K and V for every layer: (kv_heads, rows, head_dim) each, in the compute dtype."""
    return 2 * a.layers * a.kv_heads * a.head_dim * rows * elem


def pass_bytes(
    a: Arch,
    t: int,
    s: int,
    c: int,
    attn: str,
    logit_rows: int,
    deq: int = 0,
    fused: bool = False,
    sampling: int = 0,
    device: str = "cuda",
) -> int:
    """Transient device bytes of one pass of T new tokens over S key positions (one layer alive).

    hidden states (residual, normed, attention/MLP outputs: 4 x T x hidden), q/k/v before and
    after RoPE (2 x T x (H + 2 KV) x hd), MLP gate/up/act/product (4 x T x I), the pass's mask,
    attention's own temporaries, `deq` bytes of dequantization temporaries (dequant_temp_bytes), the
    pass's logits in the compute dtype (rows x V x c) and `sampling` bytes of the sampling workspace
    (sampling_bytes). The mask: a tree pass's additive (1, 1, T, S) mask at the width rounded to 8
    (core/tree.py), T x S8 x c; a causal prefill chunk (`fused`) over a cache: transformers' boolean
    T x S mask (none for the first chunk; the bigger case is counted). Attention under "sdpa" (run as
    offload/arch/attention.py's specx_gqa) never repeats K/V and never builds scores: its temporaries
    are attention.mask_bytes (CPU: none; CUDA: the prepared additive mask and a folded or per-group
    copy, by the strategy the pass's size picks). Under eager, transformers repeats K/V
    (2 x H x S x hd) and builds the scores (H x T x S: scores and softmax output in c plus an fp32 softmax).
    """
    from offload.arch.attention import mask_bytes, padded

    hidden = 4 * t * a.hidden * c
    qkv = 2 * t * (a.heads + 2 * a.kv_heads) * a.head_dim * c
    groups = a.heads // a.kv_heads
    if attn == "eager":
        gqa = 2 * a.heads * s * a.head_dim * c if groups > 1 else 0
        scores = a.heads * t * s * (2 * c + 4)
    else:
        gqa = mask_bytes(device, t, s, groups, a.kv_heads, a.head_dim, c, 1 if fused else c)
        scores = 0
    mlp = 4 * t * a.intermediate * c
    mask = t * s if fused else t * padded(s) * c
    return hidden + qkv + gqa + scores + mlp + mask + deq + logit_rows * a.vocab * c + sampling


DRAFT_STEP_ROWS = 128  # core/draftstep.LARGEST: the mask store's rows, the widest pass whose inputs are kept
DRAFT_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # core/draftstep.BUCKETS["cuda"]: the padded pass widths


def draft_step_terms(a: Arch, rows: int, c: int, attn: str, graphs: bool, device: str = "cuda") -> dict[str, int]:
    """Long-lived device bytes of the static draft step (specexec_cli/core/draftstep.py) over a draft
    cache of `rows` reserved rows (a self-draft: the target's shared slabs), draft dtype `c` bytes:
    - mask_store: the (DRAFT_STEP_ROWS, rows rounded up to 8) additive mask every pass shares, sized to
      the reserved slab on the first pass (it grows, doubling, only once the cache outgrows its plan);
    - inputs: ids, positions, written rows and iota (4 x P int64) of every pass width P the step keeps:
      the padded buckets where passes are captured (`graphs`), else each exact width 1 .. DRAFT_STEP_ROWS
      that runs (counted all: the CPU, a self-draft on CUDA);
    - graph_pools (`graphs`: a resident separate draft on CUDA): one private CUDA-graph pool per bucket,
      what one captured pass of P rows over the whole slab allocates: pass_bytes for P rows over `rows`
      keys with its (P, V) logits (which the replays write), less the mask, a view of the store
      (the logits alone: sum(DRAFT_STEP_BUCKETS) x V x c, 255 x V x c)."""
    from offload.arch.attention import padded

    widths = DRAFT_STEP_BUCKETS if graphs else tuple(range(1, DRAFT_STEP_ROWS + 1))
    pools = sum(pass_bytes(a, p, rows, c, attn, p, device=device) - p * padded(rows) * c for p in widths)
    return {
        "mask_store": DRAFT_STEP_ROWS * padded(rows) * c,
        "inputs": 4 * 8 * sum(widths),
        "graph_pools": pools if graphs else 0,
    }


def forest_row_bytes(a: Arch, ctx: int, c: int) -> int:
    """Device bytes one token of ANOTHER request's tree holds through a forest pass (serve --parallel:
    offload/stream/multi.py keeps every request's hidden state and tree mask from the first layer to
    the last, then its logits row): hidden x c, its mask row (padded(ctx) x c) and vocab x c."""
    from offload.arch.attention import padded

    return (a.hidden + padded(ctx) + a.vocab) * c


SAMPLING_CHUNK = 1 << 22  # rows x vocabulary the sampler processes at once (core/sampling.CHUNK_ELEMENTS)
MAX_DEPTH = 64  # deepest tree (the --max-depth default): noise rows the race needs per pass


def sampling_bytes(vocab: int, rows: int, temperature: float, draft: bool = False) -> int:
    """The sampling workspace of one pass over `rows` logits rows. Target at T = 0: none (argmax of the
    logits). Target at T > 0: the race in chunks of SAMPLING_CHUNK elements (fp32 processed
    probabilities, their quotient by the noise, int64 hash temporaries: 3 x 8 bytes an element) and the
    (depth + 1, V) fp32 noise rows. Draft: fp32 log-softmax of its rows (a float copy, the scaled copy,
    the log-probabilities: 3 x 4 bytes an element)."""
    if draft:
        return rows * vocab * 12
    if temperature <= 1e-5:
        return 0
    return 3 * 8 * min(SAMPLING_CHUNK, rows * vocab) + (min(rows - 1, MAX_DEPTH) + 1) * vocab * 4


def dequant_temp_bytes(a: Arch, kernel: str, bits: int | None, c: int, device: str = "cuda") -> int:
    """Dequantization temporaries of the largest linear (the MLP's I x hidden), alive while it runs:
    nf4-dequant (bitsandbytes): the 16-bit weight, I x hidden x c; hqq-eager (offload.quant.lowbit's
    reference): HQQ's unpack output in c over the padded rows plus the two packed-size mask and shift
    temporaries of one slice; hqq-compiled (offload/quant/fused.py): on CUDA the weight the compiled kernel
    writes for the matmul, I x hidden x c (to be confirmed on a GPU), on CPU none (the compiled graph
    folds the dequantization into the matmul; measured); int4-unpack (AWQ/GPTQ/compressed-tensors): the weight
    in c plus uint8 codes or an act-order gather; gguf: the weight in c plus, eager, three fp32 chunk
    temporaries, compiled, its sub-block scale buffers; mxfp4 (gpt-oss's experts, formats/mxfp4.py): a
    routed expert's larger matrix, gate_up (hidden x 2I), dequantized and laid out for x @ W, two copies
    in c at the peak (its int32 byte indices, 2 bytes a weight, are gone by then); none: no temporary."""
    if kernel == "mxfp4":
        return 2 * a.intermediate * a.hidden * 2 * c
    return linear_dequant_bytes(a.intermediate * a.hidden, kernel, bits, c, device)


def linear_dequant_bytes(numel: int, kernel: str, bits: int | None, c: int, device: str = "cuda") -> int:
    """dequant_temp_bytes of one linear of `numel` weights."""
    if kernel == "nf4-dequant" or (kernel == "hqq-compiled" and device == "cuda"):
        return numel * c
    if kernel == "int4-unpack":  # formats/packed.py: the weight in c, plus uint8 codes or an act-order gather
        return numel * (c + max(1, c))
    if kernel == "gguf":  # formats/gguf_quants.py, eager: the weight plus 3 fp32 chunk temporaries;
        from offload.formats.gguf_quants import CHUNK_ELEMS, kernel_choice  # compiled: the weight plus

        if kernel_choice(device) == "compiled":  # sub-block scale buffers (measured 0.13-0.16 bytes a weight)
            return numel * c + numel // 4
        return numel * c + 12 * min(numel, CHUNK_ELEMS)
    if kernel != "hqq-eager":
        return 0
    from offload.quant.lowbit import GROUPS, ROWS_PER_WORD

    group, per = GROUPS[bits], ROWS_PER_WORD[bits]
    words = math.ceil(numel // group / per) * group  # packed elements (uint8 / int32 at 3 bits)
    return words * per * c + 2 * words * (4 if bits == 3 else 1)


PREFILL_SHARE = 5  # a prefill pass may take up to 1/5 of the device (CPU: of the RAM) for activations


def fused_prefill(req) -> bool:
    """Prefill passes run the model's causal path (engine.run_prompt passes no additive mask): under
    sdpa a chunk over a cache gets transformers' boolean mask, the first chunk none (CPU and CUDA)."""
    return req.attn == "sdpa"


def prefill_chunk(ta: Arch, req, budget: int, capacity: int) -> int:
    """Prompt tokens per target pass: the whole --ctx when its activations fit 1/PREFILL_SHARE of
    `capacity` (or the verify pass's, if larger), else the largest halving of it that does, never
    below pass_tokens(budget). Every prefill pass streams every offloaded layer once, so a prompt
    that fits --ctx costs one weight stream whenever the memory allows."""
    c = compute_bytes(req)
    deq = dequant_temp_bytes(ta, target_kernel(ta, req), 4, c, req.device)
    floor = min(pass_tokens(budget), req.ctx)
    fused = fused_prefill(req)
    allow = max(
        capacity // PREFILL_SHARE, pass_bytes(ta, floor, req.ctx, c, req.attn, 1, deq, fused, device=req.device)
    )
    chunk = req.ctx
    while chunk > floor and pass_bytes(ta, chunk, req.ctx, c, req.attn, 1, deq, fused, device=req.device) > allow:
        chunk = max(floor, chunk // 2)
    return chunk


def substitute_kernel(bits: int, device: str = "cuda") -> str:
    """The dequantizing path a substitute of `bits` runs on `device`: bitsandbytes NF4 at 4 bits; else
    offload.quant.lowbit's choice there ($SPECX_LOWBIT_KERNEL; auto: the compiled function of
    offload/quant/fused.py on CUDA, the eager one on CPU; eager too once compiling failed)."""
    if bits == 4:
        return "nf4-dequant"
    from offload.quant.fused import fused_status, kernel_choice

    return "hqq-eager" if kernel_choice(device) == "eager" or fused_status() else "hqq-compiled"


def target_kernel(ta: Arch, req) -> str:
    """The dequantizing path of the target's linears: bitsandbytes NF4, GGUF's kernel, the packed-int4
    unpack (AWQ/GPTQ/compressed-tensors), gpt-oss's MXFP4 experts, or none for 16/32-bit weights."""
    if req.dtype == "nf4":
        return "nf4-dequant"
    if ta.method == "mxfp4":
        return "mxfp4"
    if not ta.packed:
        return "none"
    return "gguf" if ta.method == "gguf" else "int4-unpack"


def draft_kernel(req) -> str:
    """The dequantizing path of the draft's linears: a self-draft's substitutes (4 bits: bitsandbytes
    NF4; 3 / 2: offload.quant.lowbit's kernel), none for a small 16/32-bit draft."""
    if not getattr(req, "self_draft", False) or req.draft_bits is None:
        return "none"
    return substitute_kernel(req.draft_bits, req.device)


def activation_bytes(
    ta: Arch,
    da: Arch | None,
    req,
    rows: tuple[int, int],
    budget: int,
    chunk: int | None = None,
    draft_prefill: bool = True,
    kernel_served: bool = False,
) -> int:
    """The largest pass of either model: target verify pass, target prefill chunk, draft passes
    (a draft that reads the target's KV never prefills: `draft_prefill` False). A self-draft's pass
    holds its substitutes' dequantization temporaries (and an nf4 target's, for resident layers).
    `kernel_served`: the GGUF CPU kernel multiplies every target layer from its blocks at any batch
    (formats/qlinear.py), so no target linear is dequantized into a temporary."""
    c = compute_bytes(req)
    deq = 0 if kernel_served else dequant_temp_bytes(ta, target_kernel(ta, req), 4, c, req.device)
    chunk = min(pass_tokens(budget), req.ctx) if chunk is None else chunk
    temperature = getattr(req, "temperature", 0.0)
    worst = max(
        pass_bytes(
            ta,
            budget + 1,
            rows[0],
            c,
            req.attn,
            budget + 1,
            deq,
            sampling=sampling_bytes(ta.vocab, budget + 1, temperature),
            device=req.device,
        ),
        pass_bytes(
            ta,
            chunk,
            req.ctx,
            c,
            req.attn,
            1,
            deq,
            fused_prefill(req),
            sampling=sampling_bytes(ta.vocab, 1, temperature),
            device=req.device,
        ),
    )
    if da is not None:
        dc = dtype_bytes(req.draft_dtype)
        ddeq = dequant_temp_bytes(da, draft_kernel(req), req.draft_bits, dc, req.device)
        if getattr(req, "self_draft", False):
            ddeq = max(ddeq, deq)  # the self-draft also runs the target's resident (nf4) layers
        worst = max(
            worst,
            pass_bytes(
                da,
                req.max_beams,
                rows[1],
                dc,
                req.attn,
                req.max_beams,
                ddeq,
                sampling=sampling_bytes(da.vocab, req.max_beams, temperature, draft=True),
                device=req.device,
            ),
            pass_bytes(da, chunk, req.ctx, dc, req.attn, 1, 0, fused_prefill(req), device=req.device)
            if draft_prefill
            else 0,
        )
    return worst
