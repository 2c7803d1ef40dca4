"""gpt-oss's parts, against transformers: the sink attention, what each feature changes, the plan, refusals.

The sink attention equals transformers' eager gpt-oss attention under a 4-D tree mask (fp32: the CPU
flash kernel scaled by the sinks' share; bf16: eager itself) and takes transformers' other mask forms;
a gpt-oss model transformers itself loads under specx_gqa (a draft, loading.load_hf) keeps its sinks.
The sinks, the window and the clamp each change the tiny model's output (tests/test_gpt_oss.py), so the
exact checks there see them (transformers 5.17 clamps at 7.0 whatever the config says; specx runs its
module, so follows). The plan counts every expert tensor. Refused in one line each: NF4, a gpt-oss GGUF
without the metadata its config needs (MXFP4 experts are read: tests/test_gpt_oss_mxfp4.py; gpt-oss GGUFs:
tests/test_gguf_gpt_oss.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from offload.formats.st_index import SafetensorsIndex
from tests.conftest import make_tokenizer
from tests.test_gpt_oss import CONFIG, LAYERS, N_NEW, PROMPT, make_gpt_oss, seeded

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "target", seed=0)


def _tree_mask(q: int, past: int, dtype) -> torch.Tensor:
    """Additive (1, 1, q, past + q): every query sees the past and a random ancestor set (itself included)."""
    g = torch.Generator().manual_seed(0)
    allowed = torch.ones(q, past + q, dtype=torch.bool)
    allowed[:, past:] = torch.tril(torch.rand(q, q, generator=g) < 0.5) | torch.eye(q, dtype=torch.bool)
    return torch.zeros(1, 1, q, past + q, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sink_attention_equals_hf_eager_under_a_tree_mask(dtype, monkeypatch):
    """fp32: the CPU flash kernel scaled by the sinks' share, equal to transformers' eager to rounding;
    bf16: transformers' eager itself (the same bits)."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    from offload.arch import gptoss

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    module.sinks = torch.nn.Parameter(torch.full((4,), -1e4, dtype=dtype))  # weight e^-1e4: plain softmax
    q, k, v = (torch.randn(1, h, n, 16).to(dtype) for h, n in ((4, 7), (2, 12), (2, 12)))
    mask = _tree_mask(7, 5, dtype)
    eager = modeling_gpt_oss.eager_attention_forward
    calls = []

    def counted(*a, **kw):
        calls.append(1)
        return eager(*a, **kw)

    monkeypatch.setattr(modeling_gpt_oss, "eager_attention_forward", counted)
    with torch.no_grad():
        without, _ = eager(module, q, k, v, mask, 0.25)
        module.sinks.copy_(torch.randn(4) * 2)
        want, _ = eager(module, q, k, v, mask, 0.25)
        got, _ = gptoss.sink_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (1, 7, 4, 16) and got.dtype == dtype
    if dtype == torch.float32:
        assert not calls and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    else:
        assert calls and torch.equal(got, want)
    assert (want - without).float().abs().max() > 0.1  # the sinks change the output well beyond the tolerance


def test_sink_attention_takes_transformers_other_masks():
    """None (causal over the last Q keys: what sdpa_mask gives specx_gqa) and bool masks: the additive mask's output."""
    from offload.arch import gptoss

    module = torch.nn.Module()
    module.num_key_value_groups, module.training, module.sinks = 2, False, torch.nn.Parameter(torch.randn(4))
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    seen = torch.ones(3, 5, dtype=torch.bool).tril(2)[None, None]  # query i sees keys 0 .. 2 + i
    with torch.no_grad():
        want, _ = gptoss.sink_attention_forward(module, q, k, v, torch.zeros(seen.shape).masked_fill(~seen, -1e30))
        for mask in (None, seen):
            assert torch.allclose(gptoss.sink_attention_forward(module, q, k, v, mask)[0], want, atol=1e-6)


def test_transformers_own_model_keeps_the_sinks_under_specx_gqa(target):
    """A gpt-oss draft loads as transformers' model under specx_gqa (loading.load_hf): the sinks still count."""
    from offload import gqa_attention

    ids = torch.tensor([make_tokenizer()(PROMPT)["input_ids"]])
    logits = []
    for attn in ("eager", gqa_attention("sdpa")):
        hf = transformers.AutoModelForCausalLM.from_pretrained(target, attn_implementation=attn).eval()
        with torch.no_grad():
            logits.append(hf(ids).logits)
    assert torch.allclose(logits[0], logits[1], atol=1e-4), (logits[0] - logits[1]).abs().max()


def _greedy(model) -> list[int]:
    ids = torch.tensor([make_tokenizer()(PROMPT)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=N_NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, ids.shape[1] :].tolist()


def test_sinks_and_window_each_change_the_output():
    """The sinks and the window each move the tiny model's greedy continuation (the exact checks see them)."""
    base = _greedy(seeded(0))
    no_sinks = seeded(0)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert _greedy(no_sinks) != base
    assert _greedy(seeded(0, sliding_window=64)) != base


def test_clamp_changes_the_output():
    model = seeded(0)
    if model.model.layers[0].mlp.experts.limit != CONFIG["swiglu_limit"]:
        pytest.skip("this transformers clamps at 7.0 whatever the config's swiglu_limit says")
    assert _greedy(seeded(0, swiglu_limit=50.0)) != _greedy(model)


def test_plan_counts_every_expert(target):
    """The memory plan's per-layer bytes are the layer's stored tensors (all four expert tensors) and the loader's."""
    from offload import OffloadedCausalLM
    from offload.planning.membytes import arch_of
    from offload.planning.memlayers import layer_sizes
    from offload.planning.memplan import PlanRequest
    from tests.sparse_ckpt import read_checkpoint

    ck = read_checkpoint(target)
    lay = layer_sizes(
        ck, arch_of(ck.config), PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=1 << 34)
    )
    entries = SafetensorsIndex(target).entries
    e, h, inter = CONFIG["num_local_experts"], CONFIG["hidden_size"], CONFIG["intermediate_size"]
    for i in range(LAYERS):
        stored = sum(math.prod(t.shape) * 4 for n, t in entries.items() if n.startswith(f"model.layers.{i}."))
        experts = {n.rsplit(".", 1)[1]: tuple(t.shape) for n, t in entries.items() if f"layers.{i}.mlp.experts." in n}
        assert experts == {
            "gate_up_proj": (e, h, 2 * inter),
            "gate_up_proj_bias": (e, 2 * inter),
            "down_proj": (e, inter, h),
            "down_proj_bias": (e, h),
        }
        assert sum(math.prod(s) * 4 for s in experts.values()) > stored / 2  # the experts are most of the layer
        assert stored <= lay.packed[i] < stored + 4096, (i, stored, lay.packed[i])
    m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk")
    try:
        assert m.plan.layer_bytes == lay.packed
    finally:
        m.close()


def test_nf4_is_refused_in_one_line(target):
    from offload import OffloadedCausalLM, OffloadError

    with pytest.raises(OffloadError, match=r"NF4 is not supported for mixture-of-experts models \(gpt_oss\)"):
        OffloadedCausalLM.from_pretrained(target, dtype="nf4", offload="disk")


def test_gpt_oss_gguf_without_its_metadata_is_one_line(tmp_path):
    """A gpt-oss GGUF (read: tests/test_gguf_gpt_oss.py) missing a key its config needs: one line naming the key."""
    gguf = pytest.importorskip("gguf")
    from offload import OffloadError
    from offload.formats import open_checkpoint

    out = tmp_path / "gpt-oss.gguf"
    writer = gguf.GGUFWriter(out, "gpt-oss")
    writer.add_block_count(1)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        OffloadError, match=r"gpt-oss\.gguf: gpt-oss metadata key 'gpt-oss\.embedding_length' is missing"
    ):
        open_checkpoint(out)
