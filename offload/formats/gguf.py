"""GGUF checkpoints (llama.cpp, ollama, LM Studio): streamed as stored, dequantized on the device.

Contract: `READER` claims a .gguf file, a split model's part, a directory holding one GGUF model and
no safetensors, or an ollama blob (GGUF magic, no extension); `open_ollama(name)` opens an ollama
model by name. `open` reads headers and metadata only (gguf_meta.py checks them) into a Checkpoint:
- config: transformers' config built by its own GGUF key table, for the families in GGUF_ARCHS
  (another `general.architecture` is one OffloadError line), plus what that table leaves out:
  Gemma-3's linear RoPE scaling, llama3 RoPE from `rope_freqs`, MoE types and sizes (gguf_moe.py);
- tensors keyed by HF name at their byte ranges (a MoE layer's fused experts: E per-expert tensors,
  gguf_moe.slices). A plain F32/F16/BF16 tensor keeps its dtype; every other one (block-quantized,
  or a Llama Q/K weight whose rows llama.cpp permuted) is `qtype` bytes ((nbytes,) uint8) listed in
  `packed`, which `load_weight` dequantizes on the device (gguf_quants, the permutation undone while
  writing rows);
- strict checks: every HF parameter present (a tied lm_head may be absent) with its shape, no
  unexpected tensor, a tokenizer in the metadata;
- tokenizer built from the metadata (tokcache.py); chat template, BOS/EOS (EOT too) and sampling
  defaults (general.sampling.*, or ollama's params) in `chat_template` / `generation`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from offload.errors import OffloadError
from offload.formats import gguf_gptoss, gguf_meta, gguf_moe, gguf_quants as gq
from offload.formats.base import Checkpoint, TensorInfo, as_stored

GGUF_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma3", "qwen2moe", "qwen3moe", "gpt-oss")   # GGUF architectures of families.SUPPORTED (not yet gemma2)
HF_TYPE = {"gemma3": "gemma3_text"}   # a Gemma-3 GGUF holds the text model only (as transformers reads it)
PERMUTED = {"self_attn.q_proj.weight": "num_attention_heads", "self_attn.k_proj.weight": "num_key_value_heads"}
IGNORED = ("rope_freqs.weight",)   # llama.cpp's llama3 RoPE factors: read into the config (_rope_from_freqs)


class GgufReader:
    name = "gguf"

    def detect(self, path: Path) -> bool:
        try:
            if path.is_dir():
                return any(path.glob("*.gguf")) and not any(path.glob("*.safetensors"))
            return gguf_meta.is_gguf_file(path)
        except OSError:
            return False

    def open(self, path: Path, ollama_params: dict | None = None) -> Checkpoint:
        try:
            import gguf  # noqa: F401 - the header parser and name map
        except ImportError:
            raise OffloadError(f"{path}: reading GGUF files needs the gguf package; fix: pip install "
                               "'gguf>=0.17,<0.20' (specx's gguf extra)") from None
        parts = gguf_meta.gguf_parts(path)
        readers = [gguf_meta.read_part(p) for p in parts]
        first, head = parts[0], readers[0]
        arch = gguf_meta.value(head, "general.architecture")
        experts = gguf_meta.value(head, f"{arch}.expert_count")
        if experts:   # llama.cpp: a Mixtral as `llama`, experts fused (blk.N.ffn_*_exps)
            gguf_moe.model_type(first, arch, experts)
        if arch not in GGUF_ARCHS:
            raise OffloadError(f"{first}: GGUF architecture {str(arch)[:40]!r} is not supported; supported: "
                               f"{', '.join(GGUF_ARCHS)}")
        count = gguf_meta.value(head, "split.count")
        if count is not None and int(count) != len(parts):
            raise OffloadError(f"{first}: its metadata says {count} parts but {len(parts)} were found; download "
                               "every part into the same folder with its original name")
        if gguf_meta.value(head, "tokenizer.ggml.model") is None or "tokenizer.ggml.tokens" not in head.fields:
            raise OffloadError(f"{first}: no tokenizer in its metadata (tokenizer.ggml.*); re-convert it with "
                               "llama.cpp's convert_hf_to_gguf.py from a model directory that has one")
        config = _hf_config(head, arch, readers, first)
        _rope_from_freqs(config, parts, readers)
        gptoss = arch == gguf_gptoss.ARCH   # its own names and config (gguf_gptoss.py)
        hf_names, shapes = gguf_gptoss.hf_params(config) if gptoss else _hf_params(config, arch, first)
        fused = gguf_moe.expert_names(config, shapes) if experts else {}
        hf_names.update(gguf_moe.legacy_names(fused))   # older Mixtral files: one tensor per expert
        tensors = {}
        for part, reader in zip(parts, readers):
            for t in reader.tensors:
                if t.name in IGNORED:
                    continue
                if t.name in fused:
                    for name, e in zip(fused[t.name], gguf_moe.slices(part, t, len(fused[t.name]))):
                        _add(tensors, name, part, e, config, arch, shapes)
                    continue
                name = hf_names.get(t.name)
                if name is None:
                    raise OffloadError(f"{part}: unexpected tensor {t.name!r} (not used by {arch}); the file does "
                                       "not match its metadata - re-download it")
                _add(tensors, name, part, t, config, arch, shapes)
        packed = {name: (name,) for name, info in tensors.items() if info.qtype is not None}
        cfg = dict(config.to_dict(), quantization_config={"quant_method": "gguf"})   # the plan's packed-format marker
        ckpt = Checkpoint(path=path, format="gguf", config=cfg, hf_config=config, tensors=tensors,
                          files=list(parts), reader=self, quant=_quant(head, tensors), packed=packed,
                          tokenizer_path=first.parent, tokenizer_kwargs={"gguf_file": first.name},
                          chat_template=gguf_meta.value(head, "tokenizer.chat_template"),
                          generation=_generation(head, ollama_params or {}), source_name=first)
        ckpt.shapes = _check_tensors(ckpt, shapes, first)
        return ckpt

    def load_weight(self, ckpt: Checkpoint, hf_weight_name: str, raw, device, dtype) -> torch.Tensor:
        info = ckpt.tensors[hf_weight_name]
        t = as_stored(info, raw[hf_weight_name]).to(device)
        if info.qtype is None:
            return t.to(dtype)
        shape = ckpt.shapes[hf_weight_name]
        heads = info.meta.get("permute")
        rows_to = _rows_to(shape[0], heads, t.device) if heads else None
        return gq.dequantize(t, info.meta["ggml_type"], shape, dtype, rows_to=rows_to)

    def open_ollama(self, name: str) -> Checkpoint | None:
        """The checkpoint of ollama model `name`, or None when ollama has no such model."""
        from offload.formats import ollama

        model = ollama.resolve(name)
        if model is None:
            return None
        return self.open(model.blob, ollama_params=model.params)


def _add(tensors: dict, name: str, part: Path, t, config, arch: str, shapes: dict) -> None:
    if name in tensors:
        raise OffloadError(f"{part}: tensor {t.name!r} appears twice; the file is corrupt - re-download it")
    tensors[name] = gguf_moe.fit_shape(_info(name, part, t, config, arch), shapes.get(name))


def _config_dict(head, arch: str) -> dict:
    """config.json-style dict from the metadata, by transformers' own GGUF table (the one
    `from_pretrained(gguf_file=)` uses), reading scalar keys only (never the vocabulary arrays)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    model_type = "mistral" if arch == "llama" and gguf_meta.value(head, "general.name") == "mistral" else arch
    moe = bool(gguf_meta.value(head, f"{arch}.expert_count"))
    model_type = gguf_moe.MODEL_TYPE[arch] if moe else model_type
    cfg = {"model_type": model_type}
    for key in head.fields:
        prefix, _, rest = key.partition(".")
        table = GGUF_CONFIG_MAPPING.get(gguf_moe.TABLE.get(model_type, model_type) if prefix == arch else prefix, {})
        if prefix in ("general", arch, "tokenizer") and table.get(rest) not in (None, -1) and rest != "architecture":
            cfg[table[rest]] = gguf_meta.value(head, key)
    for key, val in GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {}).items():
        cfg.setdefault(key, val)
    cfg["model_type"] = HF_TYPE.get(model_type, model_type)
    if arch == "gemma3":
        _gemma3_rope_scaling(head, cfg)
    if moe:
        gguf_moe.config_keys(head, arch, model_type, cfg)
    return cfg


def _gemma3_rope_scaling(head, cfg: dict) -> None:
    """Gemma-3 4B/12B/27B scale their global layers' RoPE linearly (factor 8; the local layers are
    unscaled), which llama.cpp writes as rope.scaling.* and transformers' key table leaves out: read
    it as HF's own config states it (`rope_scaling` on the full-attention layers)."""
    kind = gguf_meta.value(head, "gemma3.rope.scaling.type")
    factor = gguf_meta.value(head, "gemma3.rope.scaling.factor")
    if kind in (None, "none") or factor in (None, 1.0):
        return
    if kind != "linear":
        raise OffloadError(f"Gemma-3 GGUF with rope.scaling.type {str(kind)[:20]!r}: specx reads linear scaling only")
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}


def _hf_config(head, arch: str, readers, first: Path):
    """transformers' config object for the file (as `AutoConfig.from_pretrained(dir, gguf_file=)`)."""
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    from offload.arch.families import Family

    hf_logging.set_verbosity_error()
    try:
        cfg = gguf_gptoss.config_dict(head) if arch == gguf_gptoss.ARCH else _config_dict(head, arch)
        cfg["tie_word_embeddings"] = all(t.name != "output.weight" for r in readers for t in r.tensors)
        cfg.setdefault("vocab_size", len(head.fields["tokenizer.ggml.tokens"].data))
        config = CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
    except OffloadError:   # gguf_gptoss's own line (a missing key)
        raise
    except Exception as exc:  # noqa: BLE001 - any failure is metadata transformers cannot use
        msg = (str(exc).splitlines() or [""])[0][:120]
        raise OffloadError(f"{first}: its metadata does not describe a model transformers can build "
                           f"({exc.__class__.__name__}: {msg}); re-download or re-convert it") from None
    config._attn_implementation = Family.of(config).attn_implementation
    if arch == "gemma3":   # its norms stream as stored (1 + w): the family's PlusOneNorm reads them so
        from offload.arch.gemma3 import PLUS_ONE

        setattr(config, PLUS_ONE, True)
    return config


LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, old: int) -> list[float]:
    """llama.cpp's rope_freqs for HF's llama3 RoPE scaling (convert_hf_to_gguf.py): the divisor of
    each of the dim/2 inverse frequencies (1 for short wavelengths, `factor` for long, smooth between)."""
    import math

    out = []
    for k in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (k / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _rope_from_freqs(config, parts: list[Path], readers) -> None:
    """Llama-3.1-style files carry llama3 RoPE scaling only as the `rope_freqs` tensor (dim/2 floats,
    one small read): recognise it as HF's llama3 rope_parameters (Llama 3.1/3.3 values, `factor` =
    its largest entry) so the model rotates as the original does; anything else is refused."""
    import numpy as np

    for part, reader in zip(parts, readers):
        for t in reader.tensors:
            if t.name != "rope_freqs.weight":
                continue
            theta = float(config.rope_parameters.get("rope_theta", 10000.0))
            dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
            got = np.asarray(t.data, dtype=np.float32).reshape(-1) if int(t.tensor_type) == gq.F32 else None
            want = (llama3_factors(theta, dim, float(got.max()), *LLAMA3_ROPE.values())
                    if got is not None and got.size == dim // 2 else None)
            if want is None or not np.allclose(got, want, rtol=1e-5, atol=1e-6):
                raise OffloadError(f"{part}: its rope_freqs tensor is not Llama-3's RoPE scaling; specx cannot "
                                   "rotate positions as this file expects")
            config.rope_parameters = {"rope_type": "llama3", "factor": float(got.max()), **LLAMA3_ROPE,
                                      "rope_theta": theta}


def _hf_params(config, arch: str, first: Path) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """(GGUF tensor name -> HF parameter name, HF parameter name -> shape) from the meta-built model."""
    import gguf

    from offload.arch.families import meta_model

    n = config.num_hidden_layers
    if not isinstance(n, int) or not 0 < n <= 1024:
        raise OffloadError(f"{first}: block_count {str(n)[:20]} is not a layer count; the file is corrupt")
    hf = meta_model(config, first, "the file is corrupt - re-download it")
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, n)
    names, shapes = {}, {}
    for hf_name, p in hf.named_parameters(remove_duplicate=False):
        shapes[hf_name] = tuple(p.shape)
        base, _, suffix = hf_name.rpartition(".")
        g = name_map.get_name(base)
        if g is not None:
            names[f"{g}.{suffix}"] = hf_name
    return names, shapes


def _info(name: str, part: Path, t, config, arch: str) -> TensorInfo:
    """TensorInfo of one GGUF tensor (see the module contract for plain vs qtype)."""
    tid = int(t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))    # ggml (ne0, ne1) -> torch (rows, cols)
    begin = int(t.data_offset)
    nbytes = gq.nbytes(tid, shape)
    meta = {"ggml_type": tid, "shape": shape, "gguf_name": t.name}
    rel = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    if arch == "llama" and rel.replace(".bias", ".weight") in PERMUTED and rel.endswith(".bias"):
        raise OffloadError(f"{part}: Llama Q/K biases ({t.name!r}) are not supported in GGUF files yet")
    if arch == "llama" and rel in PERMUTED:
        meta["permute"] = int(getattr(config, PERMUTED[rel]))
    if tid in gq.PLAIN and len(meta) == 3:
        return TensorInfo(name, part, gq.PLAIN[tid], shape, begin, begin + nbytes, None, meta)
    return TensorInfo(name, part, torch.uint8, (nbytes,), begin, begin + nbytes, gq.NAMES[tid], meta)


def _check_tensors(ckpt: Checkpoint, shapes: dict, first: Path) -> dict[str, tuple[int, ...]]:
    """Strict loading: every HF parameter present with its shape (a tied lm_head may be absent)."""
    tied = getattr(ckpt.hf_config, "tie_word_embeddings", False)
    for name, shape in shapes.items():
        info = ckpt.tensors.get(name)
        if info is None:
            if tied and name == "lm_head.weight":
                continue
            missing = sum(1 for n in shapes if n not in ckpt.tensors)
            raise OffloadError(f"{first}: tensor {name!r} that {ckpt.hf_config.model_type!r} needs is missing "
                               f"({missing} missing); the file is incomplete - re-download it")
        if tuple(info.meta["shape"]) != tuple(shape):
            raise OffloadError(f"{info.file}: tensor {info.meta['gguf_name']!r} has shape {list(info.meta['shape'])}, "
                               f"the metadata implies {list(shape)}; the file does not match its metadata")
    return dict(shapes)


def _quant(head, tensors: dict[str, TensorInfo]) -> dict:
    """What the file is quantized to: llama.cpp's file type and bytes per GGML type."""
    import gguf

    by: dict[str, int] = {}
    for t in tensors.values():
        key = gq.NAMES[t.meta["ggml_type"]]
        by[key] = by.get(key, 0) + t.nbytes
    ftype = gguf_meta.value(head, "general.file_type")
    try:
        ftype = gguf.LlamaFileType(ftype).name.removeprefix("MOSTLY_") if ftype is not None else None
    except ValueError:
        ftype = str(ftype)
    return {"quant_method": "gguf", "file_type": ftype, "bytes_by_type": by}


def _generation(head, ollama_params: dict) -> dict:
    """generation_config.json-style defaults from the metadata (ollama's params override sampling)."""
    v = functools.partial(gguf_meta.value, head)
    gen = {}
    bos, eos, eot = v("tokenizer.ggml.bos_token_id"), v("tokenizer.ggml.eos_token_id"), v("tokenizer.ggml.eot_token_id")
    if bos is not None:
        gen["bos_token_id"] = int(bos)
    stops = [int(x) for x in (eos, eot, v("tokenizer.ggml.eom_token_id")) if x is not None]
    given = ollama_params.get("stop")
    texts = [s for s in given if isinstance(s, str) and s] if isinstance(given, list) else []
    special = _control_ids(head, texts)  # a stop string that is one control token ends as EOS does
    stops += special.values()
    if stops:
        stops = list(dict.fromkeys(stops))
        gen["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    pad = v("tokenizer.ggml.padding_token_id")
    if pad is not None:
        gen["pad_token_id"] = int(pad)
    for key, hf in (("temp", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p")):
        val = ollama_params.get(hf)   # ollama's params (named as HF names them) over the file's
        val = val if isinstance(val, (int, float)) else v(f"general.sampling.{key}")
        if val is not None:
            gen[hf] = val
    rest = [t for t in texts if t not in special]  # text stops: the reply ends before the first one shown
    if rest:
        gen["stop_strings"] = rest
    if "temperature" in gen:
        gen["do_sample"] = gen["temperature"] > 0
    return gen


def _control_ids(head, texts: list[str]) -> dict[str, int]:
    """{stop string: token id} for the `texts` that are exactly one control or user-defined token of the
    vocabulary (an ollama params' "<|eot_id|>"): the detokenized text never shows them, their id does."""
    if not texts:
        return {}
    tokens = gguf_meta.value(head, "tokenizer.ggml.tokens") or []
    types = gguf_meta.value(head, "tokenizer.ggml.token_type")  # 3 control, 4 user-defined (llama.cpp's)
    wanted = set(texts)
    return {t: i for i, t in enumerate(tokens) if t in wanted and (types is None or types[i] in (3, 4))}


@functools.lru_cache(maxsize=64)
def _rows_cpu(rows: int, heads: int) -> torch.Tensor:
    """HF row of each stored row of a Q/K weight llama.cpp permuted with `heads` heads.

    llama.cpp stores W_g = W_hf.reshape(h, 2, d, C).swapaxes(1, 2): stored row (h, i, j) is HF row
    (h, j, i) for i < d = rows / h / 2, j in {0, 1}."""
    d = rows // heads // 2
    return torch.arange(rows).reshape(heads, 2, d).transpose(1, 2).reshape(rows)


def _rows_to(rows: int, heads: int, device) -> torch.Tensor:
    if rows % (2 * heads):
        raise OffloadError(f"a Q/K weight of {rows} rows does not split into {heads} heads; the file is corrupt")
    return _rows_cpu(rows, heads).to(device)


READER = GgufReader()
