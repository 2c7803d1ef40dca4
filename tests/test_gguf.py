"""GGUF checkpoints (offload/formats/gguf.py): opened once from metadata, streamed as stored.

Oracle: transformers loading the same file (`from_pretrained(dir, gguf_file=)`): its config, and
its logits, which specx's must equal bitwise (fp32) with every layer resident, in RAM and on disk.
Also: the disk tier reads each layer's GGUF bytes once per pass (within 3%), every tensor handed
to a layer is 256-byte aligned although GGUF aligns to 32, split files, ollama names (read-only
manifests under $OLLAMA_MODELS), metadata (template, stops, sampling), one-line errors, and a
sparse real-sized Llama-3.1-70B Q4_K_M that plans at 24 GB and that `specx info` describes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from offload import OffloadError
from offload.formats import open_checkpoint
from offload.formats.gguf import READER
from tests.conftest import make_model
from tests.gguf_build import write_gguf, write_sparse_llama

GB = 1024**3
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
IDS = torch.tensor([[1, 5, 9, 3, 22, 7, 7, 30]])


@pytest.fixture(autouse=True)
def _dequantizing_path(monkeypatch):
    """Bitwise oracles here: the dequantize-then-matmul path (the CPU kernel for small batches,
    offload/cpu/ggml_kernel.py, differs in fp32 rounding order: tests/test_ggml_kernel.py)."""
    monkeypatch.setenv("SPECX_GGUF_KERNEL", "off")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    hf = make_model(root / "hf", seed=7, layers=2, hidden=256)
    f = write_gguf(
        hf, root / "m" / "tiny-q8_0.gguf", "Q8_0", chat_template=TEMPLATE, sampling={"temp": 0.6, "top_k": 20}
    )
    return hf, f


def _hf_logits(f: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32)
    with torch.no_grad():
        return ref(input_ids=IDS).logits


def _specx(f, offload: str):
    from offload.stream.model import OffloadedCausalLM

    return OffloadedCausalLM.from_pretrained(f, device="cpu", dtype=torch.float32, offload=offload)


def test_open_reads_metadata(tiny):
    from transformers import AutoConfig

    _, f = tiny
    ck = open_checkpoint(f)
    assert ck.format == "gguf" and ck.reader is READER and ck.files == [f]
    ref = AutoConfig.from_pretrained(f.parent, gguf_file=f.name).to_dict()
    got = ck.hf_config.to_dict()
    assert {k: v for k, v in got.items() if k != "_name_or_path"} == {
        k: v for k, v in ref.items() if k != "_name_or_path"
    }
    assert ck.chat_template == TEMPLATE
    assert ck.generation["eos_token_id"] == 0 and ck.generation["top_k"] == 20 and ck.generation["do_sample"]
    assert abs(ck.generation["temperature"] - 0.6) < 1e-6
    assert ck.quant["bytes_by_type"]["Q8_0"] > 0 and ck.config["quantization_config"]["quant_method"] == "gguf"
    q = ck.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.qtype == "Q8_0" and q.dtype == torch.uint8 and q.meta["permute"] == 4
    assert ck.tensors["model.layers.0.input_layernorm.weight"].qtype is None  # F32 norms stay plain
    assert set(ck.packed) == {n for n, t in ck.tensors.items() if t.qtype is not None}
    assert any(t.begin % 256 for t in ck.tensors.values())  # GGUF's own 32-byte grid: re-laid by the loader
    tok = ck.load_tokenizer()
    assert tok.convert_ids_to_tokens(5) == "x5" and tok("ab")["input_ids"][-1] == 3


@pytest.mark.parametrize("offload", ["none", "ram", "disk"])
def test_logits_equal_transformers(tiny, offload):
    _, f = tiny
    model = _specx(f, offload)
    try:
        with torch.no_grad():
            got = model(input_ids=IDS).logits
        assert torch.equal(got, _hf_logits(f))
        for i in model.plan.streamed:  # a packed layout on the 256-byte grid; a CPU's disk layer on GGUF's own
            # 32-byte grid, computed where it was read (storage.CPU_ALIGN: no re-layout copy each pass)
            on_file = i in model.store.disk
            assert all(s.offset % (32 if on_file else 256) == 0 for s in model.store.layout(i).slices.values())
            assert not on_file or model.store.layout(i) is model.store.disk[i].raw
        if offload == "disk":
            layer_bytes = sum(model.checkpoint.layer_bytes(i) for i in model.plan.streamed)
            per_pass = model.stats.streamed_bytes_per_pass
            assert layer_bytes <= per_pass <= 1.03 * layer_bytes, (per_pass, layer_bytes)
    finally:
        model.close()


def test_split_file_equals_single(tiny, tmp_path):
    hf, f = tiny
    first = write_gguf(hf, tmp_path / "split.gguf", "Q8_0", split=3)
    ck = open_checkpoint(first)
    assert [p.name for p in ck.files] == [f"split-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    model = _specx(first, "disk")
    try:
        with torch.no_grad():
            assert torch.equal(model(input_ids=IDS).logits, _hf_logits(f))
    finally:
        model.close()
    ck.files[1].unlink()
    with pytest.raises(OffloadError, match="part 2 of 3"):
        open_checkpoint(first)


def _ollama_store(root: Path, blob_src: Path, params: dict) -> Path:
    def put(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "blobs" / f"sha256-{digest}").write_bytes(data)
        return f"sha256:{digest}"

    layers = [
        {"mediaType": "application/vnd.ollama.image.model", "digest": put(blob_src.read_bytes())},
        {"mediaType": "application/vnd.ollama.image.params", "digest": put(json.dumps(params).encode())},
    ]
    man = root / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q8"
    man.parent.mkdir(parents=True)
    man.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return root


def test_general_sampling_is_the_files_default_sampling(tiny):
    """A GGUF's general.sampling.* are its sampling defaults, as generation_config.json's are (and as
    llama.cpp applies them): run/chat and serve sample with them where no flag or request says else."""
    from specexec_cli.core.sampling import SamplingParams
    from specexec_cli.session.gendefaults import checkpoint_sampling, generation_of, serve_sampling
    from specexec_cli.session.modelref import ModelRef

    _, f = tiny
    gen = generation_of(ModelRef("--target", str(f)))
    got = checkpoint_sampling(gen), serve_sampling(gen)
    assert [(round(p.temperature, 4), p.top_k, p.top_p) for p in got] == [(0.6, 20, 1.0)] * 2
    assert checkpoint_sampling({k: v for k, v in gen.items() if k != "do_sample"}) == SamplingParams()


def test_ollama_name(tiny, tmp_path, monkeypatch):
    from offload.formats import ollama

    _, f = tiny
    root = _ollama_store(tmp_path / "ollama", f, {"temperature": 0.3, "stop": ["<user>"]})
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    assert ollama.resolve("tiny:latest") is None and ollama.resolve("not a name!") is None
    ck = READER.open_ollama("tiny:q8")
    assert ck.format == "gguf" and ck.files[0].parent == root / "blobs"
    assert ck.generation["temperature"] == 0.3 and ck.generation["stop_strings"] == ["<user>"]
    from specexec_cli.session.names import resolve_path

    assert resolve_path("library/tiny:q8", "--target") == ck.files[0]
    # the name's params are its sampling defaults (as ollama runs it): temperature 0.3 over the file's 0.6
    from specexec_cli.session.gendefaults import checkpoint_sampling, generation_of
    from specexec_cli.session.modelref import ModelRef

    got = checkpoint_sampling(generation_of(ModelRef("--target", "tiny:q8")))
    assert (round(got.temperature, 4), got.top_k) == (0.3, 20)
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before  # read-only
    ck.files[0].unlink()
    with pytest.raises(OffloadError, match="missing; re-pull"):
        ollama.resolve("tiny:q8")


def test_ollama_stop_strings_that_are_control_tokens_end_as_eos(smollm2):
    """An ollama params' stop string that is one control token ("<|im_start|>", id 1 in SmolLM2's file) ends
    generation by its id, as EOS does (its text is never shown); the others stay text stops."""
    gen = READER.open(smollm2, ollama_params={"stop": ["<|im_start|>", "User:", 7]}).generation
    assert gen["eos_token_id"] == [2, 1] and gen["stop_strings"] == ["User:"]
    plain = READER.open(smollm2).generation
    assert plain["eos_token_id"] == 2 and "stop_strings" not in plain


def test_unsupported_arch_and_missing_tokenizer(tiny, tmp_path):
    hf, _ = tiny
    with pytest.raises(OffloadError, match="architecture 'bert' is not supported"):
        open_checkpoint(write_gguf(hf, tmp_path / "bert.gguf", "Q8_0", arch="bert"))
    with pytest.raises(OffloadError, match=r"no tokenizer in its metadata"):
        open_checkpoint(write_gguf(hf, tmp_path / "notok.gguf", "Q8_0", tokenizer=False))


def test_directory_holding_one_gguf(tiny, tmp_path):
    _, f = tiny
    d = tmp_path / "dir"
    d.mkdir()
    shutil.copy(f, d / f.name)
    assert open_checkpoint(d).files == [d / f.name]
    shutil.copy(f, d / "other.gguf")
    with pytest.raises(OffloadError, match="holds 2 GGUF models"):
        open_checkpoint(d)


@pytest.fixture(scope="module")
def sparse70(tmp_path_factory):
    return write_sparse_llama(tmp_path_factory.mktemp("s70") / "Llama-3.1-70B-Instruct-Q4_K_M.gguf", tokens=2048)


def test_sparse_70b_q4_k_m_plans_at_24gb(sparse70):
    from offload.planning.memplan import PlanRequest, plan_memory

    assert sparse70.stat().st_blocks * 512 < 64 << 20  # a hole: no tensor data on disk
    ck = open_checkpoint(sparse70)
    assert ck.quant["file_type"] == "Q4_K_M" and ck.num_layers == 80 and ck.hf_config.vocab_size == 128256
    stored = [ck.layer_bytes(i) for i in range(80)]
    assert 0.45 * GB < stored[0] < 0.55 * GB  # ~42.5 GB over 80 layers, as stored
    req = PlanRequest(
        device="cuda", dtype="bf16", draft_dtype=None, ram_free=200 * GB, device_free=24 * GB, ctx=4096, budget=64
    )
    plan = plan_memory(ck, None, req)
    assert plan.fits, plan.reason
    norms_f32_to_bf16 = 2 * 8192 * (4 - 2)  # the two F32 norms of a layer are kept in bf16
    assert all(0 <= b - (s - norms_f32_to_bf16) <= 256 * 16 for s, b in zip(stored, plan.layer_bytes))
    assert sum(plan.device_bytes.values()) <= 24 * GB
    assert plan.device_bytes["staging_slots"] >= 2 * max(plan.layer_bytes)  # two streamed layers in flight
    assert plan.device_bytes["activations"] >= 28672 * 8192 * 2  # the largest linear dequantized in bf16
    for comp in ("lm_head", "kv_target", "cuda_context"):
        assert plan.device_bytes[comp] > 0, comp


def test_specx_info_describes_sparse_70b(sparse70):
    from specexec_cli.session.info import describe, rows

    info = describe(str(sparse70))
    assert info.runnable, info.reason
    assert (info.format, info.family, info.layers, info.vocab) == ("gguf", "llama", 80, 128256)
    table = dict(rows(info))
    assert table["specx can run it"] == "yes" and "gguf" in table["format"]
    assert table["quantization"] == "quant_method=gguf, file_type=Q4_K_M"


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    """A Llama-3.1-style file's rope_freqs tensor is read as HF's llama3 RoPE scaling: the rotary's
    inverse frequencies are llama.cpp's (base / rope_freqs), logits equal transformers' model of the
    same weights with that scaling; a rope_freqs that is not llama3's is refused in one line."""
    import numpy as np

    from offload.formats.gguf import llama3_factors

    hf = make_model(tmp_path / "hf", seed=11, layers=1, hidden=256)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(
        json.dumps(dict(cfg, rope_theta=500000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    )
    freqs = np.array(llama3_factors(500000.0, 64, 8.0, 1.0, 4.0, 8192), dtype=np.float32)
    assert len(set(freqs.tolist())) > 2  # short, long and smoothed wavelengths
    f = write_gguf(hf, tmp_path / "l3.gguf", "Q8_0", extra={"rope_freqs.weight": freqs})
    ck = open_checkpoint(f)
    assert ck.hf_config.rope_parameters["rope_type"] == "llama3" and ck.hf_config.rope_parameters["factor"] == 8.0
    model = _specx(f, "none")
    try:
        plain = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
        assert torch.allclose(model.rotary_emb.inv_freq, plain / torch.from_numpy(freqs), rtol=1e-6)
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32)
        ref.model.rotary_emb = type(ref.model.rotary_emb)(ck.hf_config)
        with torch.no_grad():
            assert torch.equal(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
    finally:
        model.close()
    bad = write_gguf(hf, tmp_path / "bad.gguf", "Q8_0", extra={"rope_freqs.weight": freqs[::-1].copy()})
    with pytest.raises(OffloadError, match="not Llama-3's RoPE scaling"):
        open_checkpoint(bad)
