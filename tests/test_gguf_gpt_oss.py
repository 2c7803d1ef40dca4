"""gpt-oss GGUF files converted by llama.cpp, exact against transformers' GptOssForCausalLM.

A tiny seeded gpt-oss (tests/test_gpt_oss.py's: 4 layers alternating sliding (window 6) and full
attention, 4 experts, top-2, YaRN RoPE, sinks and biases given values; here with the SwiGLU clamp at 7,
the value llama.cpp applies to every gpt-oss file, since no metadata key carries it) is saved by
transformers with a byte-level BPE vocabulary and written to GGUF by llama.cpp's convert_hf_to_gguf.py
(tools/llamacpp.sh; without it these tests skip) as F32, and requantized by llama-quantize as MXFP4_MOE
(experts in llama.cpp's MXFP4 blocks, attention and embeddings Q8_0; skipped without llama-quantize),
and the source re-stored with MXFP4 experts as the published checkpoints are (tests/mxfp4_ckpt.py) is
converted too: llama.cpp keeps those experts in MXFP4, repacked into GGML blocks (the published GGUFs' path).
The oracle is transformers' `generate` on the source model (transformers' GGUF loader cannot read
these files): for F32 the file's weights are the source's bit for bit (checked tensor by tensor through
specx's reader, the experts re-fused into transformers' gate_up/down layout); for MXFP4_MOE the source
model's weights are replaced by the file's, dequantized by the `gguf` package's own reference
(`gguf.quants.dequantize`); for the converted MXFP4 checkpoint, transformers' own load of that
checkpoint (`Mxfp4Config(dequantize=True)`), whose experts the file's equal bit for bit. Checked:
greedy `ar` and `specexec` (draft: a low-noise copy of the target, converted to F32 GGUF) give exactly
those ids, resident and every layer streamed from disk (--offload disk --max-ram 0), through the engine
(tests/test_gguf_moe.py's checks) and `specx run`; the memory plan counts each layer's stored experts as
the loader lays them out (from disk its routed experts are read on demand), and the model also runs in bf16.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from tests.mxfp4_ckpt import hf_dequantized, write_mxfp4
from tests.test_gguf_moe import (
    CONVERT,
    N_NEW,
    PROMPT,
    QUANTIZE,
    _check_decoding,
    byte_level_tokenizer,
    convert,
    hf_greedy,
)
from tests.test_gpt_oss import seeded

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
LIMIT = 7.0  # llama.cpp's gpt-oss SwiGLU clamp (offload/formats/gguf_gptoss.LIMIT)


def make(path, seed: int, noise_from=None, noise: float = 0.0):
    """A seeded gpt-oss checkpoint with the byte-level vocabulary (or a noisy copy of another) at `path`."""
    model = seeded(seed, swiglu_limit=LIMIT)
    if noise_from is not None:
        with torch.no_grad():
            model.load_state_dict(transformers.GptOssForCausalLM.from_pretrained(noise_from).state_dict())
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    byte_level_tokenizer().save_pretrained(path)
    return path


def mxfp4_moe(src, out):
    """`src` (a GGUF) requantized by llama-quantize as MXFP4_MOE."""
    import subprocess

    res = subprocess.run([str(QUANTIZE), str(src), str(out), "MXFP4_MOE"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    return out


def gguf_state(model, f) -> dict[str, torch.Tensor]:
    """transformers' state dict of `model` from GGUF `f`, dequantized by gguf-py: the experts re-fused
    (gate_up_proj[e] (H, 2I): column 2i gate row i, 2i + 1 up row i; down_proj[e] = ffn_down_exps[e]^T)."""
    import gguf

    from offload.formats.gguf_gptoss import GLOBAL, LAYER

    data = {
        t.name: np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        for t in gguf.GGUFReader(f).tensors
    }
    back = {v: k for k, v in GLOBAL.items()}
    for i in range(model.config.num_hidden_layers):
        back.update({f"model.layers.{i}.{v}": f"blk.{i}.{k}" for k, v in LAYER.items()})
        blk = f"blk.{i}.ffn_"
        gate, up = data[blk + "gate_exps.weight"], data[blk + "up_exps.weight"]  # (E, I, H)
        data[f"fused{i}.gate_up_proj"] = np.stack((gate, up), axis=2).reshape(gate.shape[0], -1, gate.shape[2])
        data[f"fused{i}.gate_up_proj"] = data[f"fused{i}.gate_up_proj"].swapaxes(1, 2)  # (E, H, 2I)
        data[f"fused{i}.gate_up_proj_bias"] = np.stack(
            (data[blk + "gate_exps.bias"], data[blk + "up_exps.bias"]), axis=2
        ).reshape(gate.shape[0], -1)
        data[f"fused{i}.down_proj"] = data[blk + "down_exps.weight"].swapaxes(1, 2)  # (E, I, H)
        data[f"fused{i}.down_proj_bias"] = data[blk + "down_exps.bias"]
        for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            back[f"model.layers.{i}.mlp.experts.{n}"] = f"fused{i}.{n}"
    return {
        n: torch.from_numpy(np.ascontiguousarray(data[back[n]])).reshape(p.shape) for n, p in model.state_dict().items()
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """("gpt_oss", source dir, draft GGUF, {kind: GGUF file}, {kind: transformers' greedy ids}); kinds: f32, mxfp4
    (llama-quantize MXFP4_MOE of the F32 file), st_mxfp4 (converted from the source's MXFP4 safetensors copy)."""
    pytest.importorskip("gguf")
    if not CONVERT.is_file():
        pytest.skip("llama.cpp's converter not built (tools/llamacpp.sh)")
    root = tmp_path_factory.mktemp("gguf_gpt_oss")
    src = make(root / "target", seed=0)
    files = {"f32": convert(src, root / "target-f32.gguf", "f32")}
    if QUANTIZE.is_file():
        files["mxfp4"] = mxfp4_moe(files["f32"], root / "target-mxfp4.gguf")
    st = write_mxfp4(src, root / "st-mxfp4")  # as published: the experts' MXFP4 blocks and scales in safetensors
    byte_level_tokenizer().save_pretrained(st)  # the vocabulary the converter reads
    files["st_mxfp4"] = convert(st, root / "target-st-mxfp4.gguf", "f32")  # its experts repacked as GGML MXFP4
    draft = convert(make(root / "draft", seed=1, noise_from=src, noise=0.05), root / "draft-f32.gguf", "f32")
    want = {}
    for kind, f in files.items():
        if kind == "st_mxfp4":  # transformers' own load of the MXFP4 checkpoint the file was converted from
            model = hf_dequantized(st, torch.float32).eval()
        else:
            model = transformers.GptOssForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        if kind == "mxfp4":
            model.load_state_dict(gguf_state(model, f))
        want[kind] = hf_greedy(model)
        assert len(set(want[kind])) >= 8 and 0 not in want[kind], want  # varied, no EOS (the CLI stops there)
    return "gpt_oss", src, draft, files, want


def _kind(built, kind: str):
    if kind not in built[3]:
        pytest.skip("llama-quantize not built (tools/llamacpp.sh)")


@pytest.mark.slow
def test_f32_file_is_the_source_bit_for_bit(built):
    """Every tensor of the F32 file is the source's; the experts, re-fused, are transformers' own."""
    from safetensors.torch import load_file

    from offload.formats import open_checkpoint

    _, src, _, files, _ = built
    ref = load_file(src / "model.safetensors")
    ck = open_checkpoint(files["f32"])
    cfg = ck.hf_config
    assert cfg.model_type == "gpt_oss" and cfg.swiglu_limit == LIMIT and cfg.sliding_window == 6
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 8.0
    model = transformers.GptOssForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = gguf_state(model, files["f32"])
    for n, t in ref.items():
        assert torch.equal(state[n], t), n
        if ".experts." not in n:
            assert torch.equal(ck.dense(n, torch.float32), t), n
    assert not ck.packed and len([n for n in ck.tensors if ".mlp.experts." in n]) == 4 * 6


@pytest.mark.slow
def test_mxfp4_experts_are_llamacpp_blocks(built):
    """llama-quantize's MXFP4_MOE: the experts in GGML_TYPE_MXFP4 (dequantized per routed expert), the rest Q8_0/F32."""
    from offload.formats import open_checkpoint

    _kind(built, "mxfp4")
    ck = open_checkpoint(built[3]["mxfp4"])
    kinds = {ck.tensors[n].qtype for n in ck.tensors if n.endswith(("experts.gate_weight", "experts.down_weight"))}
    assert kinds == {"MXFP4"}, kinds
    model = transformers.GptOssForCausalLM.from_pretrained(built[1], dtype=torch.float32)
    state = gguf_state(model, built[3]["mxfp4"])
    w = ck.dense("model.layers.1.mlp.experts.up_weight", torch.float32)  # (E, I, H), gguf_quants' MXFP4
    assert torch.equal(w.transpose(1, 2), state["model.layers.1.mlp.experts.gate_up_proj"][..., 1::2])


@pytest.mark.slow
def test_converted_mxfp4_checkpoint_is_transformers_bit_for_bit(built):
    """An MXFP4 safetensors checkpoint (as published) converted by llama.cpp keeps its experts in MXFP4, repacked
    into GGML blocks (nibbles reordered, scale byte first): dequantized, they are transformers' own load of it."""
    from offload.formats import open_checkpoint

    ck = open_checkpoint(built[3]["st_mxfp4"])
    sd = hf_dequantized(built[1].parent / "st-mxfp4", torch.float32).state_dict()
    for i in range(4):
        w = {p: ck.dense(f"model.layers.{i}.mlp.experts.{p}_weight", torch.float32) for p in ("gate", "up", "down")}
        assert {ck.tensors[f"model.layers.{i}.mlp.experts.{p}_weight"].qtype for p in w} == {"MXFP4"}
        gate_up = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"].float()  # (E, H, 2I), gate/up interleaved
        assert torch.equal(w["gate"].transpose(1, 2), gate_up[..., 0::2]), i
        assert torch.equal(w["up"].transpose(1, 2), gate_up[..., 1::2]), i
        assert torch.equal(w["down"].transpose(1, 2), sd[f"model.layers.{i}.mlp.experts.down_proj"].float()), i


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["f32", "mxfp4", "st_mxfp4"])
@pytest.mark.parametrize("offload", ["none", "disk"])
def test_ar_and_specexec_equal_transformers(built, kind, offload):
    _kind(built, kind)
    _check_decoding(built, kind, offload)


@pytest.mark.slow
def test_specx_run_streamed_equals_transformers(built, tmp_path):
    """`specx run` on the MXFP4 file (F32 without llama-quantize) from disk (--max-ram 0), ar and specexec."""
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    _, _, draft, files, want = built
    kind = "mxfp4" if "mxfp4" in files else "f32"
    prompt = tmp_path / "p.txt"
    prompt.write_text(PROMPT)
    ids = {}
    for method in ("ar", "specexec"):
        stats = tmp_path / f"{method}.json"
        args = ["run", str(prompt), "--target", str(files[kind]), "--draft", str(draft), "--device", "cpu"]
        args += ["--offload", "disk", "--max-ram", "0", "--method", method, "--budget", "8"]
        args += ["--max-new-tokens", str(N_NEW), "--ctx", "256", "--no-chat-template", "--stats-json", str(stats)]
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        ids[method] = json.loads(stats.read_text())["token_ids"]
    assert ids["specexec"] == ids["ar"]
    assert len(ids["ar"]) >= 8 and ids["ar"] == want[kind][: len(ids["ar"])], (ids["ar"], want)


@pytest.mark.slow
def test_plan_counts_the_stored_experts(built):
    """The memory plan's per-layer bytes hold each layer's six stored expert tensors (MXFP4 bytes as stored) and
    are the loader's per-layer bytes (its disk layers' routed experts held apart); the model also runs in bf16."""
    from offload import OffloadedCausalLM
    from offload.formats import open_checkpoint
    from offload.planning.membytes import arch_of
    from offload.planning.memlayers import layer_sizes
    from offload.planning.memplan import PlanRequest

    for f in built[3].values():
        ck = open_checkpoint(f)
        req = PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=1 << 34)
        lay = layer_sizes(ck, arch_of(ck.config), req)
        for i in range(4):
            assert len([n for n in ck.layer_tensors(i) if ".mlp.experts." in n]) == 6
            assert ck.layer_bytes(i) <= lay.packed[i], (f.name, i)
        for dtype in (torch.float32, torch.bfloat16):
            m = OffloadedCausalLM.from_pretrained(f, dtype=dtype, offload="disk")
            try:
                assert m.plan.layer_bytes == lay.packed or dtype != torch.float32, f.name
                assert m.experts is not None  # the routed experts read on demand, rows of the six fused tensors
                logits = m(input_ids=torch.tensor([byte_level_tokenizer()(PROMPT)["input_ids"]])).logits
                assert logits.dtype == dtype and torch.isfinite(logits).all()
            finally:
                m.close()


@pytest.mark.slow
def test_bytes_read_are_the_routed_experts(built, monkeypatch):
    """From disk each pass reads its routed experts' rows of the six fused tensors (F32, MXFP4 blocks) and the
    dense parts, nothing else (tests/test_gguf_moe_apart.check_bytes_read; experts too small to halve the pages
    a pass reads)."""
    from offload.arch.gptoss_experts import RoutedExperts
    from tests.test_gguf_moe_apart import check_bytes_read

    for f in built[3].values():
        check_bytes_read(f, monkeypatch, RoutedExperts, parts=("weight", "bias"), wide=False)
