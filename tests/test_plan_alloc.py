"""Counted device bytes == the memory plan, component by component (CPU, tiny models).

The plan is computed from headers only; the models are then really loaded and generate a few
tokens (which preallocates both KV caches). `DevicePool.by_component` must equal the plan for
every component the allocator counts (activations and the CUDA margin are estimates, not buffers).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig, generate
from specexec_cli.session.loading import LoadOptions, load_models
from specexec_cli.session.planning import make_plan

COUNTED = ("embeddings", "final_norm", "lm_head", "rotary", "quant_states", "draft", "kv_target", "kv_draft",
           "resident_layers", "staging_slots")


@pytest.mark.parametrize("dtype,offload,embeddings,max_gpu", [
    ("fp32", "auto", "auto", None),          # everything resident
    ("fp32", "disk", "auto", None),          # every layer streams from disk through 2 slots
    ("nf4", "ram", "auto", None),            # nf4 arenas in RAM + quant states
    ("fp32", "auto", "host", 60_000_000),    # host embeddings; cap leaves some layers streamed
])
def test_counted_bytes_equal_plan(tiny_pair, dtype, offload, embeddings, max_gpu):
    opts = LoadOptions(target=str(tiny_pair[0]), draft=str(tiny_pair[1]), dtype=dtype, device="cpu",
                       offload=offload, ctx=96, embeddings=embeddings, max_gpu_memory=max_gpu)
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
        assert cache.reallocations == 0 and cache.layers[0].keys.shape[-2] == rows
    ptrs = [layer.keys.data_ptr() for layer in st.target_cache.layers]
    list(generate(models, st, [4, 6], replace(cfg, max_new_tokens=3))) if len(st.ids) + 3 < 64 else None
    assert [layer.keys.data_ptr() for layer in st.target_cache.layers] == ptrs


def test_host_embeddings_generate_the_same_tokens(tiny_pair):
    shape = TreeShape(budget=8, max_depth=4, max_beams=4)
    cfg = GenerationConfig(method="specexec", shape=shape, max_new_tokens=12)
    out = {}
    for emb in ("device", "host"):
        opts = LoadOptions(target=str(tiny_pair[0]), draft=str(tiny_pair[1]), device="cpu", offload="auto",
                           ctx=96, embeddings=emb)
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
        res = CliRunner().invoke(app, ["run", str(prompt), "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
                                       "--device", "cpu", "--budget", "16", "--max-new-tokens", "12", "--no-live",
                                       "--stats-json", str(out), *extra])
        assert res.exit_code == 0, res.output
        ids[name] = __import__("json").loads(out.read_text())["token_ids"]
        if name == "capped":
            assert "from disk" in res.stderr
    assert ids["capped"] == ids["resident"]
