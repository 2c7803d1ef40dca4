"""Counted device bytes == the memory plan, component by component (CPU, tiny models).

The plan is computed from headers only; the models are then really loaded and generate a few
tokens (which preallocates both KV caches). `DevicePool.by_component` must equal the plan for
every component the allocator counts (activations and the CUDA margin are estimates, not buffers).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig, generate
from specexec_cli.session.loading import LoadOptions, load_models
from specexec_cli.session.planning import make_plan

COUNTED = (
    "embeddings",
    "final_norm",
    "lm_head",
    "rotary",
    "quant_states",
    "draft",
    "kv_target",
    "kv_draft",
    "resident_layers",
    "staging_slots",
)


@pytest.mark.parametrize(
    "dtype,offload,embeddings,max_gpu",
    [
        ("fp32", "auto", "auto", None),  # everything resident
        ("fp32", "disk", "auto", None),  # every layer streams from disk through 2 slots
        ("nf4", "ram", "auto", None),  # nf4 arenas in RAM + quant states
        ("fp32", "auto", "host", 60_000_000),  # host embeddings; cap leaves some layers streamed
    ],
)
def test_counted_bytes_equal_plan(tiny_pair, dtype, offload, embeddings, max_gpu):
    opts = LoadOptions(
        target=str(tiny_pair[0]),
        draft=str(tiny_pair[1]),
        dtype=dtype,
        device="cpu",
        offload=offload,
        ctx=96,
        embeddings=embeddings,
        max_gpu_memory=max_gpu,
    )
    shape = TreeShape(budget=8, max_depth=4, max_beams=4)
    plan = make_plan(opts, shape, budget_auto=False)
    assert plan.fits, plan.reason
    models = load_models(replace(opts, plan=plan))
    try:
        cfg = GenerationConfig(method="specexec", shape=shape, max_new_tokens=6)
        list(generate(models, DecodeState(), [3, 5, 7, 9, 11], cfg))
        counted = models.pool.by_component
        for comp in COUNTED:
            assert counted.get(comp, 0) == plan.device_bytes[comp], comp
        assert plan.device_bytes["kv_target"] > 0 and plan.device_bytes["draft"] > 0
        if offload == "disk":
            assert plan.device_bytes["staging_slots"] > 0 and plan.device_bytes["resident_layers"] == 0
        if dtype == "nf4":
            assert plan.device_bytes["quant_states"] > 0
        if embeddings == "host":
            assert plan.device_bytes["embeddings"] == 0 and plan.host_bytes["embeddings"] > 0
    finally:
        close = getattr(models.target, "close", None)
        if close:
            close()


def test_kv_caches_never_reallocate(tiny_pair):
    """Planned caches hold context + tree: a long generation compacts in place, no regrowth."""
    opts = LoadOptions(target=str(tiny_pair[0]), draft=str(tiny_pair[1]), device="cpu", offload="auto", ctx=64)
    shape = TreeShape(budget=16, max_depth=6, max_beams=4)
    plan = make_plan(opts, shape, budget_auto=False)
    models = load_models(replace(opts, plan=plan))
    st = DecodeState()
    cfg = GenerationConfig(method="specexec", shape=shape, max_new_tokens=200)
    events = list(generate(models, st, [3, 5, 7], cfg))
    assert events[-1].finish in ("context", "eos", "length")
    for cache, rows in ((st.target_cache, plan.kv_rows[0]), (st.draft_cache, plan.kv_rows[1])):
        assert cache.layers[0].keys.shape[-2] == rows  # never regrown (a regrowth doubles it, and warns)
    ptrs = [layer.keys.data_ptr() for layer in st.target_cache.layers]
    list(generate(models, st, [4, 6], replace(cfg, max_new_tokens=3))) if len(st.ids) + 3 < 64 else None
    assert [layer.keys.data_ptr() for layer in st.target_cache.layers] == ptrs


def test_host_embeddings_generate_the_same_tokens(tiny_pair):
    shape = TreeShape(budget=8, max_depth=4, max_beams=4)
    cfg = GenerationConfig(method="specexec", shape=shape, max_new_tokens=12)
    out = {}
    for emb in ("device", "host"):
        opts = LoadOptions(
            target=str(tiny_pair[0]), draft=str(tiny_pair[1]), device="cpu", offload="auto", ctx=96, embeddings=emb
        )
        models = load_models(replace(opts, plan=make_plan(opts, shape, budget_auto=False)))
        assert (type(models.target.embed_tokens).__name__ == "HostEmbedding") == (emb == "host")
        st = DecodeState()
        list(generate(models, st, [3, 5, 7, 9], cfg))
        out[emb] = st.ids
    assert out["host"] == out["device"]


def test_target_bigger_than_allowed_ram_streams_with_no_offload_flags(tiny_pair, tmp_path):
    """CPU, default --offload auto, --max-ram below the target's layers: some layers stream from
    disk, and the generated tokens equal a fully resident run's."""
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    prompt = tmp_path / "p.txt"
    prompt.write_text("def f(x):\n  return")
    opts = LoadOptions(target=str(tiny_pair[0]), draft=str(tiny_pair[1]), device="cpu", offload="auto")
    layer = make_plan(opts, TreeShape(budget=16, max_depth=8), budget_auto=False).layer_bytes[0]
    capped = make_plan(replace(opts, max_ram=layer), TreeShape(budget=16, max_depth=8), budget_auto=False)
    assert capped.fits and capped.disk_layers and len(capped.resident) + len(capped.ram_layers) <= 1
    ids = {}
    for name, extra in (("resident", ["--offload", "none"]), ("capped", ["--max-ram", str(layer)])):
        out = tmp_path / f"{name}.json"
        res = CliRunner().invoke(
            app,
            [
                "run",
                str(prompt),
                "--target",
                str(tiny_pair[0]),
                "--draft",
                str(tiny_pair[1]),
                "--device",
                "cpu",
                "--budget",
                "16",
                "--max-new-tokens",
                "12",
                "--no-live",
                "--stats-json",
                str(out),
                *extra,
            ],
        )
        assert res.exit_code == 0, res.output
        ids[name] = __import__("json").loads(out.read_text())["token_ids"]
        if name == "capped":
            assert "from disk" in res.stderr
    assert ids["capped"] == ids["resident"]


def temporaries(fn) -> tuple[int, torch.Tensor]:
    """(peak bytes the CPU allocator held for tensors made inside fn() before its output was allocated,
    the output): torch.profiler's memory events in time order (allocations as the allocating op's self
    memory, frees as [memory] events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    deltas = [
        e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        for e in sorted(prof.events(), key=lambda e: e.time_range.start)
    ]
    last = max(i for i, d in enumerate(deltas) if d == out.untyped_storage().nbytes())
    now = peak = 0
    for d in deltas[:last]:
        now += d
        peak = max(peak, now)
    return peak, out


@pytest.mark.parametrize("bits", [3, 2])
def test_self_draft_dequant_temporaries_equal_the_plan(tiny_pair, bits, monkeypatch):
    """--draft self at 3/2 bits under the eager reference kernel: what each substitute linear allocates
    while it runs a draft forward (besides its output) equals the plan's dequantization term for it
    (HQQ's unpack in the compute dtype plus two packed-size slice temporaries), the plan's activations
    are its draft pass with the largest one, and the counted components equal the plan as above."""
    pytest.importorskip("hqq")
    from offload.planning.membytes import (
        activation_bytes,
        arch_of,
        dequant_temp_bytes,
        linear_dequant_bytes,
        substitute_kernel,
    )
    from offload.planning.memplan import PlanRequest
    from offload.quant.lowbit import LowbitLinear

    monkeypatch.setenv("SPECX_LOWBIT_KERNEL", "eager")
    assert substitute_kernel(bits) == "hqq-eager"
    opts = LoadOptions(target=str(tiny_pair[0]), draft="self", device="cpu", offload="disk", ctx=96, draft_bits=bits)
    shape = TreeShape(budget=8, max_depth=4, max_beams=4)
    plan = make_plan(opts, shape, budget_auto=False)
    assert plan.fits and plan.substitute_bits == bits, plan.reason
    # the per-forward path (the plan had room to dequantize them once: tests/test_dense_selfdraft.py)
    plan.dense_draft_layers = []
    plan.device_bytes.pop("dequantized_draft", None)
    models = load_models(replace(opts, plan=plan))
    try:
        list(
            generate(
                models, DecodeState(), [3, 5, 7], GenerationConfig(method="specexec", shape=shape, max_new_tokens=4)
            )
        )
        for comp in COUNTED:
            assert models.pool.by_component.get(comp, 0) == plan.device_bytes[comp], comp
        linears = [m for m in models.draft.modules() if isinstance(m, LowbitLinear)]
        assert linears and {lin.kernel for lin in linears} == {"eager"}
        for lin in linears:
            x = torch.randn(shape.max_beams, lin.in_features)  # one draft forward's beams
            peak, y = temporaries(lambda: lin(x))
            assert peak == linear_dequant_bytes(lin.in_features * lin.out_features, "hqq-eager", bits, 4, "cpu"), lin
            assert y.shape == (shape.max_beams, lin.out_features)
        a = arch_of(json.loads((tiny_pair[0] / "config.json").read_text()))
        assert dequant_temp_bytes(a, "hqq-eager", bits, 4, "cpu") > a.intermediate * a.hidden * 4
        req = PlanRequest(
            device="cpu",
            dtype="fp32",
            draft_dtype="fp32",
            ram_free=1 << 34,
            ctx=96,
            budget=8,
            max_beams=4,
            self_draft=True,
            draft_bits=bits,
        )
        rows = (plan.kv_rows[0], plan.kv_rows[0])
        planned = activation_bytes(a, a, req, rows, 8, plan.pass_tokens)
        assert planned == plan.device_bytes["activations"]
        monkeypatch.setenv("SPECX_LOWBIT_KERNEL", "fused")  # the compiled kernel's CPU graph keeps no weight
        assert activation_bytes(a, a, req, rows, 8, plan.pass_tokens) <= planned
    finally:
        models.target.close()


@pytest.mark.parametrize("bits", [3, 2])
def test_compiled_substitute_keeps_no_weight_on_cpu(bits):
    """The compiled path (offload/quant/fused.py, the default) on CPU: besides its output, a substitute linear
    allocates nothing while it runs a draft forward, which is what the plan counts for it there."""
    pytest.importorskip("hqq")
    from offload.planning.membytes import linear_dequant_bytes
    from offload.quant.fused import fused_status
    from offload.quant.lowbit import LowbitLinear, quantize_weight

    torch.manual_seed(0)
    q = quantize_weight(torch.randn(256, 128), bits)
    lin = LowbitLinear(q["W_q"], q["scale"], q["zero"], None, (256, 128), bits)
    lin.kernel = "fused"
    x = torch.randn(32, 128)
    torch._dynamo.reset()
    lin(x)  # compiled once, outside the measurement
    if fused_status() is not None:
        pytest.skip(fused_status())
    peak, _y = temporaries(lambda: lin(x))
    assert peak == linear_dequant_bytes(256 * 128, "hqq-compiled", bits, 4, "cpu") == 0
    assert linear_dequant_bytes(256 * 128, "hqq-eager", bits, 4, "cpu") > 256 * 128 * 4
