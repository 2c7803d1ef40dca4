"""Pre-quantized bitsandbytes 4-bit checkpoints and the nf4 cache of 16-bit checkpoints.

Fixtures make the checkpoints with transformers + bitsandbytes on CPU (BitsAndBytesConfig,
save_pretrained) from tiny random models, so the format is transformers' own.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, DynamicCache

import offload.quant.quant_cache as qc
from offload import OffloadedCausalLM, OffloadError
from offload.arch.hfcompat import cache_kwargs
from tests.test_families import make_family

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
VOCAB = 48
Q4 = dict(intermediate_size=128)  # bitsandbytes' CPU kernel wants in_features % 64 == 0


def _bnb_save(src, out, quant_type="nf4", double=True, dtype=torch.float32):
    cfg = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=dtype,
    )
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg, dtype=dtype, device_map="cpu")
    model.save_pretrained(out)
    return out


@pytest.fixture(
    scope="module", params=[("llama31", "nf4", True), ("qwen2", "fp4", False)], ids=["llama-nf4-dq", "qwen2-fp4"]
)
def prequant_dir(request, tmp_path_factory):
    family, qtype, double = request.param
    root = tmp_path_factory.mktemp("prequant")
    src = make_family(family, root / "src", seed=11, **Q4)
    return _bnb_save(src, root / "q4", qtype, double)


def _hf_q(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map="cpu").eval()


def _ids(n, seed=0):
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, n):
    cache, out, x = DynamicCache(), [], ids
    for _ in range(n):
        x = model(input_ids=x, **cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)
        out.append(int(x))
    return out


@pytest.fixture()
def no_quantize(monkeypatch):
    """Any call into bitsandbytes' quantizer fails the test: packed bytes must be used as stored."""
    import bitsandbytes.functional as bnbf

    def boom(*a, **k):
        raise AssertionError("re-quantized a pre-quantized checkpoint")

    monkeypatch.setattr(bnbf, "quantize_4bit", boom)
    monkeypatch.setattr(qc, "quantize_nf4", boom)


@pytest.mark.parametrize("offload", ["none", "ram", "disk"])
def test_prequant_equals_transformers(prequant_dir, offload, no_quantize):
    hf = _hf_q(prequant_dir)
    model = OffloadedCausalLM.from_pretrained(prequant_dir, dtype=torch.float32, offload=offload)
    try:
        assert model.plan.tier == offload
        if offload == "disk":  # packed bytes land in the slot as read: no per-pass conversion
            assert all(not d.convert for d in model.store.disk.values())
        ids = _ids(12)
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, ref, atol=1e-5, rtol=0)
        prompt = _ids(4, seed=1)
        with torch.no_grad():
            want = hf.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert _greedy(model, prompt, 16) == want[0, 4:].tolist()
    finally:
        model.close()


def test_prequant_disk_streams_only_packed_bytes(prequant_dir):
    """A disk pass reads about the packed weight bytes (plus quant-state/alignment slack), far below
    what the same linears take in 16-bit."""
    model = OffloadedCausalLM.from_pretrained(prequant_dir, dtype=torch.float32, offload="disk")
    try:
        model(input_ids=_ids(3))
        packed = sum(s.nbytes for i in model.plan.disk_layers for s in model.store.disk[i].layout.slices.values())
        bf16 = 2 * 2 * packed  # two 4-bit codes per packed byte, two bytes per bf16 value
        assert model.stats.streamed_bytes_per_pass < packed + len(model.plan.disk_layers) * 3 * 4096
        assert packed < 0.3 * bf16
    finally:
        model.close()


def test_8bit_checkpoint_refused_by_name(prequant_dir, tmp_path):
    path = tmp_path / "q8"
    shutil.copytree(prequant_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(load_in_4bit=False, _load_in_4bit=False, load_in_8bit=True, _load_in_8bit=True)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(OffloadError, match=r"config\.json.*'bitsandbytes 8-bit' is not supported"):
        OffloadedCausalLM.from_pretrained(path)


# ---------------------------------------------------------------- the nf4 cache of 16-bit checkpoints


@pytest.fixture()
def bf16_dir(tmp_path):
    return make_family("qwen3", tmp_path / "bf16", seed=12, dtype=torch.bfloat16, **Q4)


def _count_quantize(monkeypatch):
    calls = []
    real = qc.quantize_nf4

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(qc, "quantize_nf4", counting)
    return calls


def test_cache_built_once_then_reused(bf16_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    calls = _count_quantize(monkeypatch)
    seen = []
    a = OffloadedCausalLM.from_pretrained(
        bf16_dir, dtype="nf4", offload="disk", progress=lambda d, t, what: seen.append(what)
    )
    n_linear = len(calls)
    assert n_linear == 3 * 7 and any("quantizing layer 2" in w for w in seen)
    (cache,) = (tmp_path / "cache").iterdir()
    assert (cache / qc.MANIFEST).exists() and not list((tmp_path / "cache").glob(".*tmp*"))
    b = OffloadedCausalLM.from_pretrained(bf16_dir, dtype="nf4", offload="disk")
    assert len(calls) == n_linear, "a warm cache must not quantize again"
    ids = _ids(9)
    torch.testing.assert_close(b(input_ids=ids).logits, a(input_ids=ids).logits, atol=0, rtol=0)
    assert all(not d.convert for d in b.store.disk.values())
    a.close()
    b.close()


def test_stale_or_partial_cache_is_rebuilt(bf16_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    calls = _count_quantize(monkeypatch)
    first = qc.ensure_nf4_cache(bf16_dir)
    built = len(calls)
    # partial: a shard cut short after the manifest was written (or a crash mid-write)
    shard = sorted(first.glob("model-*.safetensors"))[0]
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 10)
    assert not qc.is_complete(first, qc.cache_key(bf16_dir))
    assert qc.ensure_nf4_cache(bf16_dir) == first and len(calls) == 2 * built
    assert qc.is_complete(first, qc.cache_key(bf16_dir))
    # stale: the source changes (new mtime) -> new key, rebuilt, the old cache removed
    src = bf16_dir / "model.safetensors"
    os.utime(src, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns + 10**9))
    second = qc.ensure_nf4_cache(bf16_dir)
    assert second != first and len(calls) == 3 * built and not first.exists()
    # a directory without the manifest is never used
    (second / qc.MANIFEST).unlink()
    assert not qc.is_complete(second)


def _tensors(path):
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("model-*.safetensors")) for k, v in load_file(f).items()}


def test_cache_packed_for_the_cpu_kernel_holds_moved_nibbles(bf16_dir, tmp_path, monkeypatch):
    """A CPU_PACKING cache stores each fitting linear's bytes exactly as cpu_relayout moves the
    standard bytes (the layout Linear4bit makes at its first CPU forward); everything else equal."""
    from offload.formats.st_index import SafetensorsIndex
    from offload.quant import nf4

    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    std, packed = tmp_path / "std", qc.ensure_nf4_cache(bf16_dir, packing=nf4.CPU_PACKING)
    qc.write_quantized(bf16_dir, std)
    assert packed != qc.cache_dir(bf16_dir) and qc.is_complete(packed, qc.cache_key(bf16_dir, nf4.CPU_PACKING))
    assert json.loads((packed / "config.json").read_text())["specx_packing"] == nf4.CPU_PACKING
    assert "specx_packing" not in json.loads((std / "config.json").read_text())
    src, a, b = SafetensorsIndex(bf16_dir).entries, _tensors(std), _tensors(packed)
    assert a.keys() == b.keys()
    moved = 0
    for name, t in a.items():
        shape = tuple(src[name].shape) if name in src else ()
        if t.dtype == torch.uint8 and len(shape) == 2 and shape[0] % 32 == 0 and shape[1] % 64 == 0:
            assert torch.equal(b[name], nf4.cpu_relayout(t, shape).reshape(t.shape)) and not torch.equal(b[name], t)
            moved += 1
        else:
            assert torch.equal(b[name], t), name
    assert moved == 3 * 7


@pytest.mark.skipif(
    __import__("offload.quant.nf4", fromlist=["x"]).packing_for("cpu") == "standard",
    reason="bitsandbytes has no fused AVX512-BF16 CPU kernel on this CPU",
)
@pytest.mark.parametrize("offload", ["none", "ram", "disk"])
def test_kernel_packed_cache_streams_without_relayout(bf16_dir, tmp_path, monkeypatch, offload):
    """On a CPU where Linear4bit uses the fused kernel, `--dtype nf4` streams the kernel-packed
    cache: no byte moves after a disk read, and logits equal the standard 4-bit checkpoint's
    (whose bytes are re-laid out after each read) bit for bit. Elsewhere it is refused by name."""
    import offload.stream.model as om

    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    std = tmp_path / "std"
    qc.write_quantized(bf16_dir, std)
    ids = _ids(9)
    a = OffloadedCausalLM.from_pretrained(std, dtype="nf4", offload=offload)
    want = [a(input_ids=ids).logits for _ in range(2)]
    a.close()

    def no_relayout(*args):
        raise AssertionError("a kernel-packed layer was re-laid out")

    monkeypatch.setattr(om, "cpu_relayout", no_relayout)
    b = OffloadedCausalLM.from_pretrained(bf16_dir, dtype="nf4", offload=offload)
    assert b.packing == "bnb-cpu-avx512bf16" and bool(b.plan.streamed) == (offload != "none")
    for w in want:  # two passes: the second streams from the read-ahead ring
        torch.testing.assert_close(b(input_ids=ids).logits, w, atol=0, rtol=0)
    b.close()
    monkeypatch.setattr(om, "packing_for", lambda device: "standard")
    with pytest.raises(OffloadError, match="packed for bnb-cpu-avx512bf16"):
        OffloadedCausalLM.from_pretrained(qc.cache_dir(bf16_dir, "bnb-cpu-avx512bf16"), dtype="nf4")


def test_quantized_checkpoint_loads_in_transformers(bf16_dir, tmp_path):
    """`write_quantized` output (what `specx quantize` writes): transformers and specx agree."""
    out = tmp_path / "out"
    qc.write_quantized(bf16_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    hf = _hf_q(out, dtype=torch.bfloat16)
    assert isinstance(hf.model.layers[0].mlp.up_proj, __import__("bitsandbytes").nn.Linear4bit)
    model = OffloadedCausalLM.from_pretrained(out, dtype=torch.bfloat16, offload="disk")
    try:
        ids = _ids(10)
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, ref, atol=0, rtol=0)
        prompt = _ids(4, seed=2)
        with torch.no_grad():
            want = hf.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert _greedy(model, prompt, 12) == want[0, 4:].tolist()
    finally:
        model.close()
    assert transformers is not None


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_specx_run_on_prequant_target(prequant_dir, offload, tmp_path):
    """`specx run`: ar ids == transformers' greedy generate of the 4-bit checkpoint; specexec == ar."""
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app
    from tests.conftest import make_tokenizer

    target, draft = tmp_path / "t", tmp_path / "d"
    shutil.copytree(prequant_dir, target)
    shutil.copytree(prequant_dir.parent / "src", draft)  # the 16-bit model it was quantized from
    for path in (target, draft):
        make_tokenizer().save_pretrained(path)
    prompt = tmp_path / "p.txt"
    prompt.write_text("def area(r):\n  return 3.14 * r")
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
                "16",
                "--stats-json",
                str(stats),
            ],
        )
        assert r.exit_code == 0, r.output
        ids[method] = json.loads(stats.read_text())["token_ids"]
    tok = transformers.AutoTokenizer.from_pretrained(target)
    prompt_ids = torch.tensor([tok(prompt.read_text())["input_ids"]])
    with torch.no_grad():
        want = _hf_q(target).generate(prompt_ids, max_new_tokens=16, do_sample=False)
    assert ids["ar"] == want[0, prompt_ids.shape[1] :].tolist()[: len(ids["ar"])]
    assert ids["specexec"] == ids["ar"]


@pytest.mark.parametrize("shape", [(64, 128), (96, 64), (256, 192)])
def test_cpu_relayout_equals_bitsandbytes(shape):
    """The byte-op re-layout for bnb's AVX512-BF16 CPU kernel equals bnb's own converter."""
    import copy

    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    from offload.quant.nf4 import cpu_relayout, cpu_state, quantize_nf4

    torch.manual_seed(shape[0])
    packed, state = quantize_nf4(torch.randn(*shape, dtype=torch.bfloat16), torch.device("cpu"))
    want_w, want_s = _convert_weight_packed_for_cpu(packed.clone(), copy.copy(state))
    got_s = cpu_state(state)
    assert torch.equal(cpu_relayout(packed, shape), want_w)
    assert torch.equal(got_s.absmax, want_s.absmax) and got_s.dtype == want_s.dtype and got_s.packing_format_for_cpu
    assert state.nested and not got_s.nested  # the original state is untouched
