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
    """(target, draft) cache rows: ctx + root + `budget` verified nodes; the draft's also keeps the nodes that
    dropped out of the top-`budget` after running: twice the budget plus one batch of beams."""
    return ctx + budget + 1, ctx + 2 * budget + max_beams + 1


def pass_tokens(budget: int) -> int:
    """Largest target pass: a verify pass (budget + 1) or a prefill chunk, whichever is bigger."""
    return max(budget + 1, PREFILL_CHUNK)


def nf4_state_bytes(numel: int) -> int:
    """QuantState of one NF4 weight (blocksize 64, double-quantized): uint8 absmax per block + fp32 nested
    absmax per 256 blocks + 256-entry fp32 nested code + 16-entry fp32 NF4 code + fp32 offset."""
    blocks = math.ceil(numel / NF4_BLOCK)
    return blocks + 4 * math.ceil(blocks / NF4_NESTED_BLOCK) + 256 * 4 + 16 * 4 + 4


def torch_dtype(name: str) -> torch.dtype:
    half = torch.float16 if "16" in name and "b" not in name else torch.bfloat16
    return {2: half, 4: torch.float32}[dtype_bytes(name)]


def draft_bytes(ck, dtype: str) -> int:
    """Draft parameters of Checkpoint `ck` in `dtype` (a tied lm_head shares the embedding) + rotary buffers."""
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
    """Transient device bytes of one pass of T new tokens over S key positions (one layer alive): hidden
    states (4 x T x hidden), q/k/v before and after RoPE (2 x T x (H + 2 KV) x hd), MLP gate/up/act/product
    (4 x T x I), the mask (a tree pass's additive T x S8 x c, S rounded to 8; a causal prefill chunk,
    `fused`: transformers' boolean T x S), attention's temporaries, `deq` bytes of dequantization
    temporaries, the logits (rows x V x c) and `sampling` bytes. Attention under "sdpa" (arch/attention.py's
    specx_gqa) never repeats K/V nor builds scores: attention.mask_bytes; under eager K/V are repeated
    (2 x H x S x hd) and the scores built (H x T x S: scores and softmax in c plus an fp32 softmax)."""
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
    """Long-lived device bytes of the static draft step (core/draftstep.py) over a draft cache of `rows`
    reserved rows, draft dtype `c` bytes:
    - mask_store: the (DRAFT_STEP_ROWS, rows rounded up to 8) additive mask every pass shares;
    - inputs: ids, positions, written rows and iota (4 x P int64) of every pass width P the step keeps:
      the padded buckets where passes are captured (`graphs`), else every width 1 .. DRAFT_STEP_ROWS;
    - graph_pools (`graphs`: a resident separate draft on CUDA): one CUDA-graph pool per bucket, pass_bytes
      of P rows over `rows` keys with its (P, V) logits, less the mask (a view of the store)."""
    from offload.arch.attention import padded

    widths = DRAFT_STEP_BUCKETS if graphs else tuple(range(1, DRAFT_STEP_ROWS + 1))
    pools = sum(pass_bytes(a, p, rows, c, attn, p, device=device) - p * padded(rows) * c for p in widths)
    return {
        "mask_store": DRAFT_STEP_ROWS * padded(rows) * c,
        "inputs": 4 * 8 * sum(widths),
        "graph_pools": pools if graphs else 0,
    }


def forest_row_bytes(a: Arch, ctx: int, c: int) -> int:
    """Device bytes one token of ANOTHER request's tree holds through a forest pass (serve --parallel,
    stream/multi.py): its hidden state, mask row (padded(ctx)) and logits row, in c bytes each."""
    from offload.arch.attention import padded

    return (a.hidden + padded(ctx) + a.vocab) * c


SAMPLING_CHUNK = 1 << 22  # rows x vocabulary the sampler processes at once (core/sampling.CHUNK_ELEMENTS)
MAX_DEPTH = 64  # deepest tree (the --max-depth default): noise rows the race needs per pass


def sampling_bytes(vocab: int, rows: int, temperature: float, draft: bool = False) -> int:
    """The sampling workspace of one pass over `rows` logits rows. Target at T = 0: none (argmax). At T > 0:
    the race in chunks of SAMPLING_CHUNK elements (3 x 8 bytes an element) and the (depth + 1, V) fp32 noise
    rows. Draft: fp32 log-softmax of its rows (a float copy, the scaled copy, the log-probabilities: 12 bytes)."""
    if draft:
        return rows * vocab * 12
    if temperature <= 1e-5:
        return 0
    return 3 * 8 * min(SAMPLING_CHUNK, rows * vocab) + (min(rows - 1, MAX_DEPTH) + 1) * vocab * 4


def dequant_temp_bytes(a: Arch, kernel: str, bits: int | None, c: int, device: str = "cuda") -> int:
    """Dequantization temporaries of the largest linear (the MLP's I x hidden), alive while it runs
    (linear_dequant_bytes); mxfp4 (gpt-oss's experts): a routed expert's gate_up (hidden x 2I) laid out for
    x @ W, two copies in c at the peak."""
    if kernel == "mxfp4":
        return 2 * a.intermediate * a.hidden * 2 * c
    return linear_dequant_bytes(a.intermediate * a.hidden, kernel, bits, c, device)


def linear_dequant_bytes(numel: int, kernel: str, bits: int | None, c: int, device: str = "cuda") -> int:
    """Dequantization temporaries of one linear of `numel` weights (hqq-compiled on CPU: none, the compiled
    graph folds the dequantization into the matmul; measured)."""
    if kernel == "nf4-dequant" or (kernel == "hqq-compiled" and device == "cuda"):  # the weight in c
        return numel * c
    if kernel == "int4-unpack":  # formats/packed.py: the weight in c, plus uint8 codes or an act-order gather
        return numel * (c + max(1, c))
    if kernel == "gguf":  # formats/gguf_quants.py: the weight plus 3 fp32 chunk temporaries (eager) or
        from offload.formats.gguf_quants import CHUNK_ELEMS, kernel_choice

        if kernel_choice(device) == "compiled":  # sub-block scale buffers (measured 0.13-0.16 bytes a weight)
            return numel * c + numel // 4
        return numel * c + 12 * min(numel, CHUNK_ELEMS)
    if kernel != "hqq-eager":
        return 0
    from offload.quant.lowbit import GROUPS, ROWS_PER_WORD  # HQQ's unpack output, two packed-size temporaries

    group, per = GROUPS[bits], ROWS_PER_WORD[bits]
    words = math.ceil(numel // group / per) * group  # packed elements (uint8 / int32 at 3 bits)
    return words * per * c + 2 * words * (4 if bits == 3 else 1)


PREFILL_SHARE = 5  # a prefill pass may take up to 1/5 of the device (CPU: of the RAM) for activations


def prefill_bytes(a: Arch, req, n: int, c: int, deq: int, sampling: int = 0) -> int:
    """pass_bytes of a prefill pass of n prompt tokens over --ctx keys, one logits row: the model's causal path
    (no additive mask; under sdpa transformers' boolean mask)."""
    return pass_bytes(a, n, req.ctx, c, req.attn, 1, deq, req.attn == "sdpa", sampling, req.device)


def prefill_chunk(ta: Arch, req, budget: int, capacity: int) -> int:
    """Prompt tokens per target pass: the whole --ctx when its activations fit 1/PREFILL_SHARE of `capacity`
    (or the verify pass's, if larger), else the largest halving that does, never below pass_tokens(budget):
    every prefill pass streams every offloaded layer once."""
    c = compute_bytes(req)
    deq = dequant_temp_bytes(ta, target_kernel(ta, req), 4, c, req.device)
    floor = min(pass_tokens(budget), req.ctx)
    allow = max(capacity // PREFILL_SHARE, prefill_bytes(ta, req, floor, c, deq))
    chunk = req.ctx
    while chunk > floor and prefill_bytes(ta, req, chunk, c, deq) > allow:
        chunk = max(floor, chunk // 2)
    return chunk


def substitute_kernel(bits: int, device: str = "cuda") -> str:
    """The dequantizing path a substitute of `bits` runs on `device`: bitsandbytes NF4 at 4 bits; else
    quant/lowbit's choice ($SPECX_LOWBIT_KERNEL; auto: compiled on CUDA, eager on CPU or once compiling failed)."""
    if bits == 4:
        return "nf4-dequant"
    from offload.quant.fused import fused_status, kernel_choice

    return "hqq-eager" if kernel_choice(device) == "eager" or fused_status() else "hqq-compiled"


def target_kernel(ta: Arch, req) -> str:
    """The dequantizing path of the target's linears (none for 16/32-bit weights)."""
    if req.dtype == "nf4":
        return "nf4-dequant"
    if ta.method == "mxfp4":
        return "mxfp4"
    if not ta.packed:
        return "none"
    return "gguf" if ta.method == "gguf" else "int4-unpack"


def activation_bytes(
    ta: Arch,
    da: Arch | None,
    req,
    rows: tuple[int, int],
    budget: int,
    chunk: int | None = None,
    kernel_served: bool = False,
) -> int:
    """The largest pass of either model: target verify pass, target prefill chunk, draft passes (a self-draft
    grows its tree in the target's cache rows and never prefills). `kernel_served`: the GGUF CPU kernel
    multiplies every target layer from its blocks, so no target linear is dequantized into a temporary."""
    c, dev, v = compute_bytes(req), req.device, budget + 1
    deq = 0 if kernel_served else dequant_temp_bytes(ta, target_kernel(ta, req), 4, c, dev)
    chunk = min(pass_tokens(budget), req.ctx) if chunk is None else chunk
    temperature = getattr(req, "temperature", 0.0)
    verify_sampling = sampling_bytes(ta.vocab, v, temperature)
    verify = pass_bytes(ta, v, rows[0], c, req.attn, v, deq, sampling=verify_sampling, device=dev)
    worst = max(verify, prefill_bytes(ta, req, chunk, c, deq, sampling_bytes(ta.vocab, 1, temperature)))
    if da is None:
        return worst
    dc, beams = dtype_bytes(req.draft_dtype), req.max_beams
    own = getattr(req, "self_draft", False)
    kernel = substitute_kernel(req.draft_bits, dev) if own and req.draft_bits is not None else "none"
    ddeq = dequant_temp_bytes(da, kernel, req.draft_bits, dc, dev)
    if own:
        ddeq = max(ddeq, deq)  # the self-draft also runs the target's resident (nf4) layers
    draft_sampling = sampling_bytes(da.vocab, beams, temperature, draft=True)
    drows = rows[0] if own else rows[1]
    grow = pass_bytes(da, beams, drows, dc, req.attn, beams, ddeq, sampling=draft_sampling, device=dev)
    return max(worst, grow, 0 if own else prefill_bytes(da, req, chunk, dc, 0))
