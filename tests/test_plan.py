"""Memory plans at real sizes: sparse 70B-class checkpoints, every component recomputed here.

The expected bytes below are derived from the public config values with plain arithmetic (not by
calling offload.planning.memplan), so a wrong formula, a missing component or a plan over its cap fails.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest

from offload.planning.memplan import PlanRequest, plan_memory
from tests.sparse_ckpt import read_checkpoint, write_sparse

GB = 10**9
MIB = 1024**2


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse")
    out = {
        name: read_checkpoint(write_sparse(name, root / name))
        for name in ("llama-3.1-70b", "llama-3.2-1b", "qwen2.5-72b", "qwen2.5-0.5b")
    }
    du = sum(os.stat(p).st_blocks * 512 for p in root.rglob("*.safetensors"))
    assert du < 50 * MIB, "sparse checkpoints must not allocate their data"
    return out


def cfg(ck) -> dict:
    return ck.config


def a256(n: int) -> int:
    return (n + 255) // 256 * 256


def linears(c: dict) -> list[int]:
    """numel of q, k, v, o, gate, up, down of one layer."""
    h, i, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    kv, hd = c["num_key_value_heads"], c.get("head_dim") or h // heads
    return [heads * hd * h, kv * hd * h, kv * hd * h, h * heads * hd, i * h, i * h, h * i]


def small_params(c: dict) -> list[int]:
    """numel of the non-linear layer tensors: two norms (+ q/k/v biases for Qwen2)."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, hd = c["num_key_value_heads"], c.get("head_dim") or h // heads
    return [h, h] + ([heads * hd, kv * hd, kv * hd] if c["model_type"] == "qwen2" else [])


def layer_bytes(c: dict, nf4: bool, elem: int) -> int:
    """Streamed bytes of one layer: nf4 streams only the packed linears (norms/biases are pinned)."""
    if nf4:
        return sum(a256(n // 2) for n in linears(c))
    return sum(a256(n * elem) for n in linears(c) + small_params(c))


def nf4_file_estimate(c: dict) -> int:
    """The 4-bit cache's layer span estimate: each packed weight in whole 4 KiB pages, plus one."""
    return sum((n // 2 + 4095) // 4096 * 4096 + 4096 for n in linears(c))


def qstate(n: int) -> int:
    blocks = -(-n // 64)
    return blocks + 4 * -(-blocks // 256) + 1024 + 64 + 4


def model_params(c: dict) -> int:
    h, v = c["hidden_size"], c["vocab_size"]
    per_layer = sum(linears(c)) + sum(small_params(c))
    heads = 1 if c.get("tie_word_embeddings") else 2
    return heads * v * h + h + c["num_hidden_layers"] * per_layer


def kv(c: dict, rows: int, elem: int) -> int:
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * hd * rows * elem


def one_pass(
    c: dict, t: int, s: int, e: int, logit_rows: int, deq: int, fused: bool = False, draft: bool = False
) -> int:
    """One sdpa pass on CUDA: no H x T x S scores and no repeated K/V (specx_gqa); the mask (a tree
    pass: additive at the width rounded to 8; a causal prefill chunk: HF's T x S boolean one) and, with
    GQA and T > 1, its additive copy at the padded width (prefill) plus the fold (G x T x S8 and a q
    copy) when G x T <= 2 x KV x hd, else the per-group outputs and their stacked copy; the logits in
    the compute dtype; at T = 0 the target samples nothing (argmax), a draft pass keeps 3 fp32 copies
    of its rows (log-softmax)."""
    h, heads, kvh = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // heads
    s8, g = -(-s // 8) * 8, heads // kvh
    mask = t * s if fused else t * s8 * e
    attn = 0
    if g > 1 and t > 1:
        attn = (t * s8 * e if fused else 0) + (
            g * t * s8 * e + t * heads * hd * e if g * t <= 2 * kvh * hd else 2 * t * heads * hd * e
        )
    return (
        4 * t * h * e
        + 2 * t * (heads + 2 * kvh) * hd * e
        + attn
        + 4 * t * c["intermediate_size"] * e
        + mask
        + deq * e
        + logit_rows * c["vocab_size"] * (e + (12 if draft else 0))
    )


def expected_device(t: dict, d: dict, plan, nf4: bool, elem: int, delem: int) -> dict:
    """Every device component from the configs alone (CUDA, sdpa)."""
    h, v, ctx, b = t["hidden_size"], t["vocab_size"], plan.ctx, plan.sized_budget  # what the caches are sized for
    table = v * h * elem
    rows_t, rows_d = ctx + b + 1, ctx + 2 * b + 32 + 1
    deq = t["intermediate_size"] * h if nf4 else 0
    chunk = plan.pass_tokens  # the prefill chunk the plan chose (test_prefill_chunk_* check the choice)
    assert min(max(b + 1, 256), ctx) <= chunk <= ctx
    act = max(
        one_pass(t, b + 1, rows_t, elem, b + 1, deq),
        one_pass(t, chunk, ctx, elem, 1, deq, True),
        one_pass(d, 32, rows_d, delem, 32, 0, draft=True),
        one_pass(d, chunk, ctx, delem, 1, 0, True),
    )
    lb = layer_bytes(t, nf4, elem)
    streamed = t["num_hidden_layers"] - len(plan.resident)
    hd, dhd = (
        t.get("head_dim") or h // t["num_attention_heads"],
        d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
    )
    exp = {
        "embeddings": table if plan.embeddings == "device" else 0,
        "final_norm": h * elem,
        "lm_head": table,
        "rotary": hd // 2 * 8,
        "quant_states": t["num_hidden_layers"] * sum(qstate(n) for n in linears(t)) if nf4 else 0,
        "draft": model_params(d) * delem + dhd // 2 * 8,
        "kv_target": kv(t, rows_t, elem),
        "kv_draft": kv(d, rows_d, delem),
        "activations": act,
        "resident_layers": len(plan.resident) * lb,
        "pinned_params": t["num_hidden_layers"] * sum(a256(n * elem) for n in small_params(t)) if nf4 else 0,
    }
    if nf4:
        slot = max(lb if plan.ram_layers else 0, nf4_file_estimate(t) if plan.disk_layers else 0)
    else:
        slot = lb if not plan.disk_layers else plan.device_bytes["staging_slots"] // 2
    exp["staging_slots"] = 2 * slot if streamed else 0
    # the static draft step (core/draftstep.py): the (128, rows8) mask store, 4 int64 inputs per bucket
    # row, one CUDA-graph pool per bucket P = 1 .. 128: a draft pass of P rows over the whole cache, its
    # (P, V) logits kept, less the mask (a view of the store)
    s8 = -(-rows_d // 8) * 8
    buckets = (1, 2, 4, 8, 16, 32, 64, 128)
    pools = sum(one_pass(d, p, rows_d, delem, p, 0) - p * s8 * delem for p in buckets)
    exp["draft_step"] = 128 * s8 * delem + 4 * 8 * 255 + pools
    static = sum(exp.values()) - act
    exp["cuda_context"] = 600 * MIB + int(0.02 * static + 0.10 * act)
    return exp


def request(**kw) -> PlanRequest:
    base = dict(device="cuda", dtype="nf4", draft_dtype="bf16", ram_free=128 * GB, budget=1024, budget_auto=True)
    base.update(kw)
    return PlanRequest(**base)


@pytest.mark.parametrize("cap_gb", [24, 16, 12])
def test_nf4_70b_with_1b_draft_fits_each_card(ckpts, cap_gb):
    t, d = ckpts["llama-3.1-70b"], ckpts["llama-3.2-1b"]
    plan = plan_memory(t, d, request(max_gpu_memory=cap_gb * GB))
    assert plan.fits, plan.reason
    assert plan.device_total <= cap_gb * GB == plan.device_capacity
    assert plan.device_bytes == expected_device(cfg(t), cfg(d), plan, True, 2, 2)
    assert plan.device_total == sum(plan.device_bytes.values())
    lb = layer_bytes(cfg(t), True, 2)
    assert plan.host_bytes["ram_layers"] == len(plan.ram_layers) * lb
    assert len(plan.resident) + len(plan.ram_layers) + len(plan.disk_layers) == 80
    # resident layers are maximal: one more would break the cap (slack grows by 2% of it too)
    if plan.ram_layers or plan.disk_layers:
        assert plan.device_total + lb * 1.02 > cap_gb * GB or len(plan.ram_layers) + len(plan.disk_layers) == 1
    # the caches are sized for the largest budget that fits, among 1024, 512, ...: the next one up must not
    # fit (the speed model then starts the run at the budget it models fastest, at most that one)
    assert plan.budget <= plan.sized_budget
    if plan.sized_budget < 1024:
        bigger = plan_memory(t, d, request(max_gpu_memory=cap_gb * GB, budget=plan.sized_budget * 2, budget_auto=False))
        assert not bigger.fits


def test_plans_shrink_with_the_card(ckpts):
    t, d = ckpts["llama-3.1-70b"], ckpts["llama-3.2-1b"]
    plans = [plan_memory(t, d, request(max_gpu_memory=g * GB)) for g in (24, 16, 12)]
    assert [p.sized_budget for p in plans] == sorted((p.sized_budget for p in plans), reverse=True)
    assert len(plans[0].resident) > 0 and plans[0].embeddings == "host"  # 128k vocab: embeddings stay home


def test_bf16_70b_on_24gb_with_64gb_ram_spills_to_disk(ckpts):
    t, d = ckpts["llama-3.1-70b"], ckpts["llama-3.2-1b"]
    plan = plan_memory(t, d, request(dtype="bf16", ram_free=64 * GB, max_gpu_memory=24 * GB))
    assert plan.fits, plan.reason
    assert plan.device_total <= 24 * GB
    assert plan.disk_layers and plan.ram_layers
    exp = expected_device(cfg(t), cfg(d), plan, False, 2, 2)
    assert plan.device_bytes == exp
    lb = layer_bytes(cfg(t), False, 2)  # bf16 file layout == compute layout: slots hold raw spans
    slot = plan.device_bytes["staging_slots"] // 2
    assert lb <= slot <= lb + 2 * 4096
    assert plan.host_bytes["ram_layers"] == len(plan.ram_layers) * lb
    assert plan.host_total <= int(0.8 * 64 * GB) + plan.host_bytes["stage_buffers"] + plan.host_bytes["read_buffers"]
    raw = sum(n * 2 for n in linears(cfg(t)) + small_params(cfg(t)))
    assert len(plan.disk_layers) * raw <= plan.disk_bytes_per_pass <= len(plan.disk_layers) * (raw + 8192)


def test_qwen_72b_with_biases(ckpts):
    t, d = ckpts["qwen2.5-72b"], ckpts["qwen2.5-0.5b"]
    plan = plan_memory(t, d, request(max_gpu_memory=24 * GB))
    assert plan.fits, plan.reason
    assert plan.device_bytes == expected_device(cfg(t), cfg(d), plan, True, 2, 2)
    assert plan.device_total <= 24 * GB


def test_ctx_is_capped_by_max_positions_and_sizes_the_caches(ckpts):
    t, d = ckpts["qwen2.5-72b"], ckpts["qwen2.5-0.5b"]
    big = plan_memory(t, d, request(max_gpu_memory=80 * GB, ctx=10**6, budget=64, budget_auto=False))
    assert big.ctx == 32768 and big.kv_rows == (32768 + 65, 32768 + 128 + 33)
    small = plan_memory(t, d, request(max_gpu_memory=80 * GB, ctx=2048, budget=64, budget_auto=False))
    assert small.device_bytes["kv_target"] * (32768 + 65) == big.device_bytes["kv_target"] * (2048 + 65)


def test_unfittable_is_refused_in_one_line(ckpts):
    t, d = ckpts["llama-3.1-70b"], ckpts["llama-3.2-1b"]
    plan = plan_memory(t, d, request(max_gpu_memory=6 * GB))
    assert not plan.fits and "\n" not in plan.reason
    assert "needs" in plan.reason and "has 6.0 GB" in plan.reason and "--ctx" in plan.reason
    whole = plan_memory(t, d, request(dtype="bf16", offload="none", max_gpu_memory=80 * GB))
    assert not whole.fits and "--offload auto" in whole.reason and "--dtype nf4" in whole.reason


def test_cpu_target_bigger_than_ram_streams_without_flags(ckpts):
    t = ckpts["llama-3.1-70b"]
    plan = plan_memory(t, None, PlanRequest(device="cpu", dtype="bf16", draft_dtype=None, ram_free=24 * GB, ctx=2048))
    assert plan.fits, plan.reason
    assert plan.disk_layers and plan.device_bytes["cuda_context"] == 0
    assert plan.device_total + plan.host_total <= 24 * GB


def test_plan_json_keys(ckpts):
    plan = plan_memory(ckpts["qwen2.5-72b"], ckpts["qwen2.5-0.5b"], request(max_gpu_memory=24 * GB)).to_json()
    for key in (
        "device_bytes",
        "device_total",
        "device_capacity",
        "host_bytes",
        "host_total",
        "disk_bytes_per_pass",
        "resident_layers",
        "streamed_layers",
        "fits",
    ):
        assert key in plan
    assert set(plan["streamed_layers"]) == {"ram", "disk"}
    json.dumps(plan)
    assert math.isclose(plan["device_total"], sum(plan["device_bytes"].values()))


def test_prefill_chunk_streams_a_full_context_prompt_once_at_24gb(ckpts):
    """70B nf4 + 1B draft on a 24 GB card, ctx 8192: the prefill pass takes the whole context, so a
    prompt that fits --ctx costs one weight stream (it was 256 tokens per pass: 32 streams)."""
    t, d = ckpts["llama-3.1-70b"], ckpts["llama-3.2-1b"]
    plan = plan_memory(t, d, request(max_gpu_memory=24 * GB, ctx=8192, budget=256, budget_auto=False))
    assert plan.fits, plan.reason
    assert plan.pass_tokens == 8192


@pytest.mark.parametrize("cap_gb", [16, 12])
def test_prefill_chunk_shrinks_before_a_plan_is_refused(ckpts, cap_gb):
    t, d = ckpts["llama-3.1-70b"], ckpts["llama-3.2-1b"]
    plan = plan_memory(t, d, request(max_gpu_memory=cap_gb * GB, ctx=8192))
    assert plan.fits, plan.reason
    assert 256 <= plan.pass_tokens <= 8192 and plan.device_total <= cap_gb * GB


def test_cpu_plan_prefills_the_whole_context_in_one_pass(ckpts):
    plan = plan_memory(
        ckpts["llama-3.2-1b"],
        None,
        request(device="cpu", dtype="bf16", ram_free=24 * GB, ctx=4096, budget=64, budget_auto=False),
    )
    assert plan.fits and plan.pass_tokens == 4096


def test_leftover_device_memory_becomes_staging_slots(ckpts):
    """CUDA: what a fitting plan leaves over on the device becomes more staging slots (the stream reads
    that many layers of the next pass while the draft grows its tree), while the total stays under the cap."""
    t = ckpts["llama-3.1-70b"]
    base = PlanRequest(
        device="cuda",
        dtype="nf4",
        draft_dtype=None,
        ram_free=200 * GB,
        offload="disk",
        device_free=24 * GB,
        ctx=4096,
        budget=64,
    )
    plain = plan_memory(t, None, base)
    assert plain.fits and plain.disk_layers and not plain.resident and plain.slots > 2
    slot = plain.device_bytes["staging_slots"] // plain.slots
    assert plain.device_total <= plain.device_capacity < plain.device_total + int(slot * 1.02) + 1
    assert any(
        f"{plain.slots} device slots, {plain.slots - 2} of them from device memory left over" in n for n in plain.notes
    )
    # a device one byte short of that holds one slot fewer
    fewer = plan_memory(t, None, replace(base, device_free=plain.device_total - 1))
    assert fewer.slots == plain.slots - 1 and fewer.device_bytes["staging_slots"] == fewer.slots * slot
    assert fewer.device_total <= plain.device_total - slot
