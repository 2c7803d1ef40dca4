"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) from safetensors, exact against transformers.

For each family a tiny seeded checkpoint (3 layers, 4 experts, top-2 routing, 48-symbol vocab, weights x3;
Qwen2-MoE with its shared expert and one dense `mlp_only_layers` layer, Qwen3-MoE with normalized
top-k weights, a Mixtral with a sliding window on every layer) is saved by transformers' own `save_pretrained` (per-expert tensors, as published
checkpoints store them). Checked: `ar` and `specexec` (draft: a low-noise copy of the target, so
passes accept several tokens) produce exactly HF `generate`'s greedy ids, resident (--offload none)
and streamed from disk, through the engine and through `specx run`; the memory plan counts every
expert's bytes (its per-layer sizes equal the layer's stored tensor bytes and the loader's); the
one-call C stack declines MoE layers by family, so they run through transformers' modules; NF4 is
refused in one line. The same families from GGUF files: tests/test_gguf_moe.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from typer.testing import CliRunner

from offload.formats.st_index import SafetensorsIndex
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.methods import generate
from specexec_cli.session.loading import LoadOptions, load_models
from specexec_cli.terminal.app import app
from tests.conftest import CHARS, make_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
PROMPT = "def add(a, b):\n    return a"
N_NEW = 20
COMMON = dict(
    vocab_size=len(CHARS),
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    num_experts_per_tok=2,
)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, tie_word_embeddings=False)),
    # Mixtral with a sliding window on every layer (shorter than prompt + output): runs on the offload
    # path also with --offload none (loading.needs_offload_path), windows applied under tree masks
    "mixtral_swa": ("MixtralConfig", dict(num_local_experts=4, sliding_window=8, tie_word_embeddings=True)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=40,
            mlp_only_layers=[1],
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=4, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True, tie_word_embeddings=False),
    ),
}


def make_moe(name: str, path, seed: int, noise_from=None, noise: float = 0.0, config=None, tokenizer=None):
    """Save a seeded random `name` checkpoint (weights x3: peaky, varied logits), or a noisy copy of another;
    `config` / `tokenizer`: another transformers config and tokenizer than FAMILIES' and make_tokenizer's."""
    cfg_cls, extra = FAMILIES[name]
    torch.manual_seed(seed)
    config = config or getattr(transformers, cfg_cls)(**COMMON, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        if noise_from is not None:
            model.load_state_dict(transformers.AutoModelForCausalLM.from_pretrained(noise_from).state_dict())
        for p in model.parameters():
            p.add_(noise * p.std() * torch.randn_like(p)) if noise_from is not None else p.mul_(3.0)
    model.save_pretrained(path, safe_serialization=True)
    (tokenizer or make_tokenizer()).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, target dir, draft dir, HF generate's greedy ids for PROMPT)."""
    root = tmp_path_factory.mktemp(request.param)
    target = make_moe(request.param, root / "target", seed=3)
    draft = make_moe(request.param, root / "draft", seed=4, noise_from=target, noise=0.05)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the whole N_NEW tokens, as the engine runs with no EOS below
    ids = make_tokenizer()(PROMPT)["input_ids"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0)
    want = out[0, len(ids) :].tolist()
    assert len(set(want)) >= 8 and 0 not in want, want  # a varied continuation, no EOS (the CLI stops there)
    return request.param, target, draft, want


def _decode(m, method: str):
    cfg = GenerationConfig(method=method, shape=TreeShape(8, 5), max_new_tokens=N_NEW)
    events = list(generate(m, DecodeState(), m.tokenizer(PROMPT)["input_ids"], cfg))
    return [t for ev in events for t in ev.tokens], [len(ev.tokens) for ev in events[1:]]


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_ar_and_specexec_equal_hf_generate(family, offload):
    name, target, draft, want = family
    m = load_models(LoadOptions(str(target), str(draft), dtype="fp32", device="cpu", offload=offload, ctx=256))
    try:
        if offload == "disk" or name == "mixtral_swa":  # else --offload none: HF's own model (loading.load_hf)
            assert m.target.plan.tier == offload, m.target.plan
            # decode_stack.c computes plain Llama only: the MoE layers run through transformers' modules
            assert m.target.lean is None
        m.eos_ids = frozenset()
        got, _ = _decode(m, "ar")
        assert got == want, (name, offload)
        got, per_pass = _decode(m, "specexec")
        assert got == want, (name, offload, "specexec")
        assert max(per_pass) >= 3, per_pass  # the draft really gets several tokens accepted per pass
    finally:
        getattr(m.target, "close", lambda: None)()


def test_specx_run_streamed_equals_hf_generate(family, tmp_path):
    """`specx run --offload disk`, ar and specexec: the same ids as HF generate (up to an EOS stop)."""
    name, target, draft, want = family
    prompt = tmp_path / "p.txt"
    prompt.write_text(PROMPT)
    ids = {}
    for method in ("ar", "specexec"):
        stats = tmp_path / f"{method}.json"
        r = CliRunner().invoke(
            app,
            [
                "run",
                str(prompt),
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--device",
                "cpu",
                "--offload",
                "disk",
                "--method",
                method,
                "--budget",
                "8",
                "--max-new-tokens",
                str(N_NEW),
                "--ctx",
                "256",
                "--stats-json",
                str(stats),
            ],
        )
        assert r.exit_code == 0, r.output
        ids[method] = json.loads(stats.read_text())["token_ids"]
    assert ids["specexec"] == ids["ar"], name
    assert len(ids["ar"]) >= 8 and ids["ar"] == want[: len(ids["ar"])], (name, ids["ar"], want)


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_offloaded_model_greedy_equals_hf_generate(family, offload):
    """OffloadedCausalLM itself, every layer resident or every layer streamed from disk."""
    from transformers import DynamicCache

    from offload import OffloadedCausalLM
    from offload.arch.hfcompat import cache_kwargs

    name, target, _, want = family
    m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload=offload)
    try:
        assert m.plan.tier == offload and m.lean is None
        cache, got = DynamicCache(), []
        x = torch.tensor([make_tokenizer()(PROMPT)["input_ids"]])
        for _ in range(N_NEW):
            x = m(input_ids=x, **cache_kwargs(m, cache), use_cache=True).logits[:, -1:].argmax(-1)
            got.append(int(x))
        assert got == want, (name, offload)
    finally:
        m.close()


def test_nf4_is_refused_in_one_line(tmp_path):
    from offload import OffloadedCausalLM, OffloadError

    path = make_moe("qwen3_moe", tmp_path / "m", seed=1)
    with pytest.raises(OffloadError, match=r"NF4 is not supported for mixture-of-experts models \(qwen3_moe\)"):
        OffloadedCausalLM.from_pretrained(path, dtype="nf4", offload="disk")


def test_plan_counts_every_expert(family):
    """The memory plan's per-layer bytes are the layer's stored tensors (all experts) and the loader's."""
    from offload import OffloadedCausalLM
    from offload.planning.membytes import arch_of
    from offload.planning.memlayers import layer_sizes
    from offload.planning.memplan import PlanRequest
    from tests.sparse_ckpt import read_checkpoint

    name, target, _, _ = family
    ck = read_checkpoint(target)
    lay = layer_sizes(
        ck, arch_of(ck.config), PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=1 << 34)
    )
    entries = SafetensorsIndex(target).entries
    for i in range(COMMON["num_hidden_layers"]):
        stored = sum(math.prod(e.shape) * 4 for n, e in entries.items() if n.startswith(f"model.layers.{i}."))
        experts = [n for n in entries if n.startswith(f"model.layers.{i}.") and ".experts." in n]
        assert len(experts) == (0 if name == "qwen2_moe" and i == 1 else 4 * 3), experts
        assert stored <= lay.packed[i] < stored + 4096, (i, stored, lay.packed[i])
    m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk")
    try:
        assert m.plan.layer_bytes == lay.packed
    finally:
        m.close()
