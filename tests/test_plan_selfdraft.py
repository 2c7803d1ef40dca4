"""Self-draft memory plans at real sizes (sparse Llama-3.1-70B headers): the substitutes' bytes are
recomputed here from the public config with plain arithmetic (HQQ: packed codes plus one bf16
scale and zero per group), and the plan's choice of bits and resident layers is checked."""

from __future__ import annotations

import itertools
import math

import pytest

from offload.planning.memplan import PlanRequest, plan_memory
from tests.sparse_ckpt import read_checkpoint, write_sparse

GB = 10**9
H, KV, INTER, LAYERS = 8192, 1024, 28672, 80  # Llama-3.1-70B: hidden, kv heads x head dim, MLP, layers


def hqq_layer_bytes(bits: int) -> int:
    group = {3: 64, 2: 32}[bits]
    per_word, word = {3: (10, 4), 2: (4, 1)}[bits]
    total = 2 * H * 2  # two RMSNorm weights, bf16
    for numel in (H * H, KV * H, KV * H, H * H, INTER * H, INTER * H, H * INTER):
        rows = numel // group
        total += -(-rows // per_word) * group * word + 2 * rows * 2
    return total


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    return read_checkpoint(write_sparse("llama-3.1-70b", tmp_path_factory.mktemp("sp") / "t"))


def plan(ck, dtype: str, cap_gb: int, bits: int | None = None, temperature: float = 0.0):
    req = PlanRequest(
        device="cuda",
        dtype=dtype,
        draft_dtype="bf16",
        ram_free=64 * GB,
        max_gpu_memory=cap_gb * GB,
        ctx=8192,
        budget=1024,
        budget_auto=True,
        self_draft=True,
        draft_bits=bits,
        temperature=temperature,
    )
    return plan_memory(ck, None, req)


def test_nf4_70b_at_44gb_trades_bits_for_resident_layers(llama70b):
    p = plan(llama70b, "nf4", 44)
    assert p.fits and p.device_total <= 44 * GB and p.substitute_bits in (3, 2) and not p.skipped_layers
    streamed = LAYERS - len(p.resident)
    assert 0 < streamed < LAYERS
    assert p.device_bytes["draft"] == streamed * hqq_layer_bytes(p.substitute_bits)
    assert any(
        f"{p.substitute_bits}-bit substitutes of {streamed} of the {streamed} streamed layers" in n for n in p.notes
    )
    assert sorted(c["bits"] for c in p.candidates if c["draft"] == "self") == [2, 3]  # the widths' figures
    assert p.choice["bits"] == p.substitute_bits and p.candidates[-1]["draft"] == "none"  # plain decoding listed
    two, three = plan(llama70b, "nf4", 44, bits=2), plan(llama70b, "nf4", 44, bits=3)
    assert two.fits and three.fits and len(three.resident) < len(two.resident)  # wider: fewer resident
    assert len(p.resident) == len((two, three)[p.substitute_bits - 2].resident)


def test_nf4_70b_at_24gb_fits_by_skipping_a_middle_block(llama70b):
    """At 24 GB the substitutes of all 80 layers need 25.7 GB even at 2 bits: the plan leaves the
    fewest layers without one (the draft skips them) and counts every component. Nothing measured
    yet (a sparse checkpoint): the note says the first load picks them by influence, the plan's
    stand-in is the middle block (tests/test_influence.py: the measured choice)."""
    p = plan(llama70b, "nf4", 24)
    assert p.fits and p.device_total <= 24 * GB and not p.resident, p.reason
    skipped = p.skipped_layers
    start = (LAYERS - len(skipped)) // 2
    assert skipped == list(range(start, start + len(skipped)))  # one block in the middle of the stack
    assert p.device_bytes["draft"] == (LAYERS - len(skipped)) * hqq_layer_bytes(p.substitute_bits)
    assert p.device_bytes["kv_draft"] == 0 and p.kv_rows[1] == 0  # the draft reads the target's KV
    for component in ("lm_head", "quant_states", "kv_target", "activations", "staging_slots", "cuda_context"):
        assert p.device_bytes[component] > 0
    note = f"{p.substitute_bits}-bit substitutes of {LAYERS - len(skipped)} of the 80 streamed layers"
    assert any(
        note in n
        and f"the draft leaves out the {len(skipped)} least influential layers, measured by one "
        f"target pass at the first load (until then the middle block {skipped[0]}-{skipped[-1]} stands in)"
        in n
        for n in p.notes
    )


@pytest.mark.parametrize("cap_gb", [16, 12])
def test_nf4_70b_self_draft_on_small_cards_is_refused_with_the_reason(llama70b, cap_gb):
    p = plan(llama70b, "nf4", cap_gb)
    assert not p.fits and p.skipped_layers
    assert f"leave out {len(p.skipped_layers)} of 80 layers" in p.reason and "a small --draft DIR" in p.reason


def test_bf16_70b_at_80gb_counts_every_streamed_substitute(llama70b):
    p = plan(llama70b, "bf16", 80)
    assert p.fits and p.device_total <= 80 * GB
    streamed = LAYERS - len(p.resident)
    if p.substitute_bits != 4:
        assert p.device_bytes["draft"] == streamed * hqq_layer_bytes(p.substitute_bits)
    # shared KV: one cache, sized for the context plus the draft's largest tree
    assert p.device_bytes["kv_draft"] == 0 and p.kv_rows[1] == 0 and p.kv_rows[0] >= 8192 + 2 * p.budget


def test_4bit_substitutes_of_an_nf4_target_are_refused(llama70b):
    p = plan(llama70b, "nf4", 48, bits=4)
    assert not p.fits and "already 4-bit" in p.reason and "--draft-bits 3 or 2" in p.reason


def test_nothing_streamed_means_the_layer_skip_draft(llama70b):
    from offload.planning.selfplan import default_skip

    p = plan(llama70b, "nf4", 80)
    assert p.fits and not p.ram_layers and not p.disk_layers and p.substitute_bits == 0
    assert len(p.skipped_layers) == default_skip(LAYERS) and p.device_bytes["draft"] == 0
    assert "layers left out" in p.notes[-1]


def test_the_width_choice_uses_the_runs_temperature(llama70b):
    """The expected tokens/pass behind the choice come from the greedy or the sampled measurements
    (offload/planning/acceptance.TOKENS_PER_PASS) by the run's temperature, at the plan's budget."""
    from offload.planning.acceptance import TOKENS_PER_PASS

    greedy, sampled = plan(llama70b, "bf16", 44), plan(llama70b, "bf16", 44, temperature=0.7)
    assert greedy.fits and sampled.fits
    for p, row in ((greedy, "greedy"), (sampled, "sampled")):
        assert {c["bits"] for c in p.candidates if c["draft"] == "self"} == {4, 3, 2}
        for c in (c for c in p.candidates if c["draft"] == "self"):
            pts = sorted(TOKENS_PER_PASS[c["bits"]][row].items())  # log-linear between measured budgets
            b = min(c["budget"], pts[-1][0])  # flat beyond the largest
            if b < pts[0][0]:  # from 1 token at budget 0 to the smallest measured budget
                want = 1 + (pts[0][1] - 1) * math.log1p(b) / math.log1p(pts[0][0])
            else:
                (x0, y0), (x1, y1) = next((a, b_) for a, b_ in itertools.pairwise(pts) if b <= b_[0])
                want = y0 + (y1 - y0) * math.log(b / x0) / math.log(x1 / x0)
            assert c["tokens_per_pass"] == pytest.approx(min(want, c["budget"] + 1), abs=1e-3)
            assert c["tokens_per_pass"] <= c["budget"] + 1  # a tree of B nodes verifies at most B + 1 tokens
