"""The plan's draft_step component == what core/draftstep.py holds (CPU, tiny pair), and the terms
of its CUDA formula (membytes.draft_step_terms: mask store, inputs, one graph pool per bucket)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from offload.arch.attention import padded
from offload.planning import membytes
from offload.planning.membytes import Arch, draft_step_terms, pass_bytes
from specexec_cli.core import draftstep, kvcache
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig, generate
from specexec_cli.session.loading import LoadOptions, load_models
from specexec_cli.session.planning import make_plan


def held_bytes(step: draftstep.StaticDraftStep) -> tuple[int, int]:
    """(mask store, pass inputs) bytes the step holds: every tensor it keeps."""
    inputs = sum(t.nbytes for b in step.buffers.values() for t in (b.ids, b.positions, b.rows, b.iota))
    return (0 if step.mask is None else step.mask.nbytes), inputs


def test_constants_mirror_draftstep():
    assert membytes.DRAFT_STEP_ROWS == draftstep.LARGEST
    assert draftstep.BUCKETS["cuda"] == membytes.DRAFT_STEP_BUCKETS
    assert "cpu" not in draftstep.BUCKETS  # the CPU keeps exact widths: the plan counts 1 .. LARGEST
    assert draftstep.new_mask(3, 13, torch.float32, torch.device("cpu")).shape == (3, padded(13))


def test_plan_equals_what_the_step_holds_on_cpu(tiny_pair):
    opts = LoadOptions(target=str(tiny_pair[0]), draft=str(tiny_pair[1]), dtype="fp32", device="cpu", ctx=256)
    shape = TreeShape(budget=8, max_depth=4, max_beams=4)
    plan = make_plan(opts, shape, budget_auto=False)
    assert plan.fits, plan.reason
    models = load_models(replace(opts, plan=plan))
    state = DecodeState()
    list(generate(models, state, [3, 5, 7, 9, 11], GenerationConfig(method="specexec", shape=shape, max_new_tokens=6)))
    cache = state.draft_cache
    step = draftstep._STEPS.get(cache)
    assert step is not None and step.model is models.draft  # decoding ran the draft through the step
    mask, inputs = held_bytes(step)
    rows = plan.kv_rows[1]
    assert kvcache.slab_rows(cache) == rows
    assert mask == 128 * padded(rows) * 4 > 0  # the (LARGEST, rows8) fp32 store, sized once to the slab
    planned = plan.device_bytes["draft_step"]
    assert 0 < inputs < planned - mask  # the widths decoding used: some of the 1 .. 128 the plan counts
    # every other width 1 .. LARGEST once (each a pass over the live rows, then dropped): now every
    # input buffer the CPU step can keep exists, and the store never grew
    start = kvcache.cache_len(cache)
    for b in range(1, draftstep.LARGEST + 1):
        ids = torch.arange(b) % (models.draft.config.vocab_size - 1) + 1
        draftstep.run(models.draft, cache, ids, torch.arange(start, start + b), start, None)
        kvcache.drop_last(cache, b)
    assert kvcache.cache_len(cache) == start and kvcache.slab_rows(cache) == rows  # the slabs never grew
    assert sorted(step.buffers) == list(range(1, draftstep.LARGEST + 1))
    assert sum(held_bytes(step)) == planned


LLAMA_1B = Arch(2048, 8192, 16, 32, 8, 64, 128256, True, 131072)
SMOLLM2_135M = Arch(576, 1536, 30, 9, 3, 64, 49152, True, 8192)


@pytest.mark.parametrize("a", [LLAMA_1B, SMOLLM2_135M])
def test_cuda_formula_terms(a):
    rows, c = 8192 + 2 * 64 + 32 + 1, 2
    t = draft_step_terms(a, rows, c, "sdpa", graphs=True)
    assert t["mask_store"] == 128 * padded(rows) * c  # (LARGEST, rows rounded up to 8) in bf16
    assert t["inputs"] == 4 * 8 * 255  # ids, positions, rows, iota: int64 each, P = 1 .. 128 summed
    # one pool per bucket: a P-row pass over the whole cache, its logits kept, the mask being the store's
    pools = [pass_bytes(a, p, rows, c, "sdpa", p) - p * padded(rows) * c for p in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert t["graph_pools"] == sum(pools)
    no_logits = sum(pass_bytes(a, p, rows, c, "sdpa", 0) - p * padded(rows) * c for p in draftstep.POWERS)
    assert t["graph_pools"] - no_logits == 255 * a.vocab * c  # the logits: 255 rows in all
    if a.vocab == 49152:  # the note's figure: about 25 MB of logits in bf16 at a 49k vocabulary
        assert 24.9e6 < t["graph_pools"] - no_logits < 25.2e6
    # without graphs (CPU, a self-draft's shared cache): no pools, the inputs of every exact width
    cpu = draft_step_terms(a, rows, 4, "sdpa", graphs=False, device="cpu")
    assert cpu == {"mask_store": 128 * padded(rows) * 4, "inputs": 4 * 8 * (128 * 129 // 2), "graph_pools": 0}


def test_plan_counts_draft_step_where_the_step_runs(tiny_pair):
    """CUDA plan of the tiny pair: mask store + inputs + pools; no draft: nothing."""
    from offload.planning.memplan import PlanRequest, plan_memory
    from tests.sparse_ckpt import read_checkpoint

    t, d = read_checkpoint(tiny_pair[0]), read_checkpoint(tiny_pair[1])
    req = PlanRequest(device="cuda", dtype="bf16", draft_dtype="bf16", ram_free=64 << 30, max_gpu_memory=8 << 30)
    plan = plan_memory(t, d, req)
    da = membytes.arch_of(d.config)
    assert plan.device_bytes["draft_step"] == sum(draft_step_terms(da, plan.kv_rows[1], 2, "sdpa", True).values())
    assert plan_memory(t, None, replace(req, draft_dtype=None)).device_bytes["draft_step"] == 0


def test_dry_run_shows_the_draft_step(tiny_pair, tmp_path):
    import json

    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    stats = tmp_path / "plan.json"
    args = ["run", "unused.txt", "--target", tiny_pair[0], "--draft", tiny_pair[1], "--device", "cpu"]
    res = CliRunner().invoke(app, [str(a) for a in args + ["--dry-run", "--stats-json", stats]])
    assert res.exit_code == 0, res.output
    plan = json.loads(stats.read_text())["plan"]
    assert plan["device_bytes"]["draft_step"] > 0 and "draft_step" in res.stdout
