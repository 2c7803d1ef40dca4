"""GGUF files for the tests, written with the `gguf` package's own GGUFWriter (no llama.cpp needed).

`write_gguf(hf_dir, out, qtype)` converts a tiny HF Llama directory the way llama.cpp's
convert_hf_to_gguf.py does for Llama: llama.cpp tensor names (gguf.TensorNameMap), Q/K rows
permuted per head, norms in F32, the other weights quantized with `gguf.quants.quantize` (Q8_0,
Q4_0, F16, BF16) or, for K-quants (which gguf.quants cannot quantize), random blocks with finite
scales; metadata keys as llama.cpp writes them, a GPT-2 style tokenizer table, an optional chat
template and sampling defaults. `arch="gemma3"` converts a Gemma-3 directory as llama.cpp does for
Gemma-3: no Q/K permutation, RMSNorm weights stored as 1 + w, the head size and sliding window
keys, the global RoPE base, and a sentencepiece ("llama") vocabulary. `split` > 1 writes `-0000k-of-0000n.gguf` parts. `header_only`
writes the header with the real byte ranges and leaves the data as a hole (a sparse file).
`LLAMA_70B` are Llama-3.1-70B's shapes for the sparse real-sized file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LLAMA_70B = dict(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256, ctx=131072)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quant(w: np.ndarray, qtype, rng) -> np.ndarray:
    import gguf
    from gguf import GGMLQuantizationType as T

    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        per, size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // per, size), dtype=np.uint8)
        at = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[qtype]
        scale = float(np.std(w)) / 150  # dequantized weights about as large as w's (6-bit sub-scales ~32, codes ~8)
        for off in at:
            d = (rng.random(blocks.shape[:2]) * scale).astype(np.float16)
            blocks[..., off : off + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
        return blocks.reshape(w.shape[0], -1)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


SPM_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "a", "b", "\u2581a", "\u2581b", "ab", "\u2581ab"]


def _spm_tokenizer(writer, vocab: int) -> None:
    """A Gemma-style sentencepiece table: pad 0, eos 1, bos 2 (added), unk 3."""
    tokens = SPM_TOKENS + [f"x{i}" for i in range(len(SPM_TOKENS), vocab)]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(vocab)])
    writer.add_token_types([3, 3, 3, 2] + [1] * (vocab - 4))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)


def _gemma3_keys(writer, cfg: dict) -> None:
    import gguf

    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_sliding_window(cfg["sliding_window"])
    full = (cfg.get("rope_parameters") or {}).get("full_attention") or {}
    if full.get("rope_type") == "linear":  # Gemma-3 4B+: the global layers' linear RoPE scaling
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))


def _tokenizer(writer, vocab: int, chat_template: str | None) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    tokens = ["<eos>", "a", "b", "ab"] + [f"x{i}" for i in range(4, vocab)]
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (vocab - 1))
    # the one merge listed twice: transformers < 5.2x unwraps a one-element metadata array into a scalar
    # string and then splits it per character (its GGUF tokenizer then fails); a repeated merge changes nothing
    writer.add_token_merges(["a b", "a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def write_gguf(
    hf_dir: Path,
    out: Path,
    qtype: str = "Q8_0",
    split: int = 1,
    chat_template: str | None = None,
    tokenizer: bool = True,
    arch: str = "llama",
    sampling: dict | None = None,
    seed: int = 0,
    extra: dict | None = None,
    mix: dict | None = None,
) -> Path:
    """A GGUF of the Llama at `hf_dir` (see the module docstring); returns the (first) file. `mix`:
    {part of an HF weight name: qtype} for the weights of another type (a Q4_K_M file's v_proj and
    down_proj are Q6_K)."""
    import gguf
    import torch
    from gguf import GGMLQuantizationType as T

    cfg = json.loads((hf_dir / "config.json").read_text())
    from safetensors.torch import load_file

    sd = {k: v.to(torch.float32).numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    n = cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(out, arch, split_max_tensors=(-(-len(sd) // split) if split > 1 else 0))
    writer.add_name("specx-test")
    writer.add_block_count(n)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma-3: the global layers' base is the file's
    writer.add_rope_freq_base(float(cfg.get("rope_theta", rope.get("rope_theta", 1e4))))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    gemma = arch == "gemma3"
    if gemma:
        _gemma3_keys(writer, cfg)
    writer.add_vocab_size(cfg["vocab_size"])
    for key, val in (sampling or {}).items():
        writer.add_float32(f"general.sampling.{key}", val) if isinstance(val, float) else writer.add_int32(
            f"general.sampling.{key}", val
        )
    if tokenizer and gemma:
        _spm_tokenizer(writer, cfg["vocab_size"])
    elif tokenizer:
        _tokenizer(writer, cfg["vocab_size"], chat_template)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3 if gemma else gguf.MODEL_ARCH.LLAMA, n)
    rng = np.random.default_rng(seed)
    for hf_name, w in sd.items():
        base, _, suffix = hf_name.rpartition(".")
        g = f"{name_map.get_name(base)}.{suffix}"
        if gemma and hf_name.endswith("norm.weight"):
            w = w + 1  # llama.cpp's Gemma converter: HF's (1 + w) stored whole
        elif gemma:
            pass
        elif hf_name.endswith("q_proj.weight"):
            w = permute(w, heads)
        elif hf_name.endswith("k_proj.weight"):
            w = permute(w, kv)
        if w.ndim == 1:
            writer.add_tensor(g, w.astype(np.float32))
            continue
        q = getattr(T, next((t for part, t in (mix or {}).items() if part in hf_name), qtype))
        data = _quant(w, q, rng)
        writer.add_tensor(g, data, raw_shape=data.shape, raw_dtype=q if data.dtype == np.uint8 else None)
    for g, w in (extra or {}).items():  # e.g. rope_freqs.weight
        writer.add_tensor(g, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split > 1:
        return out.with_name(f"{out.stem}-00001-of-{split:05d}.gguf")
    return out


def write_sparse_llama(out: Path, dims: dict = LLAMA_70B, tokens: int | None = None) -> Path:
    """A real-sized Llama GGUF header (Q4_K_M's mix: Q4_K, with Q6_K for half the V/down weights
    and the output, as llama-quantize chooses) whose tensor data is a hole (sparse file).
    `tokens`: length of the vocabulary table written (default: the full vocabulary; the weights and
    llama.vocab_size keep the real size either way, the plan never reads the table)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    d, f, L = dims["hidden"], dims["ffn"], dims["layers"]
    hd = d // dims["heads"]
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name("Llama-3.1-70B-Instruct")
    writer.add_block_count(L)
    writer.add_context_length(dims["ctx"])
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(f)
    writer.add_head_count(dims["heads"])
    writer.add_head_count_kv(dims["kv_heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hd)
    writer.add_vocab_size(dims["vocab"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    _tokenizer(writer, tokens or dims["vocab"], "{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def add(name, shape, qtype):
        nbytes = gguf.quant_shape_to_byte_shape(shape, qtype)
        writer.add_tensor_info(name, nbytes, np.dtype(np.uint8), int(np.prod(nbytes)), raw_dtype=qtype)

    add("token_embd.weight", (dims["vocab"], d), T.Q4_K)
    for i in range(L):
        six = i % 2 == 0  # Q4_K_M gives half the layers' attn_v / ffn_down Q6_K
        for name, shape, qt in (
            ("attn_q", (d, d), T.Q4_K),
            ("attn_k", (dims["kv_heads"] * hd, d), T.Q4_K),
            ("attn_v", (dims["kv_heads"] * hd, d), T.Q6_K if six else T.Q4_K),
            ("attn_output", (d, d), T.Q4_K),
            ("ffn_gate", (f, d), T.Q4_K),
            ("ffn_up", (f, d), T.Q4_K),
            ("ffn_down", (d, f), T.Q6_K if six else T.Q4_K),
        ):
            add(f"blk.{i}.{name}.weight", shape, qt)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor_info(f"blk.{i}.{name}.weight", (d,), np.dtype(np.float32), d * 4)
    writer.add_tensor_info("output_norm.weight", (d,), np.dtype(np.float32), d * 4)
    add("output.weight", (dims["vocab"], d), T.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    end = fout.tell()
    end += (-end) % writer.data_alignment
    total = 0
    for ti in writer.tensors[0].values():
        total += ti.nbytes + (-ti.nbytes) % writer.data_alignment
    writer.close()
    with open(out, "r+b") as fh:
        fh.truncate(end + total)  # the data region: a hole, no bytes written
    return out
