"""gpt-oss from safetensors, exact against transformers' GptOssForCausalLM: decoding.

A tiny seeded checkpoint (4 layers alternating sliding (window 6, shorter than prompt + output) and
full attention, 4 experts, top-2 routing, YaRN RoPE, 48-symbol vocab; weights x3, the sinks and the
experts' and router's biases given random values, a SwiGLU clamp of 2 that the weights reach) is saved
by transformers' own `save_pretrained`. Checked: `ar` and `specexec` (draft: a low-noise copy) give
exactly HF `generate`'s greedy ids, resident and streamed from disk with no RAM tier (`--offload disk
--max-ram 0`), through the engine and `specx run`; at T = 0.7 specexec's ids equal ar's for one seed;
a bf16 checkpoint is exact in fp32 and in bf16. The attention, the plan and the refusals:
tests/test_gpt_oss_parts.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from typer.testing import CliRunner

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.methods import generate
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.session.loading import LoadOptions, load_models
from specexec_cli.terminal.app import app
from tests.conftest import CHARS, make_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
PROMPT = "def add(a, b):\n    return a"
N_NEW = 20
LAYERS = 4
CONFIG = dict(
    vocab_size=len(CHARS),
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=6,
    max_position_embeddings=256,
    rope_parameters=dict(
        rope_type="yarn",
        factor=8.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=32,
        rope_theta=150000.0,
    ),
    swiglu_limit=2.0,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
RANDOMIZED = ("sinks", "_proj_bias", "router.bias")  # zero (or tiny) at HF's init: given values here


def seeded(seed: int, **overrides) -> transformers.GptOssForCausalLM:
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**CONFIG, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(3.0)
            if name.endswith(RANDOMIZED):
                p.add_(0.3 * torch.randn_like(p))
    return model


def make_gpt_oss(path, seed: int, noise_from=None, noise: float = 0.0, dtype=torch.float32):
    """Save a seeded gpt-oss checkpoint (or a noisy copy of another) with the tokenizer at `path`."""
    model = seeded(seed)
    if noise_from is not None:
        with torch.no_grad():
            model.load_state_dict(transformers.GptOssForCausalLM.from_pretrained(noise_from).state_dict())
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn_like(p))
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


def hf_greedy(path, dtype=torch.float32) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = make_tokenizer()(PROMPT)["input_ids"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target dir, draft dir, HF generate's greedy ids for PROMPT)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    target = make_gpt_oss(root / "target", seed=0)
    draft = make_gpt_oss(root / "draft", seed=1, noise_from=target, noise=0.05)
    want = hf_greedy(target)
    assert len(set(want)) >= 8 and 0 not in want, want  # a varied continuation, no EOS (the CLI stops there)
    return target, draft, want


def _load(target, draft, offload: str):
    ram = 0 if offload == "disk" else None
    return load_models(
        LoadOptions(str(target), str(draft), "fp32", device="cpu", offload=offload, max_ram=ram, ctx=256)
    )


def _decode(m, method: str, sampling: SamplingParams = SamplingParams(), seed: int = 0):  # noqa: B008 - frozen
    cfg = GenerationConfig(method=method, shape=TreeShape(8, 5), max_new_tokens=N_NEW, sampling=sampling, seed=seed)
    events = list(generate(m, DecodeState(), m.tokenizer(PROMPT)["input_ids"], cfg))
    return [t for ev in events for t in ev.tokens], [len(ev.tokens) for ev in events[1:]]


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_ar_and_specexec_equal_hf_generate(pair, offload):
    target, draft, want = pair
    m = _load(target, draft, offload)
    try:
        # sliding layers under tree masks: the offload path also with --offload none (loading.needs_offload_path)
        assert m.target.plan.tier == offload, m.target.plan
        if offload == "disk":
            assert m.target.plan.disk_layers == list(range(LAYERS)) and not m.target.plan.ram_layers, m.target.plan
        assert m.target.lean is None  # the one-call C stack computes plain Llama only
        m.eos_ids = frozenset()
        got, _ = _decode(m, "ar")
        assert got == want, offload
        # the small draft on the offload path too (loading.load_small_draft): its sliding windows hold under
        # the tree masks, so it agrees with the target
        assert type(m.draft).__name__ == "OffloadedCausalLM", type(m.draft)
        got, per_pass = _decode(m, "specexec")
        assert got == want, (offload, "specexec")
        assert max(per_pass) >= 3, per_pass  # the draft really gets several tokens accepted per pass
    finally:
        m.target.close()
        getattr(m.draft, "close", lambda: None)()


def test_sampled_specexec_equals_ar_with_the_same_seed(pair):
    """T = 0.7, streamed from disk: coupled draws make specexec emit --method ar's ids for one seed."""
    target, draft, want = pair
    m = _load(target, draft, "disk")
    try:
        m.eos_ids = frozenset()
        warm = SamplingParams(temperature=0.7)
        ar, _ = _decode(m, "ar", warm, seed=11)
        spec, per_pass = _decode(m, "specexec", warm, seed=11)
        other, _ = _decode(m, "ar", warm, seed=12)
    finally:
        m.target.close()
        m.draft.close()
    assert spec == ar and len(ar) == N_NEW, (spec, ar)
    assert ar != want and other != ar  # really sampled: neither the greedy ids nor seed-independent
    assert max(per_pass) >= 2, per_pass


def test_specx_run_streamed_equals_hf_generate(pair, tmp_path):
    """`specx run --offload disk --max-ram 0`, ar and specexec: HF generate's ids (up to an EOS stop)."""
    run_streamed_equals(*pair, tmp_path)


def run_streamed_equals(target, draft, want, tmp_path) -> None:
    """`specx run` of target with draft, every layer streamed from disk, `ar` and `specexec`: the same ids,
    at least 8 of them, the start of `want`."""
    prompt = tmp_path / "p.txt"
    prompt.write_text(PROMPT)
    ids = {}
    for method in ("ar", "specexec"):
        stats = tmp_path / f"{method}.json"
        args = ["run", str(prompt), "--target", str(target), "--draft", str(draft), "--device", "cpu"]
        args += ["--offload", "disk", "--max-ram", "0", "--method", method, "--budget", "8"]
        args += ["--max-new-tokens", str(N_NEW), "--ctx", "256", "--temperature", "0", "--stats-json", str(stats)]
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        ids[method] = json.loads(stats.read_text())["token_ids"]
    assert ids["specexec"] == ids["ar"]
    assert len(ids["ar"]) >= 8 and ids["ar"] == want[: len(ids["ar"])], (ids["ar"], want)


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_offloaded_model_greedy_equals_hf_generate(pair, offload):
    """OffloadedCausalLM itself, with a DynamicCache: every layer resident or every layer streamed."""
    from transformers import DynamicCache

    from offload import OffloadedCausalLM
    from offload.arch.hfcompat import cache_kwargs

    target, _, want = pair
    m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload=offload)
    try:
        assert m.plan.tier == offload and m.lean is None
        assert m.config._attn_implementation == "specx_sinks"
        cache, got = DynamicCache(), []
        x = torch.tensor([make_tokenizer()(PROMPT)["input_ids"]])
        for _ in range(N_NEW):
            x = m(input_ids=x, **cache_kwargs(m, cache), use_cache=True).logits[:, -1:].argmax(-1)
            got.append(int(x))
        assert got == want, offload
    finally:
        m.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_checkpoint_is_exact(tmp_path, dtype):
    """A checkpoint stored in bf16 (gpt-oss's non-expert weights ship so), loaded in fp32 or computed in
    bf16 and streamed from disk: transformers' greedy ids in the same dtype."""
    from offload import OffloadedCausalLM
    from offload.formats import open_checkpoint

    path = make_gpt_oss(tmp_path / "bf16", seed=0, dtype=torch.bfloat16)
    assert open_checkpoint(path).format == "bf16"
    want = hf_greedy(path, dtype)
    m = OffloadedCausalLM.from_pretrained(path, dtype=dtype, offload="disk")
    try:
        ids = torch.tensor([make_tokenizer()(PROMPT)["input_ids"]])
        got = []
        for _ in range(N_NEW):
            nxt = int(m(input_ids=ids).logits[0, -1].argmax())
            got.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    finally:
        m.close()
    assert got == want
