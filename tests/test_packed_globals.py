"""`--embeddings packed`: a GGUF model's embeddings and output layer kept as their file bytes on the CPU.

The rows a PackedEmbedding looks up are the fp32 table's rows bit for bit; LeanHead's logits are the
packed kernel's (any batch) or, with the kernel off, the dequantized weight's up to fp32 rounding; a
model loaded with them decodes the ids it decodes with fp32 tables; the plan picks them on the CPU
only when RAM is short (so more layers stay resident) and refuses them, in one line, where the file
cannot keep them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from offload import OffloadedCausalLM
from offload.cpu import ggml_kernel
from offload.errors import OffloadError
from offload.formats import gguf_quants as gq
from offload.formats import open_checkpoint
from offload.formats.packed_globals import EMBED, LeanHead, PackedEmbedding, packed_globals_ok
from offload.planning import PlanRequest, plan_memory
from specexec_cli.core import kvcache
from tests.conftest import make_model
from tests.gguf_build import write_gguf

MIXES = {"Q8_0": ("Q8_0", None), "Q4_K_M": ("Q4_K", {"v_proj": "Q6_K", "down_proj": "Q6_K"})}


@pytest.fixture(scope="module", params=list(MIXES))
def tiny(request, tmp_path_factory):
    """A 3-layer, hidden-256 Llama (seed 7, untied head) as a GGUF of MIXES[param]."""
    root = tmp_path_factory.mktemp("packed")
    hf = make_model(root / "hf", seed=7, layers=3, hidden=256)
    qtype, mix = MIXES[request.param]
    return write_gguf(hf, root / "m" / f"tiny-{request.param}.gguf", qtype, mix=mix)


def _req(**kw) -> PlanRequest:
    return PlanRequest(
        **{"device": "cpu", "dtype": "fp32", "draft_dtype": None, "ram_free": 8 << 30, "ctx": 64, "budget": 8, **kw}
    )


def _raw(ck, name: str) -> tuple[torch.Tensor, int]:
    return ck.read(name), ck.tensors[name].meta["ggml_type"]


def test_embedding_rows_are_the_tables_rows(tiny):
    ck = open_checkpoint(tiny)
    raw, qtype = _raw(ck, EMBED)
    vocab, hidden = ck.logical_shape(EMBED)
    table = gq.dequantize(raw, qtype, (vocab, hidden))
    ids = torch.tensor([[0, 5, vocab - 1], [17, 17, 3]])
    rows = PackedEmbedding(raw, qtype, vocab, hidden)(ids)
    assert rows.shape == (2, 3, hidden) and torch.equal(rows, table[ids])


@pytest.mark.skipif(not ggml_kernel.enabled(), reason="no C compiler: the GGUF kernel is off")
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_lean_head_is_the_kernel_at_every_batch(tiny, rows, monkeypatch):
    ck = open_checkpoint(tiny)
    raw, qtype = _raw(ck, "lm_head.weight")
    out, inp = ck.logical_shape("lm_head.weight")
    head = LeanHead(raw, qtype, out, inp)
    x = torch.randn(1, rows, inp, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(head(x), ggml_kernel.linear(x, raw, qtype, out))  # above MAX_ROWS too: no fp32 copy
    dense = x @ gq.dequantize(raw, qtype, (out, inp)).T
    monkeypatch.setenv(ggml_kernel.ENV, "off")  # no kernel: weight row blocks dequantized per call
    assert torch.allclose(head(x), dense, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr("offload.formats.packed_globals.HEAD_BLOCK_ROWS", 100)  # several blocks
    assert torch.allclose(head(x), dense, atol=1e-4, rtol=1e-4)


def _greedy(model, n: int = 16) -> list[int]:
    cache, ids = kvcache.new_cache(), [5, 17, 29, 41]
    logits = kvcache.forward(model, cache, torch.tensor(ids), torch.arange(len(ids)), None, last_only=True)
    for _ in range(n):
        ids.append(int(logits[-1].argmax()))
        logits = kvcache.forward(model, cache, torch.tensor(ids[-1:]), torch.tensor([len(ids) - 1]), None)
    return ids


def _load(path, embeddings: str):
    plan = plan_memory(open_checkpoint(path), None, _req(embeddings=embeddings, offload="none"))
    assert plan.fits and plan.embeddings == embeddings, plan.reason
    return OffloadedCausalLM.from_pretrained(path, device="cpu", dtype=torch.float32, offload="none", memplan=plan)


def test_packed_globals_decode_the_same_ids(tiny):
    ids = {}
    for emb in ("device", "packed"):
        model = _load(tiny, emb)
        try:
            if emb == "packed":
                assert isinstance(model.embed_tokens, PackedEmbedding) and isinstance(model.lm_head, LeanHead)
                assert model.lm_head.weight is None  # no fp32 copy of the head
            ids[emb] = _greedy(model)
        finally:
            model.close()
    assert ids["packed"] == ids["device"]


@pytest.fixture(scope="module")
def big(tmp_path_factory, smollm2):
    """3 Llama-3-70B-shaped layers (Q4_K_M mix, 49k vocabulary: the bench's file takes SmolLM2's
    tokenizer table) as a sparse GGUF: real headers, holes for the weights."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import big_gguf

    return big_gguf.write_file(tmp_path_factory.mktemp("big") / "big.gguf", 3, 0, holes=True)["path"]


def test_the_plan_keeps_them_packed_only_where_ram_is_short(big):
    """Over a range of available RAM: fp32 tables where every layer fits beside them, packed ones
    wherever fp32 tables would leave a layer on disk or not fit at all; never fewer layers resident."""
    ck = open_checkpoint(big)
    assert packed_globals_ok(ck, "cpu", torch.float32) and not packed_globals_ok(ck, "cuda", torch.bfloat16)
    packed_bytes = ck.tensors[EMBED].nbytes + ck.tensors["lm_head.weight"].nbytes
    seen = set()
    for gib in (2.5, 3.0, 4.5, 6.0, 8.0, 16.0):
        device = plan_memory(ck, None, _req(embeddings="device", ram_free=int(gib * 2**30), ctx=512))
        auto = plan_memory(ck, None, _req(ram_free=int(gib * 2**30), ctx=512))
        short = not device.fits or bool(device.disk_layers)
        assert auto.fits and auto.embeddings == ("packed" if short else "device"), gib
        assert len(auto.resident) >= (len(device.resident) if device.fits else 0)
        if auto.embeddings == "packed":
            assert auto.device_bytes["embeddings"] + auto.device_bytes["lm_head"] == packed_bytes
        seen.add((auto.embeddings, bool(auto.disk_layers)))
    assert seen >= {("device", False), ("packed", False), ("packed", True)}


def test_packed_is_refused_where_the_file_cannot(tmp_path):
    hf = make_model(tmp_path / "hf", seed=3, layers=2, hidden=128)
    with pytest.raises(OffloadError, match="--embeddings packed needs a GGUF target"):
        plan_memory(open_checkpoint(hf), None, _req(embeddings="packed"))


def test_kernel_served_layers_reserve_no_dequantization_temporary(big, monkeypatch):
    """Every layer multiplied from its blocks at any batch (formats/qlinear.py): the plan's activations
    hold no fp32 copy of the largest linear, which a plan with the kernel off reserves."""
    from offload.planning import arch_of
    from offload.planning.membytes import dequant_temp_bytes

    ck = open_checkpoint(big)
    req = _req(ram_free=64 << 30, ctx=512)
    served = plan_memory(ck, None, req).device_bytes["activations"]
    monkeypatch.setenv(ggml_kernel.ENV, "off")
    dequantized = plan_memory(ck, None, req).device_bytes["activations"]
    assert dequantized - served == dequant_temp_bytes(arch_of(ck.config), "gguf", 4, 4, "cpu")
