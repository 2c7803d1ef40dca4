"""`specx profile` of a mixture-of-experts target counts its routing (tools/modeltimes.count_routing),
checked against transformers' own router logits on the same tokens; the plan reads the counts from a
matching profile (session/profiles.plan_timings -> PlanRequest.timings) and names its routing measured."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from offload.planning.memplan import PlanRequest, plan_memory
from specexec_cli.session.loading import close_models
from specexec_cli.session.profiles import plan_timings
from specexec_cli.tools import modeltimes
from tests.conftest import make_tokenizer
from tests.sparse_ckpt import read_checkpoint
from tests.sparse_moe import write_sparse_moe
from tests.test_gpt_oss import make_gpt_oss
from tests.test_moe_families import make_moe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TOKENS = 24


def hf_counts(target) -> list[int]:
    """Tokens per (sparse layer, expert) from transformers' router logits: each token's top-k experts."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = (make_tokenizer()(modeltimes.SAMPLE * 16)["input_ids"] * TOKENS)[:TOKENS]
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    e = getattr(hf.config, "num_local_experts", None) or hf.config.num_experts
    k = hf.config.num_experts_per_tok
    counts = []
    for logits in out.router_logits:  # one (T, E) per sparse layer, in order
        top = logits.reshape(-1, e).topk(k, dim=-1).indices
        counts += torch.bincount(top.flatten(), minlength=e).tolist()
    return counts


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"])
def test_profile_counts_the_routing_transformers_computes(name, tmp_path):
    target = make_gpt_oss(tmp_path / "target", 3) if name == "gpt_oss" else make_moe(name, tmp_path / "target", seed=3)
    models, _, _ = modeltimes.plan_and_load(dict(target=str(target), device="cpu"), None, None, None)
    try:
        got = modeltimes.count_routing(models, tokens=TOKENS)
    finally:
        close_models(models)
    assert got["tokens"] == TOKENS and got["counts"] == hf_counts(target)
    k = transformers.AutoConfig.from_pretrained(target).num_experts_per_tok
    assert sum(got["counts"]) == TOKENS * k * len(got["layers"])  # top-k of every token in every sparse layer


def test_a_profiles_routing_reaches_the_plan(tmp_path):
    """A profile's routing counts (session/profiles.plan_timings -> PlanRequest.timings) fill a 24 GB
    card's expert cache hottest first (Qwen3-30B-A3B, its real header, 64 GB of RAM): one hot expert in
    16 per layer serves more of the routed tokens than the uniform prior, and the plan models faster and
    says "measured". The CPU's on-demand RAM cache keeps the most recently used experts, so its hit
    stays the prior's with counts or without."""
    ck = read_checkpoint(write_sparse_moe("qwen3-30b-a3b", tmp_path / "q"))
    e, layers = ck.config["num_experts"], ck.config["num_hidden_layers"]
    counts = [1000 if x % 16 == 0 else 1 for x in range(e * layers)]
    timed = plan_timings(dict(target_seconds={"1": 0.01}, routing=dict(counts=counts)))
    assert timed["routing"] == counts
    req = PlanRequest(device="cuda", dtype="bf16", draft_dtype=None, ram_free=64 * 10**9, max_gpu_memory=24 * 10**9)
    prior = plan_memory(ck, None, req).experts
    measured = plan_memory(ck, None, replace(req, timings=timed)).experts
    assert prior["mode"] == measured["mode"] == "split"
    assert (prior["routing"], measured["routing"]) == ("uniform (prior)", "measured")
    assert measured["hit"] > prior["hit"] and measured["tokens_per_second"] > prior["tokens_per_second"]
    cpu = replace(req, device="cpu", max_gpu_memory=None, offload="disk")
    on_demand = [plan_memory(ck, None, replace(cpu, timings=t)).experts for t in (None, timed)]
    assert [x["mode"] for x in on_demand] == ["on-demand"] * 2 and on_demand[0]["hit"] == on_demand[1]["hit"]
