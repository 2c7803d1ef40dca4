"""gpt-oss with its experts stored as MXFP4 (offload/formats/mxfp4.py), exact against transformers.

The tiny seeded gpt-oss of tests/test_gpt_oss.py re-stored as the published checkpoints store it
(tests/mxfp4_ckpt.py: the experts' matrices as `*_blocks`/`*_scales`, `quant_method: mxfp4`). The oracle is
transformers' own load of that checkpoint with `Mxfp4Config(dequantize=True)`. Checked: the test quantizer's
layout is the one transformers' dequantizer reads, and specx's dequantizer gives its values in fp32 and bf16;
each layer's experts give transformers' bits (a pass's logits: its values to fp32 rounding); `ar` and specexec
(draft: a low-noise 32-bit copy of the source) give transformers' greedy ids, resident and streamed from disk
with no RAM tier, through the engine and `specx run`; the plan and the loader count the stored bytes (4.25 bits a weight for
the experts' matrices, read so from disk), and the plan a routed expert's dequantization temporaries; MXFP4 on
another model is refused in one line.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from offload.formats.mxfp4 import dequantize
from offload.formats.st_index import SafetensorsIndex
from offload.stream.hostmem import IO_ALIGN
from offload.stream.storage import file_layout
from specexec_cli.session.loading import LoadOptions, load_models
from tests.conftest import make_tokenizer
from tests.mxfp4_ckpt import hf_dequantized, quantize, write_mxfp4
from tests.test_gpt_oss import LAYERS, N_NEW, PROMPT, _decode, make_gpt_oss, run_streamed_equals

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(MXFP4 target dir, 32-bit draft dir, transformers' greedy ids for PROMPT)."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    source = make_gpt_oss(root / "source", seed=0)
    target = write_mxfp4(source, root / "target")
    draft = make_gpt_oss(root / "draft", seed=1, noise_from=source, noise=0.05)
    hf = hf_dequantized(target)
    ids = make_tokenizer()(PROMPT)["input_ids"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = out[0, len(ids) :].tolist()
    assert len(set(want)) >= 8 and 0 not in want, want  # a varied continuation, no EOS
    return target, draft, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_layout_and_dequantizer_equal_transformers(dtype):
    torch.manual_seed(0)
    w = torch.randn(3, 64, 96) * torch.logspace(-3, 2, 96)  # (E, K, N), groups of very different scales
    blocks, scales = quantize(w)
    assert blocks.shape == (3, 96, 2, 16) and scales.shape == (3, 96, 2)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (E, K, N), as transformers loads it
    assert torch.equal(dequantize(blocks, scales, dtype).transpose(1, 2), ref)
    # the quantizer rounds each weight to a neighbouring FP4 step: within half of its group's largest step (2)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1).transpose(1, 2)  # (E, K, N)
    assert ((ref.float() - w).abs() <= step + 1e-12).all()


def test_experts_equal_transformers_bit_for_bit(mxfp4):
    """Each layer's MXFP4 experts (dequantized per routed expert) give transformers' dequantized experts' bits;
    the whole pass's logits equal its to fp32 rounding (the sink attention's CPU kernel rounds otherwise)."""
    from offload import OffloadedCausalLM

    target, _, _ = mxfp4
    hf = hf_dequantized(target)
    ids = torch.tensor([make_tokenizer()(PROMPT)["input_ids"]])
    torch.manual_seed(0)
    x = torch.randn(9, hf.config.hidden_size) * 3
    top = torch.stack([torch.randperm(hf.config.num_local_experts)[:2] for _ in range(9)])  # (T, K)
    w = torch.softmax(torch.randn(9, 2), dim=-1)
    m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="none")
    try:
        with torch.no_grad():
            for i in range(LAYERS):
                mine = m.layers[i].mlp.experts
                assert type(mine).__name__ == "Mxfp4Experts"
                assert torch.equal(mine(x, top, w), hf.model.layers[i].mlp.experts(x, top, w)), i
            torch.testing.assert_close(m(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    finally:
        m.close()


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_ar_and_specexec_equal_transformers(mxfp4, offload):
    target, draft, want = mxfp4
    ram = 0 if offload == "disk" else None
    m = load_models(LoadOptions(str(target), str(draft), "fp32", device="cpu", offload=offload, max_ram=ram, ctx=256))
    try:
        assert m.target.plan.tier == offload, m.target.plan
        if offload == "disk":
            assert m.target.plan.disk_layers == list(range(LAYERS)) and not m.target.plan.ram_layers
        m.eos_ids = frozenset()
        assert _decode(m, "ar")[0] == want, offload
        got, per_pass = _decode(m, "specexec")
        assert got == want, (offload, "specexec")
        assert max(per_pass) >= 3, per_pass
    finally:
        m.target.close()
        getattr(m.draft, "close", lambda: None)()


def test_plan_and_loader_count_the_stored_bytes(mxfp4):
    """A layer's planned and loaded bytes are its stored tensors' (the experts' matrices at 4.25 bits a weight),
    and a pass streaming whole layers reads that many from disk."""
    from offload import OffloadedCausalLM
    from offload.formats import open_checkpoint
    from offload.planning.membytes import arch_of
    from offload.planning.memlayers import layer_sizes
    from offload.planning.memplan import PlanRequest
    from tests.sparse_ckpt import read_checkpoint

    target, _, _ = mxfp4
    assert open_checkpoint(target).format == "mxfp4"
    ck = read_checkpoint(target)
    lay = layer_sizes(
        ck, arch_of(ck.config), PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=1 << 34)
    )
    entries, total, spans = SafetensorsIndex(target).entries, 0, 0
    for i in range(LAYERS):
        mine = {n: t for n, t in entries.items() if n.startswith(f"model.layers.{i}.")}
        stored = sum(math.prod(t.shape) * (1 if t.dtype == torch.uint8 else 4) for t in mine.values())
        blocks = [t for n, t in mine.items() if n.endswith("_blocks")]
        scales = [t for n, t in mine.items() if n.endswith("_scales")]
        weights = sum(2 * t.nbytes for t in blocks)
        assert sum(t.nbytes for t in blocks + scales) * 8 == weights * 4.25
        assert stored <= lay.packed[i] < stored + 4096, (i, stored, lay.packed[i])
        total += sum(t.nbytes for t in mine.values())
        spans += sum(span.length for span in file_layout(mine)[1])  # the stored tensors' aligned covering spans
    m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk", experts="layers")
    try:
        assert m.plan.layer_bytes == lay.packed
        before = m.stats.streamed_bytes
        m(input_ids=torch.tensor([[1, 2, 3]]))
        read = m.stats.streamed_bytes - before  # whole layers: the spans over their stored tensors
        assert read == spans and total <= read < total + LAYERS * 8 * IO_ALIGN, (read, spans, total)
    finally:
        m.close()


def test_mxfp4_on_another_model_is_refused_in_one_line(tmp_path):
    from offload import OffloadError
    from offload.formats import open_checkpoint
    from tests.test_moe_families import make_moe

    path = make_moe("mixtral", tmp_path / "m", seed=1)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(OffloadError, match=r"MXFP4 is read for gpt-oss's experts only, not 'mixtral'") as exc:
        open_checkpoint(path)
    assert "\n" not in str(exc.value)


def test_plan_counts_the_dequantized_expert(mxfp4):
    """The plan's dequantization temporaries of an MXFP4 target: a routed expert's gate_up (hidden x 2I) twice in
    the compute dtype (dequantized, then laid out for x @ W); a 16-bit gpt-oss has none."""
    from offload.planning.membytes import arch_of, dequant_temp_bytes, target_kernel
    from offload.planning.memplan import PlanRequest

    target, _, _ = mxfp4
    cfg = json.loads((target / "config.json").read_text())
    req = PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=1 << 34)
    a = arch_of(cfg)
    assert target_kernel(a, req) == "mxfp4" and not a.packed
    assert dequant_temp_bytes(a, "mxfp4", 4, 4, "cpu") == 2 * cfg["hidden_size"] * 2 * cfg["intermediate_size"] * 4
    del cfg["quantization_config"]
    assert target_kernel(arch_of(cfg), req) == "none"


def test_specx_run_equals_transformers(mxfp4, tmp_path):
    """`specx run --offload disk --max-ram 0`, ar and specexec, through the CLI's own plan and dtype choice (an
    MXFP4 checkpoint is not a pre-quantized NF4 one): transformers' greedy ids (up to an EOS stop)."""
    run_streamed_equals(*mxfp4, tmp_path)
