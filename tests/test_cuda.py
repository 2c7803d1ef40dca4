"""GPU checks (marked `cuda`, skipped without CUDA): exactness, overlap, no host sync, memory peak;
with 70B-shaped heads (head_dim 128, 8:1 GQA, a 128k vocabulary, scaled down in width): tree masks
against HF without repeated K/V, the self-draft at 4 and 2 bits, T > 0 equal to ar for a seed, one served request.

Models are conftest Llamas with hidden 2048 (one layer = 37.7M parameters: 75 MB in bf16, so every
streamed layer is >= 64 MB; nf4 layers are the same weights packed). Timings use CUDA events.
Token-equality tests (specexec == ar) run in fp32 with TF32 off: in bf16 (or TF32) the M = 1 and M = n
GEMMs and the two attention paths differ by an ulp, and a near-tie flips a token without any bug.
The tree-mask comparison pins one SDPA backend for both sides. The peak-memory test also runs at a
70B layer's real shape (hidden 8192, MLP 28672, 64 heads of 128, 8 KV heads), where the plan's
activation and staging terms are at scale.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from offload import OffloadedCausalLM
from offload.stream.timing import device_seconds
from tests.conftest import CHARS, make_model
from tests.probes import after_each_layer

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HIDDEN, LAYERS = 2048, 8   # 8 layers: the pipeline fill (one layer's copy) is 1/8 of a pass


@pytest.fixture
def exact_fp32():
    """fp32 matmuls without TF32 for the test's duration (equality of token ids across GEMM shapes)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def big_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("cuda") / "big", seed=3, layers=LAYERS, hidden=HIDDEN, max_pos=4096)


def load(path, dtype, offload, **kw):
    return OffloadedCausalLM.from_pretrained(path, device="cuda", dtype=dtype, offload=offload, **kw)


def ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, len(CHARS), (1, n), generator=g).cuda()   # ids of the test vocabulary (45)


@pytest.mark.parametrize("dtype", ["bf16", "nf4"])
@pytest.mark.parametrize("tier", [{"offload": "ram", "max_device_memory": 0},
                                  {"offload": "disk", "max_device_memory": 0, "max_host_memory": 0}])
def test_streamed_logits_equal_resident(big_dir, dtype, tier):
    resident = load(big_dir, dtype, "none")
    streamed = load(big_dir, dtype, **tier)
    try:
        assert resident.plan.streamed == [] and len(streamed.plan.streamed) == LAYERS
        assert min(streamed.plan.layer_bytes) >= (64 << 20) // (4 if dtype == "nf4" else 1)
        x = ids(37)
        with torch.no_grad():
            for _ in range(2):   # second pass: slots reused, buffers recycled
                a, b = resident(input_ids=x).logits, streamed(input_ids=x).logits
                torch.testing.assert_close(b, a, atol=0, rtol=0)
    finally:
        resident.close()
        streamed.close()


def _event_ms(fn) -> float:
    return device_seconds(fn, torch.device("cuda")) * 1000


def _cycles_per_ms() -> float:
    n = 5_000_000
    torch.cuda._sleep(n)   # warm-up
    return n / _event_ms(lambda: torch.cuda._sleep(n))


def test_streamed_pass_overlaps_copy_and_compute(big_dir):
    """A RAM-tier pass costs about max(compute, copy), not their sum. Each layer's compute is
    padded with a GPU spin kernel (torch.cuda._sleep in a forward hook on each layer, tests/probes.py) to last as
    long as that layer's copy, so a serial pass would take twice the floor."""
    resident = load(big_dir, "bf16", "none")
    streamed = load(big_dir, "bf16", "ram", max_device_memory=0)
    try:
        x = ids(64)
        arenas = [streamed.store.ram[i][0] for i in streamed.plan.streamed]
        dst = torch.empty(max(a.numel() for a in arenas), dtype=torch.uint8, device="cuda")
        copy_all = lambda: [dst[: a.numel()].copy_(a, non_blocking=True) for a in arenas]  # noqa: E731
        copy_all()
        copy = min(_event_ms(copy_all) for _ in range(5))
        cycles = int(copy / LAYERS * _cycles_per_ms())
        for m in (resident, streamed):
            after_each_layer(m, lambda i: torch.cuda._sleep(cycles))
        with torch.no_grad():
            for _ in range(3):
                resident(input_ids=x), streamed(input_ids=x)
            compute = min(_event_ms(lambda: resident(input_ids=x)) for _ in range(5))
            passes = []
            for _ in range(5):
                t0 = time.perf_counter()
                streamed(input_ids=x)
                torch.cuda.synchronize()
                passes.append(1000 * (time.perf_counter() - t0))
        floor = max(compute, copy)
        assert 0.5 < compute / copy < 2.0, (compute, copy)   # the padding worked: both terms matter
        assert min(passes) <= 1.3 * floor + 2.0, (min(passes), compute, copy)
    finally:
        resident.close()
        streamed.close()


@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_no_device_wide_sync_in_a_streamed_pass(big_dir, monkeypatch):
    model = load(big_dir, "bf16", "ram", max_device_memory=0)
    try:
        x = ids(16)
        with torch.no_grad():
            model(input_ids=x)   # warm-up: allocator, kernels, prefetch thread
            calls = []
            monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(a))
            torch.cuda.set_sync_debug_mode("error")   # any host-blocking CUDA call raises
            try:
                out = model(input_ids=x).logits
            finally:
                torch.cuda.set_sync_debug_mode(0)
        assert calls == [] and out.is_cuda
    finally:
        model.close()


def _peak_within_plan(target, draft, budget: int, max_depth: int, new_tokens: int, short: float = 1.5) -> None:
    """CLI path on the GPU with target layers streamed (a cap `short` layers under the all-resident
    plan): counted bytes equal the plan and the allocator's peak stays inside it."""
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import DecodeState, GenerationConfig, generate
    from specexec_cli.session.loading import LoadOptions, close_models, load_models
    from specexec_cli.session.planning import make_plan

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    opts = LoadOptions(target=str(target), draft=str(draft), dtype="bf16", device="cuda", offload="auto", ctx=1024)
    shape = TreeShape(budget=budget, max_depth=max_depth, max_beams=8)
    roomy = make_plan(replace(opts, max_gpu_memory=None), shape, budget_auto=False)
    assert not roomy.ram_layers and not roomy.disk_layers
    cap = roomy.device_total - int(short * roomy.layer_bytes[0])   # some layers must stream
    opts = replace(opts, max_gpu_memory=cap)
    plan = make_plan(opts, shape, budget_auto=False)
    assert plan.fits, plan.reason
    assert plan.ram_layers and plan.device_total <= cap
    models = load_models(replace(opts, plan=plan))
    try:
        cfg = GenerationConfig(method="specexec", shape=shape, max_new_tokens=new_tokens)
        list(generate(models, DecodeState(), list(range(1, 40)) * 8, cfg))
        torch.cuda.synchronize()
        for comp in ("embeddings", "lm_head", "resident_layers", "staging_slots", "draft", "kv_target", "kv_draft"):
            assert models.pool.by_component.get(comp, 0) == plan.device_bytes[comp], comp
        peak = torch.cuda.max_memory_allocated() - base
        # The caching allocator rounds every block up to a multiple of 512 bytes (allocated stats
        # count the rounded size): allow that per counted buffer, plus 2 MiB for transient tensors.
        slack = 512 * models.pool.count + 2 * 1024**2
        assert peak <= plan.device_total - plan.device_bytes["cuda_context"] + slack, (peak, slack, plan.to_json())
    finally:
        close_models(models)


def test_device_memory_peak_within_plan(big_dir, tmp_path):
    draft = make_model(tmp_path / "draft", seed=4, layers=2, hidden=256, max_pos=4096)
    _peak_within_plan(big_dir, draft, budget=64, max_depth=8, new_tokens=24)


def test_device_memory_peak_within_plan_at_70b_layer_shape(tmp_path):
    """The same at a 70B layer's real shape (3 layers of 1.7 GB in bf16, a 32000 vocabulary) with a
    256-node tree: the plan's activation, attention and staging terms at the scale they are for."""
    from tools.gpuday import stack

    dev = torch.device("cuda")
    target = stack.write_bf16(tmp_path / "t70", stack.TARGET, 3, dev)
    draft_shape = dict(stack.DRAFT, intermediate_size=2048)
    draft = stack.write_bf16(tmp_path / "d", draft_shape, 2, dev, seed=1)
    # Streaming k of the 3 layers through 2 staging slots saves k - 2 layers: a cap half a layer
    # short streams all three (1.5 layers short, as above, cannot fit at all).
    _peak_within_plan(target, draft, budget=256, max_depth=16, new_tokens=8, short=0.5)


@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_no_uncounted_sync_in_a_speculative_step(big_dir, tmp_path, monkeypatch):
    """One whole speculative step (draft tree, the streamed target pass, acceptance, cache trims) under
    torch.cuda.set_sync_debug_mode("error"): every host-blocking call raises, except inside the
    counted doors of core/transfers.py (to_host / upload), where a copy blocks by design and is counted."""
    import sys

    from specexec_cli.core import transfers
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import DecodeState, GenerationConfig, generate
    from specexec_cli.session.loading import LoadOptions, close_models, load_models

    draft = make_model(tmp_path / "draft", seed=4, layers=2, hidden=256, max_pos=4096)
    models = load_models(LoadOptions(str(big_dir), str(draft), dtype="fp32", device="cuda", offload="disk",
                                     max_ram=0))
    def excused(fn):
        def door(*a, **k):
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        return door

    for name in ("to_host", "upload"):   # wherever a module bound the door by name
        real = getattr(transfers, name)
        for mod in [m for n, m in sys.modules.items() if n.startswith(("specexec_cli", "offload")) and m]:
            if getattr(mod, name, None) is real:
                monkeypatch.setattr(mod, name, excused(real))
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(a))
    cfg = GenerationConfig(method="specexec", shape=TreeShape(budget=64, max_depth=8), max_new_tokens=64)
    events = generate(models, DecodeState(), list(range(1, 40)) * 4, cfg)
    try:
        next(events), next(events)   # prefill and a first step: allocations, kernels, the prefetch ring
        before = transfers.snapshot()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ev = next(events)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        counted = transfers.since(before)
        assert ev.pass_index == 2 and syncs == [] and counted.calls >= 2, counted   # it ran, through the doors
    finally:
        events.close()
        close_models(models)


# -- 70B-shaped layers, scaled down in width and depth: head_dim 128, 8:1 GQA, a 128k vocabulary ---------
GQA = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=1, head_dim=128,
           vocab_size=128256)


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    """A seeded random Llama with a 70B layer's head geometry (bf16 on disk, 4 layers) and the test tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import make_tokenizer

    path = tmp_path_factory.mktemp("cuda-gqa") / "m"
    torch.manual_seed(5)
    cfg = LlamaConfig(num_hidden_layers=4, max_position_embeddings=4096, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0, tie_word_embeddings=False, **GQA)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():   # peakier distributions, as conftest's models
            p.mul_(3.0)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


def _tree_inputs(past: int, device):
    parents = [-1, 0, 0, 1, 1, 2, 5, 6]
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    n = len(parents)
    mask = torch.full((1, 1, n, past + n), torch.finfo(torch.float32).min, device=device)
    mask[..., :past] = 0
    for i in range(n):
        j = i
        while j >= 0:
            mask[0, 0, i, past + j] = 0
            j = parents[j]
    ids_ = torch.tensor([[3, 5, 7, 9, 11, 13, 15, 17]], device=device)
    return ids_, torch.tensor([depth], device=device) + past, mask


def test_gqa_tree_mask_streamed_equals_hf(gqa_dir, monkeypatch):
    """Streamed 8:1-GQA target under a tree mask (fp32): logits equal HF's own sdpa model's, and
    transformers' repeat_kv is never called on our path."""
    import transformers.integrations.sdpa_attention as hf_sdpa
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import DynamicCache, LlamaForCausalLM

    from offload.arch.hfcompat import cache_kwargs

    hf = LlamaForCausalLM.from_pretrained(gqa_dir, dtype=torch.float32, attn_implementation="sdpa").cuda().eval()
    ours = load(gqa_dir, "fp32", "disk", max_device_memory=0, max_host_memory=0)
    prefix = ids(300)
    try:
        logits = []
        for model in (hf, ours):
            cache = DynamicCache(config=model.config)
            with torch.no_grad(), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                # the causal prefix: HF asks SDPA for enable_gqa there, which the memory-efficient
                # kernel lacks, so the math kernel may take it (fp32: equal to well inside the tolerance)
                model(input_ids=prefix, use_cache=True, **cache_kwargs(model, cache))
            with torch.no_grad(), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):   # the tree: one kernel both sides
                x, pos, mask = _tree_inputs(prefix.shape[1], "cuda")
                logits.append(model(input_ids=x, position_ids=pos, attention_mask=mask, use_cache=True,
                                    **cache_kwargs(model, cache)).logits)
            if model is hf:
                monkeypatch.setattr(hf_sdpa, "repeat_kv",
                                    lambda *a, **k: (_ for _ in ()).throw(AssertionError("repeat_kv")))
        torch.testing.assert_close(logits[1], logits[0], rtol=2e-4, atol=2e-4)
    finally:
        ours.close()


def _models(path, draft, **kw):
    """fp32 (the tests that use it compare token ids; see the module docstring)."""
    from specexec_cli.session.loading import LoadOptions, load_models

    return load_models(LoadOptions(str(path), draft, dtype="fp32", device="cuda", offload="disk", max_ram=0, **kw))


def _ids(models, method: str, temperature: float = 0.0, seed: int = 0, n: int = 24) -> list[int]:
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import DecodeState, GenerationConfig
    from specexec_cli.core.methods import generate
    from specexec_cli.core.sampling import SamplingParams

    cfg = GenerationConfig(method=method, shape=TreeShape(budget=64, max_depth=16), max_new_tokens=n,
                           sampling=SamplingParams(temperature), seed=seed)
    return [t for ev in generate(models, DecodeState(), [3, 5, 7, 9, 11], cfg) for t in ev.tokens]


@pytest.mark.parametrize("bits", [4, 2])
def test_self_draft_on_gpu_is_lossless(gqa_dir, bits, exact_fp32):
    """--draft self at 4 (NF4) and 2 (HQQ, fused substitutes) bits: specexec's ids equal ar's at T = 0."""
    from offload.quant.fused import fused_status

    models = _models(gqa_dir, "self", draft_bits=bits)
    assert models.draft is not None and models.draft.substitute_bits == bits
    assert _ids(models, "specexec") == _ids(models, "ar")
    assert fused_status() is None, fused_status()   # the compiled substitute path ran on CUDA


def test_sampled_specexec_equals_ar_for_a_seed(gqa_dir, exact_fp32):
    """T = 0.7: the race noise is shared by draft and target on the device, so specexec emits ar's ids."""
    models = _models(gqa_dir, "self", draft_bits=4)
    for seed in (1, 2):
        assert _ids(models, "specexec", 0.7, seed) == _ids(models, "ar", 0.7, seed)


def test_one_served_request(gqa_dir, tmp_path):
    from tests.serve_util import Server

    srv = Server.start(["--target", str(gqa_dir), "--draft", "self", "--dtype", "bf16", "--device", "cuda",
                        "--offload", "disk", "--max-ram", "0", "--budget", "32", "--max-new-tokens", "8",
                        "--model-name", "gqa"], tmp_path, timeout=600)
    try:
        status, _, body = srv.http("POST", "/v1/chat/completions",
                                   {"model": "gqa", "messages": [{"role": "user", "content": "def f(x):"}],
                                    "temperature": 0, "max_tokens": 8}, timeout=300)
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] is not None and body["usage"]["completion_tokens"] >= 1
    finally:
        assert srv.stop() == 0, srv.stderr()
