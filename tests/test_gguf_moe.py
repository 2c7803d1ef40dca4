"""Mixture-of-experts GGUF files (Qwen3-MoE, Qwen2-MoE, Mixtral) converted by llama.cpp, exact against transformers.

For each family a tiny seeded checkpoint (3 layers, 4 experts, top-2 routing, weights x3; Qwen2-MoE with
its shared expert, Qwen3-MoE with normalized top-k weights; every layer sparse, as llama.cpp converts
them) is saved by transformers' `save_pretrained` with a byte-level BPE vocabulary (the kind llama.cpp's
converter writes and transformers rebuilds), and written to GGUF by llama.cpp's own
convert_hf_to_gguf.py (tools/llamacpp.sh; without it these tests skip) as F32 and as Q8_0 (experts
quantized; llama.cpp writes a Mixtral as architecture `llama` with `expert_count`), and a Qwen3-MoE with
256-wide rows as Q4_K_M by llama-quantize (experts in Q4_K and Q6_K).
The oracle is transformers' `generate` on the source model, because transformers' GGUF loader cannot
read these files (it ignores `expert_feed_forward_length` and reads no Mixtral): for F32 the GGUF holds
the source's weights bit for bit (checked tensor by tensor through specx's reader); for Q8_0 and Q4_K_M
the source model's weights are replaced by the file's, dequantized by the `gguf` package's own reference
(`gguf.quants.dequantize`, Q/K rows un-permuted for Mixtral), so both sides compute the same weights.
Checked: greedy `ar` and `specexec` (draft: a low-noise copy of the target, converted to F32 GGUF too:
transformers rebuilds a Qwen vocabulary from GGUF with an extra `<|endoftext|>`) give exactly
those ids, resident (--offload none) and every layer streamed from disk (--offload disk, --max-ram 0),
through the engine and through `specx run`, from disk with the routed experts read on demand
(tests/test_gguf_moe_apart.py: the bytes, whole layers' ids); the memory plan counts every expert's bytes; files as older llama.cpp versions wrote them (Mixtral's experts one tensor
each, no expert FFN sizes in the metadata) read the same; `--draft self` on a streamed MoE target is
one error line (`--draft auto` decodes without a draft); a MoE GGUF of another architecture is one
error line (gpt-oss GGUFs are read: tests/test_gguf_gpt_oss.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from tests import test_moe_families as families
from tests.conftest import CHARS

CACHE = Path(os.environ.get("SPECX_TEST_CACHE", Path.home() / ".cache" / "specx-test")) / "llamacpp"
CONVERT = CACHE / "src" / "convert_hf_to_gguf.py"
QUANTIZE = CACHE / "bin" / "llama-quantize"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
PROMPT = "def add(a, b):\n    return a"
N_NEW = 20
COMMON = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
COMMON.update(max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0, num_experts_per_tok=2)
FAMILIES = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=4, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True, tie_word_embeddings=False),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=40, tie_word_embeddings=True),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, intermediate_size=64, tie_word_embeddings=False)),
}
SEED = {"qwen3_moe": 3, "qwen2_moe": 5, "mixtral": 3}  # seeds whose greedy continuation is varied
KINDS = ("f32", "q8_0")


def byte_level_tokenizer():
    """CHARS as a byte-level BPE (space "Ġ", newline "Ċ"), two merges (ab, ba) in place of the last digits."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    tokens = [CHARS[0]] + ["".join(b2u[b] for b in c.encode()) for c in CHARS[1:-2]] + ["ab", "ba"]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[("a", "b"), ("b", "a")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def make_moe(name: str, path: Path, seed: int, noise_from: Path | None = None, noise: float = 0.0, **sizes) -> Path:
    """test_moe_families.make_moe with this file's configs (`sizes` overriding them) and byte-level vocabulary."""
    cfg_cls, extra = FAMILIES[name]
    cfg = getattr(transformers, cfg_cls)(vocab_size=len(CHARS), **{**COMMON, **extra, **sizes})
    return families.make_moe(name, path, seed, noise_from, noise, config=cfg, tokenizer=byte_level_tokenizer())


def convert(src: Path, out: Path, outtype: str) -> Path:
    """`src` written to GGUF by llama.cpp's converter; "q4_k_m": its F16 file requantized by llama-quantize."""
    if outtype == "q4_k_m":
        f16 = convert(src, out.with_name(out.stem + "-f16.gguf"), "f16")
        res = subprocess.run([str(QUANTIZE), str(f16), str(out), "Q4_K_M"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-2000:]
        return out
    env = dict(os.environ, SPECX_GGUF_PRE="gpt-2")  # the test vocabulary's hash is not in llama.cpp's list
    cmd = [sys.executable, str(CONVERT), str(src), "--outtype", outtype, "--outfile", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    return out


def rewrite(src: Path, out: Path, drop: tuple[str, ...] = (), split_experts: bool = False) -> Path:
    """A copy of GGUF `src` as older llama.cpp versions wrote it: without the metadata keys ending in
    `drop`, and with `split_experts`, each fused `blk.N.ffn_*_exps` tensor as E tensors `blk.N.ffn_*.E`."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name.endswith(drop or ("\0",)):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        parts = [(t.name, t.data)]
        if split_experts and "_exps." in t.name:
            parts = [(t.name.replace("_exps.", f".{e}."), t.data[e]) for e in range(t.data.shape[0])]
        for name, data in parts:
            writer.add_tensor(name, np.array(data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def gguf_weights(model, f: Path) -> dict[str, torch.Tensor]:
    """The HF state dict of `model` (transformers' fused experts) from the file, dequantized by gguf-py."""
    import gguf

    from offload.formats.gguf_meta import value

    reader = gguf.GGUFReader(f)
    arch = value(reader, "general.architecture")
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    data = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    heads = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}
    out = {}
    for hf_name, p in model.state_dict().items():
        base, _, suffix = hf_name.rpartition(".")
        if base.endswith(".experts"):  # gate_up_proj (E, 2I, H) = [gate; up] per expert, down_proj (E, H, I)
            blk = f"blk.{base.split('.')[2]}"
            parts = ("gate", "up") if suffix == "gate_up_proj" else ("down",)
            w = np.concatenate([data[f"{blk}.ffn_{x}_exps.weight"] for x in parts], axis=1)
        elif hf_name == "lm_head.weight" and "output.weight" not in data:
            w = data["token_embd.weight"]  # tied
        else:
            w = data[f"{names.get_name(base)}.{suffix}"]
            proj = base.rpartition(".")[2]
            if arch == "llama" and proj in heads:  # llama.cpp's Q/K row order back to HF's
                n = heads[proj]
                w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        out[hf_name] = torch.from_numpy(np.array(w, dtype=np.float32)).reshape(p.shape)
    return out


def hf_greedy(model) -> list[int]:
    ids = byte_level_tokenizer()(PROMPT)["input_ids"]
    model.generation_config.eos_token_id = None  # the whole N_NEW tokens, as the engine runs with no EOS below
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def build(name: str, root: Path, kinds, **sizes):
    """(name, source dir, draft GGUF, {kind: GGUF file}, {kind: transformers' greedy ids}) of a seeded `name`."""
    pytest.importorskip("gguf")
    if not CONVERT.is_file():
        pytest.skip("llama.cpp's converter not built (tools/llamacpp.sh)")
    src = make_moe(name, root / "target", seed=SEED[name], **sizes)
    draft = make_moe(name, root / "draft", seed=4, noise_from=src, noise=0.05, **sizes)
    files = {k: convert(src, root / f"target-{k}.gguf", k) for k in kinds}
    draft = convert(draft, root / "draft-f32.gguf", "f32")  # a GGUF draft: the same vocabulary as rebuilt from GGUF
    want = {}
    for kind, f in files.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        if kind != "f32":
            model.load_state_dict(gguf_weights(model, f))
        want[kind] = hf_greedy(model)
        assert len(set(want[kind])) >= 8 and 0 not in want[kind], want  # varied, no EOS (the CLI stops there)
    return name, src, draft, files, want


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param), KINDS)


@pytest.fixture(scope="module")
def qwen3_k(tmp_path_factory):
    """A Qwen3-MoE whose rows are 256 wide (K-quant blocks), as Q4_K_M by llama-quantize (Q4_K, Q6_K experts)."""
    if not QUANTIZE.is_file():
        pytest.skip("llama-quantize not built (tools/llamacpp.sh)")
    return build(
        "qwen3_moe", tmp_path_factory.mktemp("qwen3_k"), ("q4_k_m",), hidden_size=256, moe_intermediate_size=256
    )


@pytest.mark.slow
def test_reader_maps_every_expert(family):
    """Each fused `ffn_*_exps` tensor is E per-expert weights at their byte ranges: F32 bit-equal to the source."""
    from safetensors.torch import load_file

    from offload.formats import open_checkpoint

    name, src, _, files, _ = family
    ref = {}
    for f in src.glob("*.safetensors"):
        ref.update(load_file(f))
    ck = open_checkpoint(files["f32"])
    assert ck.hf_config.model_type == name and not any(".experts." in n for n in ck.packed)
    assert set(ck.tensors) == set(ref) - ({"lm_head.weight"} if ck.hf_config.tie_word_embeddings else set())
    for n in ck.tensors:
        assert torch.equal(ck.dense(n, torch.float32), ref[n].float()), n
    q8 = open_checkpoint(files["q8_0"])
    experts = [n for n in q8.tensors if ".experts." in n]
    assert len(experts) == 3 * 4 * 3 and all(q8.tensors[n].qtype == "Q8_0" for n in experts)


@pytest.mark.slow
def test_older_files(family, tmp_path):
    """Files from older llama.cpp versions: Mixtral's experts one tensor each (`blk.N.ffn_gate.E`), Qwen
    MoE files without the expert FFN sizes (read from the tensors' shapes); the same weights and ids."""
    from transformers import DynamicCache

    from offload import OffloadedCausalLM
    from offload.arch.hfcompat import cache_kwargs
    from offload.formats import open_checkpoint

    name, _, _, files, want = family
    old = tmp_path / "old.gguf"
    if name == "mixtral":
        rewrite(files["q8_0"], old, split_experts=True)
    else:
        rewrite(files["q8_0"], old, drop=("expert_feed_forward_length", "expert_shared_feed_forward_length"))
    new, ck = open_checkpoint(files["q8_0"]), open_checkpoint(old)
    assert set(ck.tensors) == set(new.tensors) and ck.hf_config.to_dict() == new.hf_config.to_dict()
    for n in ck.tensors:
        assert torch.equal(ck.dense(n, torch.float32), new.dense(n, torch.float32)), n
    m = OffloadedCausalLM.from_pretrained(old, dtype=torch.float32, offload="disk")
    try:
        cache, x, got = DynamicCache(), torch.tensor([byte_level_tokenizer()(PROMPT)["input_ids"]]), []
        for _ in range(N_NEW):
            x = m(input_ids=x, **cache_kwargs(m, cache), use_cache=True).logits[:, -1:].argmax(-1)
            got.append(int(x))
        assert got == want["q8_0"], name
    finally:
        m.close()


def _decode(m, method: str):
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import DecodeState, GenerationConfig
    from specexec_cli.core.methods import generate

    cfg = GenerationConfig(method=method, shape=TreeShape(8, 5), max_new_tokens=N_NEW)
    ids = m.tokenizer(PROMPT)["input_ids"]
    assert ids == byte_level_tokenizer()(PROMPT)["input_ids"]  # the vocabulary rebuilt from the file's metadata
    events = list(generate(m, DecodeState(), ids, cfg))
    return [t for ev in events for t in ev.tokens], [len(ev.tokens) for ev in events[1:]]


def _check_decoding(built, kind: str, offload: str) -> None:
    from specexec_cli.session.loading import LoadOptions, load_models

    name, _, draft, files, want = built
    ram = 0 if offload == "disk" else None
    m = load_models(
        LoadOptions(str(files[kind]), str(draft), dtype="fp32", device="cpu", offload=offload, ctx=256, max_ram=ram)
    )
    try:
        assert m.target.lean is None  # the one-call C stack computes plain Llama layers: these run as HF's modules
        if offload == "disk":
            assert m.target.plan.tier == "disk" and not m.target.plan.resident and not m.target.plan.ram_layers
            assert m.target.experts is not None  # routed experts read on demand: rows of the fused tensors
        m.eos_ids = frozenset()
        got, _ = _decode(m, "ar")
        assert got == want[kind], (name, kind, offload)
        got, per_pass = _decode(m, "specexec")
        assert got == want[kind], (name, kind, offload, "specexec")
        assert max(per_pass) >= 3, per_pass  # the draft really gets several tokens accepted per pass
    finally:
        getattr(m.target, "close", lambda: None)()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("offload", ["none", "disk"])
def test_ar_and_specexec_equal_transformers(family, kind, offload):
    _check_decoding(family, kind, offload)


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["none", "disk"])
def test_q4_k_m_experts_equal_transformers(qwen3_k, offload):
    """Experts in K-quants (llama-quantize's Q4_K_M: Q4_K, and Q6_K for some down matrices), decoded exactly."""
    from offload.formats import open_checkpoint

    ck = open_checkpoint(qwen3_k[3]["q4_k_m"])
    kinds = {ck.tensors[n].qtype for n in ck.tensors if ".experts." in n}
    assert "Q4_K" in kinds and kinds <= {"Q4_K", "Q5_K", "Q6_K"}, kinds
    _check_decoding(qwen3_k, "q4_k_m", offload)


@pytest.mark.slow
def test_plan_counts_every_expert(family):
    """The memory plan's per-layer bytes hold the layer's stored tensors (every expert) and are the loader's."""
    from offload import OffloadedCausalLM
    from offload.formats import open_checkpoint
    from offload.planning.membytes import arch_of
    from offload.planning.memlayers import layer_sizes
    from offload.planning.memplan import PlanRequest

    for f in family[3].values():
        ck = open_checkpoint(f)
        req = PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=1 << 34)
        lay = layer_sizes(ck, arch_of(ck.config), req)
        for i in range(COMMON["num_hidden_layers"]):
            assert len([n for n in ck.layer_tensors(i) if ".experts." in n]) == 4 * 3
            assert ck.layer_bytes(i) <= lay.packed[i], (f.name, i)  # more where a plain F16 tensor computes in fp32
        m = OffloadedCausalLM.from_pretrained(f, dtype=torch.float32, offload="disk")
        try:
            assert m.plan.layer_bytes == lay.packed and m.experts is not None, f.name
        finally:
            m.close()


@pytest.mark.slow
def test_specx_run_streamed_equals_transformers(family, tmp_path):
    """`specx run` on the Q8_0 file from disk (--max-ram 0), ar and specexec: transformers' ids."""
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    name, _, draft, files, want = family
    prompt = tmp_path / "p.txt"
    prompt.write_text(PROMPT)
    ids = {}
    for method in ("ar", "specexec"):
        stats = tmp_path / f"{method}.json"
        args = ["run", str(prompt), "--target", str(files["q8_0"]), "--draft", str(draft), "--device", "cpu"]
        args += ["--offload", "disk", "--max-ram", "0", "--method", method, "--budget", "8"]
        args += ["--max-new-tokens", str(N_NEW), "--ctx", "256", "--no-chat-template", "--stats-json", str(stats)]
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        ids[method] = json.loads(stats.read_text())["token_ids"]
    assert ids["specexec"] == ids["ar"], name
    assert len(ids["ar"]) >= 8 and ids["ar"] == want["q8_0"][: len(ids["ar"])], (name, ids["ar"], want)


@pytest.mark.slow
def test_self_draft_is_refused_and_auto_runs_without(family, tmp_path):
    """A streamed MoE target has no low-bit substitutes yet: `--draft self` is one line, `--draft auto` plain decoding."""
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    args = ["run", "-p", PROMPT, "--target", str(family[3]["q8_0"]), "--device", "cpu", "--offload", "disk"]
    args += ["--max-ram", "0", "--max-new-tokens", "4", "--no-chat-template", "--no-live"]
    r = CliRunner().invoke(app, [*args, "--draft", "self"])
    assert r.exit_code != 0 and "a mixture-of-experts target has no low-bit substitutes yet" in r.output, r.output
    stats = tmp_path / "auto.json"
    r = CliRunner().invoke(app, [*args, "--draft", "auto", "--stats-json", str(stats)])
    assert r.exit_code == 0, r.output
    assert json.loads(stats.read_text())["token_ids"] == family[4]["q8_0"][:4]


def test_other_moe_architecture_is_refused_in_one_line(tmp_path):
    """A MoE GGUF of an architecture specx does not map (here DeepSeek-V2): one line naming the ones it reads."""
    gguf = pytest.importorskip("gguf")
    from offload import OffloadError
    from offload.formats import open_checkpoint

    out = tmp_path / "deepseek.gguf"
    writer = gguf.GGUFWriter(out, "deepseek2")
    writer.add_block_count(1)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        OffloadError,
        match=r"deepseek\.gguf: a mixture-of-experts GGUF \(4 experts\) is not supported yet; .*not 'deepseek2'\)$",
    ):
        open_checkpoint(out)
