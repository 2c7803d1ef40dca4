"""Model families (Llama 3.x rope scaling, Mistral, Qwen2, Qwen3, Phi-3, Gemma-2, Gemma-3) on the offload path.

For each family a tiny seeded random checkpoint checks: resident (offload none) and streamed
(disk) logits equal HF's, greedy ids equal HF `generate`, and tree-masked logits equal HF's
logits of each node's own path (which checks sliding windows by absolute position under tree
masks: the sequences are longer than the window). Gemma-3's local and global layers rotate with
different RoPE bases and its query scale is not head_dim's, so a layer given the wrong rotation or
scale shows in the logits. An unsupported model_type is refused by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from transformers import DynamicCache

from offload import OffloadedCausalLM, OffloadError
from offload.arch.families import SUPPORTED
from offload.arch.hfcompat import cache_kwargs
from tests.test_offload import _tree_mask

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
VOCAB = 48
WINDOW = 6  # sliding window, shorter than the test sequences
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)

FAMILIES = {
    "llama31": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500000.0,
            },
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False)),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "tie_word_embeddings": True,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),
}


def make_family(name: str, path, seed: int = 0, dtype=torch.float32, **over):
    """Save a seeded random checkpoint of family `name` (weights scaled up for peaky logits)."""
    cfg_cls, extra = FAMILIES[name]
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra, **over})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    return request.param, make_family(request.param, tmp_path_factory.mktemp(request.param))


def _hf(path):
    # The reference runs each family's own attention. Gemma-2 soft-caps attention scores, which only
    # "eager" computes: transformers < 5.21 defaulted Gemma-2 to "sdpa", which drops the cap (8e-5 in
    # these logits), so the reference names eager (what 5.21+ picks by default, and what specx runs).
    kw = (
        {"attn_implementation": "eager"} if transformers.AutoConfig.from_pretrained(path).model_type == "gemma2" else {}
    )
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _ids(n, seed=0):
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, n):
    cache, out, x = DynamicCache(), [], ids
    for _ in range(n):
        logits = model(input_ids=x, **cache_kwargs(model, cache), use_cache=True).logits
        x = logits[:, -1:].argmax(-1)
        out.append(int(x))
    return out


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_family_logits_and_greedy_equal_hf(family_dir, offload):
    name, path = family_dir
    hf = _hf(path)
    model = OffloadedCausalLM.from_pretrained(path, dtype=torch.float32, offload=offload)
    try:
        assert (model.plan.tier == "none") == (offload == "none")
        ids = _ids(3 * WINDOW)
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, ref, atol=2e-5, rtol=0)
        prompt = _ids(5, seed=1)
        with torch.no_grad():
            want = hf.generate(prompt, max_new_tokens=3 * WINDOW, do_sample=False, min_new_tokens=3 * WINDOW)
        assert _greedy(model, prompt, 3 * WINDOW) == want[0, prompt.shape[1] :].tolist(), name
    finally:
        model.close()


def test_tree_mask_respects_sliding_window_by_position(family_dir):
    """Tree nodes' logits equal HF's logits for the node's own root-to-node path."""
    name, path = family_dir
    hf = _hf(path)
    model = OffloadedCausalLM.from_pretrained(path, dtype=torch.float32, offload="disk")
    try:
        prefix = _ids(2 * WINDOW, seed=3)
        cache = DynamicCache()
        model(input_ids=prefix, **cache_kwargs(model, cache), use_cache=True)
        # chain 0-1-2-3-4-5-6 (deeper than the window) plus a branch 7 under node 1
        parents = [-1, 0, 1, 2, 3, 4, 5, 1]
        depth = [0, 1, 2, 3, 4, 5, 6, 2]
        tree = _ids(len(parents), seed=4)
        past = prefix.shape[1]
        pos = torch.tensor([[past + d for d in depth]])
        got = model(
            input_ids=tree,
            attention_mask=_tree_mask(parents, past, torch.float32),
            position_ids=pos,
            **cache_kwargs(model, cache),
            use_cache=True,
        ).logits[0]
        for node in (6, 7):
            path_nodes, p = [], node
            while p >= 0:
                path_nodes.append(p)
                p = parents[p]
            seq = torch.cat([prefix, tree[:, path_nodes[::-1]]], dim=1)
            with torch.no_grad():
                want = hf(input_ids=seq).logits[0, -1]
            torch.testing.assert_close(got[node], want, atol=2e-5, rtol=0, msg=f"{name} node {node}")
    finally:
        model.close()


def test_unsupported_model_type_lists_supported(tmp_path):
    path = make_family("qwen2", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(OffloadError, match=r"unsupported model_type 'gpt2'; supported: " + ", ".join(SUPPORTED)):
        OffloadedCausalLM.from_pretrained(path)
    shutil.rmtree(path)


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_family_runs_losslessly_through_specx_run(family_dir, offload, tmp_path):
    """`specx run`: specexec output == ar output on each family's target (draft: same family, other seed)."""
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app
    from tests.conftest import make_tokenizer

    name, src = family_dir
    target, draft = tmp_path / "target", make_family(name, tmp_path / "draft", seed=5)
    shutil.copytree(src, target)
    for path in (target, draft):
        make_tokenizer().save_pretrained(path)
    prompt = tmp_path / "p.txt"
    prompt.write_text("def f(x):\n  return")
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
                offload,
                "--method",
                method,
                "--budget",
                "8",
                "--max-new-tokens",
                str(4 * WINDOW),
                "--stats-json",
                str(stats),
            ],
        )
        assert r.exit_code == 0, r.output
        ids[method] = json.loads(stats.read_text())["token_ids"]
    assert len(ids["ar"]) > 2 * WINDOW and ids["specexec"] == ids["ar"], name
