"""Gemma-3 GGUF files (offload/formats/gguf.py + offload/arch/gemma3.py) equal transformers' loading of them.

A tiny seeded Gemma-3 (6 layers: the 5 local + 1 global pattern transformers assumes for a GGUF,
global RoPE base 1M against the local 10k, a sliding window shorter than the sequences) is written
as llama.cpp's converter writes Gemma-3 (tests/gguf_build.py: norms stored 1 + w, no Q/K
permutation, a sentencepiece vocabulary) in the real file's Q4_K_M mix (Q5_0, Q8_0 embeddings,
Q4_K and Q6_K). Oracle: transformers' `from_pretrained(dir, gguf_file=)`. Its config equals
specx's; fp32 logits are bitwise equal with every layer resident, in RAM and on disk (the
dequantize path, as tests/test_gguf.py), with one norm's stored values where 1 + (s - 1) != s
in fp32 (PlusOneNorm computes HF's 1 + w from w = s - 1), with the kernel off (so that the C
one-call stack, which needs kernel-served linears, is not built and HF's layers run); through `specx run` (no chat template in the file: the prompt is encoded as plain
text, BOS first), `--method ar` resident and specexec streamed from disk with a Gemma-3 GGUF draft
(the same weights in Q8_0) give transformers' greedy ids, and `--draft self` gives ar's. A file with Gemma-3 4B+'s linear RoPE
scaling of the global layers (which transformers' GGUF loading leaves out) is read with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from offload.formats import open_checkpoint
from tests.gguf_build import write_gguf

WINDOW = 8
MIX = {"embed_tokens": "Q8_0", "v_proj": "Q8_0", "o_proj": "Q4_K", "down_proj": "Q6_K"}  # the rest Q5_0
PROMPT = "ab a b ab ab b a ab a b b ab"
IDS = torch.tensor([[2, 5, 9, 4, 7, 10, 8, 6, 30, 3 * 7, 11, 40, 9, 5, 8, 7, 33, 2 * 7, 10, 6]])  # > WINDOW


def _hf_gemma3(path: Path, seed: int, full_rope: dict | None = None, window: int = WINDOW) -> Path:
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=window,
        max_position_embeddings=512,
        rope_parameters={
            "full_attention": full_rope or {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        # Gemma scales embeddings by sqrt(hidden): small ones and large post-norms keep the layers'
        # output from drowning in the residual (else every position predicts its own token)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # HF's w; stored 1 + w, some of it below 0.5
                p.copy_(torch.randn_like(p) * 2.0 + (4.0 if "post" in name else 0.0))
            elif "embed" in name:
                p.mul_(0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3")
    hf = _hf_gemma3(root / "hf", 0)
    target = write_gguf(hf, root / "target" / "target-q4_k_m.gguf", "Q5_0", arch="gemma3", mix=MIX)
    _off_grid_norm(target, "model.layers.0.input_layernorm.weight")
    # the draft: the same model in Q8_0, close enough to the target to be accepted
    return {"target": target, "draft": write_gguf(hf, root / "draft" / "draft-q8_0.gguf", "Q8_0", arch="gemma3")}


def _off_grid_norm(f: Path, name: str) -> None:
    """Overwrite one stored norm with values in (0, 0.4) of full fp32 precision: for them 1 + (s - 1)
    != s in fp32, so a norm computing with s itself differs from HF's w = s - 1 (a converter's
    s = fl(1 + w) always has 1 + (s - 1) == s)."""
    import numpy as np

    info = open_checkpoint(f).tensors[name]
    vals = np.random.default_rng(5).uniform(0.0, 0.4, info.shape).astype(np.float32)
    assert (np.float32(1) + (vals - np.float32(1)) != vals).any()
    with open(f, "r+b") as fh:
        fh.seek(info.begin)
        fh.write(vals.tobytes())


def _hf(f: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32).eval()


def test_config_and_tensors_as_transformers_reads_them(files):
    from transformers import AutoConfig

    from offload.arch.gemma3 import PLUS_ONE

    f = files["target"]
    ck = open_checkpoint(f)
    ref = AutoConfig.from_pretrained(f.parent, gguf_file=f.name).to_dict()
    got = ck.hf_config.to_dict()
    skip = {"_name_or_path", PLUS_ONE}
    assert {k: v for k, v in got.items() if k not in skip} == {k: v for k, v in ref.items() if k not in skip}
    assert got["model_type"] == "gemma3_text" and got[PLUS_ONE] is True
    assert got["layer_types"].count("full_attention") == 1 and got["sliding_window"] == WINDOW
    norm = ck.tensors["model.layers.0.self_attn.q_norm.weight"]
    assert norm.qtype is None and norm.dtype == torch.float32  # streamed as stored: 1 + w
    by = ck.quant["bytes_by_type"]
    assert all(by.get(t, 0) > 0 for t in ("Q5_0", "Q8_0", "Q4_K", "Q6_K", "F32")), by
    stored = ck.read("model.layers.1.input_layernorm.weight")
    assert (stored < 0.5).any() and (stored > 2).any()


@pytest.mark.parametrize("offload", ["none", "ram", "disk"])
def test_logits_equal_transformers_bitwise(files, offload, monkeypatch):
    from offload.cpu.leanstack import family_reason
    from offload.stream.model import OffloadedCausalLM

    monkeypatch.setenv("SPECX_GGUF_KERNEL", "off")  # the dequantize-then-matmul path (tests/test_gguf.py)
    f = files["target"]
    with torch.no_grad():
        want = _hf(f)(input_ids=IDS).logits
    model = OffloadedCausalLM.from_pretrained(f, device="cpu", dtype=torch.float32, offload=offload)
    try:
        assert (model.plan.tier == "none") == (offload == "none")
        # the C one-call stack computes Gemma-3 (family_reason None) over kernel-served linears only:
        # with the kernel off there are none, so HF's layers run
        assert model.lean is None and family_reason(model.config) is None
        with torch.no_grad():
            got = model(input_ids=IDS).logits
        assert torch.equal(got, want), (got - want).abs().max()
    finally:
        model.close()


def test_linear_rope_scaling_of_the_global_layers(tmp_path, monkeypatch):
    """Gemma-3 4B+ files carry rope.scaling (linear, factor 8, global layers only), which
    transformers' GGUF key table leaves out: specx reads it as HF's config states it, and its logits
    equal transformers' model of the file given the original model's rotary (its config.json's)."""
    from offload.stream.model import OffloadedCausalLM

    monkeypatch.setenv("SPECX_GGUF_KERNEL", "off")
    linear = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    f = write_gguf(_hf_gemma3(tmp_path / "hf", 2, linear), tmp_path / "g" / "scaled.gguf", "Q8_0", arch="gemma3")
    ck = open_checkpoint(f)
    rope = ck.hf_config.rope_parameters
    assert rope["full_attention"] == linear and rope["sliding_attention"]["rope_type"] == "default"
    ref = _hf(f)
    assert ref.config.rope_parameters["full_attention"]["rope_type"] == "default"  # what transformers misses
    from transformers import AutoConfig

    ref.model.rotary_emb = type(ref.model.rotary_emb)(AutoConfig.from_pretrained(tmp_path / "hf"))
    model = OffloadedCausalLM.from_pretrained(f, device="cpu", dtype=torch.float32, offload="none")
    try:
        with torch.no_grad():
            assert torch.equal(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
    finally:
        model.close()


def _specx(args: list[str], tmp_path: Path, name: str) -> dict:
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    stats = tmp_path / f"{name}.json"
    res = CliRunner().invoke(
        app,
        ["run", "-p", PROMPT, "--device", "cpu", "--temperature", "0", "--no-live", "--stats-json", str(stats), *args],
    )
    assert res.exit_code == 0, res.output
    return json.loads(stats.read_text())


@pytest.mark.slow
def test_specx_run_greedy_equals_transformers(files, tmp_path):
    from transformers import AutoTokenizer

    f, n = files["target"], 3 * WINDOW
    tok = AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)
    assert tok.chat_template is None  # a base model's file: no template
    ids = tok(PROMPT)["input_ids"]
    assert ids[0] == 2 and len(ids) > WINDOW  # BOS first; the prompt outruns the window
    want = (
        _hf(f)
        .generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=1, pad_token_id=0)[0, len(ids) :]
        .tolist()
    )
    ar = _specx(["--target", str(f), "--method", "ar", "--offload", "none", "--max-new-tokens", str(n)], tmp_path, "ar")
    spec = _specx(
        [
            "--target",
            str(f),
            "--draft",
            str(files["draft"]),
            "--method",
            "specexec",
            "--offload",
            "disk",
            "--max-ram",
            "0",
            "--budget",
            "8",
            "--max-new-tokens",
            str(n),
        ],
        tmp_path,
        "spec",
    )
    for rec in (ar, spec):
        got = rec["token_ids"]
        assert got == want[: len(got)] and (len(got) == len(want) or want[len(got) - 1] == 1), (got, want)
        assert rec["prompt_tokens"] == len(ids)  # the plain text as the tokenizer encodes it
    assert len(ar["token_ids"]) > WINDOW and len(set(ar["token_ids"])) > 4  # not one repeated token
    assert spec["tokens_per_pass"] > 1.0


@pytest.mark.slow
def test_self_draft_prints_what_ar_prints(files, tmp_path):
    """`--draft self` (3-bit HQQ substitutes of the streamed Gemma-3 layers) at T = 0: ar's ids."""
    pytest.importorskip("hqq")
    f, n = files["target"], 3 * WINDOW
    ar = _specx(["--target", str(f), "--method", "ar", "--max-new-tokens", str(n)], tmp_path, "ar")
    spec = _specx(
        [
            "--target",
            str(f),
            "--draft",
            "self",
            "--method",
            "specexec",
            "--offload",
            "disk",
            "--max-ram",
            "0",
            "--budget",
            "8",
            "--max-new-tokens",
            str(n),
        ],
        tmp_path,
        "self",
    )
    assert spec["method"] == "specexec" and spec["token_ids"] == ar["token_ids"], (spec, ar)
