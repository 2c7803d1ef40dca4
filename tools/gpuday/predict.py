"""The speed model's prediction beside each figure the GPU run measures, fed the card's measured rates.

Contract:
- `device(card)`: offload/planning/passcost.py's Device with the probe phase's MEASURED rates: the
  pinned host->device link, device memory (a device copy, read + write counted), dense bf16 and fp32
  (TF32 off) matmul FLOP/s. The per-forward floors are passcost's priors (their `sources` say so).
- `target_pass(card, fmt, shape, layers, n, past, streamed_bytes)`: passcost.target_pass for the
  timed stack: every layer in the RAM tier with the bytes the run actually streamed per layer, n
  tree tokens at a context of `past`, bf16 compute, the format's dequantization kernel (KERNEL).
- `draft_step(card, weight, kv, dequant, flops)`: passcost.draft_step for one draft forward.
- `tokens_per_pass(budget)`: acceptance's prior for a small trained draft at T = 0.
- `step(card, shape, target, budget, draft_shape, draft_bytes, tpp, max_beams)`: the planner's own
  figure for one speculative step, draftcost.evaluate for a small draft (`draft_bytes` of bf16
  parameters) and a target of target["layers"] nf4 layers of target["layer_bytes"] each, all in the RAM
  tier with target["staging_bytes"] of device slots, priced at target["past"] context tokens
  (draftcost.model_ctx of a 2 x past plan) with `tpp` tokens per pass (the replayed trace's): draft = forwards_per_tree x draft_step, stream = the pass's transfer
  term, verify = its compute terms (GEMM, dequantization, attention, head), step = pass + draft - the
  draft time the staging slots' stream hides. It models no accept work and no overlapped draft.
Every prediction is returned as {"seconds", "model", ...terms} so the tables can say which model spoke.
"""

from __future__ import annotations

from types import SimpleNamespace

from offload.planning import acceptance, draftcost, passcost
from offload.planning.membytes import arch_of

MODEL = "offload/planning/passcost.py"
KERNEL = {"bf16": "none", "nf4": "nf4-dequant", "q4k": "int4-unpack"}  # passcost.DEQUANT_ELEMS keys
C = 2  # bytes of the compute dtype (bf16)


def device(card: dict) -> passcost.Device:
    kind = "cuda" if card.get("device", "cpu") != "cpu" else "cpu"
    src = f"measured: gpu_day probe ({card.get('device', kind)})"
    rates = dict(
        memory_bps=card["memory_bps"], link_bps=card["link_bps"], flops16=card["bf16_flops"], flops32=card["fp32_flops"]
    )
    return passcost.device_for(kind, dict.fromkeys(rates, src), **rates)


def arch(shape: dict, layers: int):
    return arch_of(dict({k: v for k, v in shape.items() if k != "layers"}, num_hidden_layers=layers))


def kv_bytes(shape: dict, layers: int, tokens: int, elem: int = C) -> int:
    return 2 * layers * shape["num_key_value_heads"] * shape["head_dim"] * tokens * elem


def target_pass(card: dict, fmt: str, shape: dict, layers: int, n: int, past: int, streamed_bytes: int) -> dict:
    """Predicted seconds of one pass over n tree tokens on `past` cached ones, every layer streamed."""
    plan = SimpleNamespace(
        layer_bytes=[streamed_bytes // max(1, layers)] * layers, ram_layers=list(range(layers)), disk_layers=[]
    )
    terms = passcost.target_pass(arch(shape, layers), plan, device(card), n, past, C, KERNEL[fmt])
    return dict(terms.to_json(), model=MODEL)


def draft_step(card: dict, weight: int, kv: int, dequant: int, flops: float) -> dict:
    """Predicted seconds of one draft forward."""
    dev = device(card)
    return dict(
        seconds=passcost.draft_step(weight, kv, dequant, flops, dev, C), model=MODEL, step_floor_s=dev.step_floor_s
    )


def tokens_per_pass(budget: int) -> float:
    return acceptance.tokens_per_pass("small", 0.0, budget)


STEP_MODEL = "offload/planning/draftcost.py evaluate (passcost.target_pass, forwards_per_tree x draft_step)"


def step(
    card: dict, shape: dict, target: dict, budget: int, draft_shape: dict, draft_bytes: int, tpp: float, max_beams: int
) -> dict:
    """Modelled seconds of one step's parts (see the contract), with the candidate's terms."""
    layers = target["layers"]
    plan = SimpleNamespace(
        layer_bytes=[target["layer_bytes"]] * layers,
        ram_layers=list(range(layers)),
        disk_layers=[],
        resident=[],
        ctx=2 * target["past"],  # draftcost.model_ctx: half the planned context, at most MODEL_CTX_CAP
        device_bytes={"staging_slots": target["staging_bytes"]},
        fits=True,
    )
    da = arch(draft_shape, draft_shape["layers"])
    weight, kv, deq = draftcost.small_forward_bytes(da, draft_bytes, draftcost.model_ctx(plan), C)
    spec = draftcost.Spec("1B-shaped", None, "", lambda b: tpp, weight, kv, deq, 2.0 * weight / C)
    cost = draftcost.Costing(arch(shape, layers), C, KERNEL["nf4"], device(card), {}, max_beams, 0.0)
    cand = draftcost.evaluate(spec, cost, plan, budget)
    t = cand.terms
    return dict(
        draft=cand.draft_seconds,
        stream=t["stream"],
        verify=t["gemm"] + t["dequant"] + t["attention"] + t["head"],
        step=cand.pass_seconds + cand.draft_seconds - cand.hidden_seconds,
        pass_seconds=cand.pass_seconds,
        hidden=cand.hidden_seconds,
        forwards=cand.forwards,
        rows=draftcost.draft_rows(budget, max_beams),
        tokens_per_second=cand.tokens_per_second,
        tokens_per_pass=tpp,
        terms=t,
        model=STEP_MODEL,
    )
