"""tools/gpu_day.py's `step` phase on the CPU: its splits, its modelled column, the replayed acceptance, the trace.

The smoke run is the phase with tiny shapes (4 nf4 layers from disk, the tiny draft): both budgets and
both modes must report the four splits and the step, each positive; every modelled figure must be the
speed model's (passcost's pass terms and draftcost's forwards x draft step, recomputed here from the
phase's recorded inputs); the target must have accepted exactly what the trace says. The replay is
checked on a hand-built tree through the real accept_tree, the trace file for its format and size.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.gpuday import replay, tables, trace  # noqa: E402

SPLITS = ("draft", "stream", "verify", "accept", "step")


@pytest.fixture(scope="module")
def phase(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpuday-step") / "out"
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_day.py"), "run", "--smoke", "--phase", "step", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 4, proc.stderr[-3000:]  # the other phases are left, step is done
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == [] and "step" in summary["done"], summary
    return summary["phases"]["step"]["data"], summary["phases"]["probe"]["data"], summary


def modelled(d: dict, b: dict, card: dict) -> dict:
    """The speed model's figures for one budget, from passcost and draftcost's parts (not predict.py)."""
    from offload.planning import draftcost, passcost
    from offload.planning.membytes import arch_of

    dev = passcost.device_for(
        "cpu",
        memory_bps=card["memory_bps"],
        link_bps=card["link_bps"],
        flops16=card["bf16_flops"],
        flops32=card["fp32_flops"],
    )
    layers, past, budget = d["layers"], d["past"], b["budget"]
    plan = SimpleNamespace(layer_bytes=[d["layer_bytes"]] * layers, ram_layers=list(range(layers)), disk_layers=[])
    t = passcost.target_pass(
        arch_of(dict(d["shape"], num_hidden_layers=layers)), plan, dev, budget + 1, past, 2, "nf4-dequant"
    )
    ds = d["draft_shape"]
    da = arch_of(dict({k: v for k, v in ds.items() if k != "layers"}, num_hidden_layers=ds["layers"]))
    weight = d["draft_bytes"] - da.vocab * da.hidden * 2  # the untied input embedding is only looked up
    kv = 2 * da.layers * da.kv_heads * da.head_dim * past * 2
    rows = draftcost.draft_rows(budget, 32)
    draft = draftcost.forwards_per_tree(budget, 32, b["trace"]["tokens_per_pass"]) * passcost.draft_step(
        weight, kv, 0, weight * rows, dev, 2
    )
    compute = t.gemm + t.dequant + t.attention + t.head + t.floor
    hidden = min(draft, d["staging_bytes"] / dev.link_bps, max(0.0, t.seconds - compute))
    return dict(
        draft=draft, stream=t.stream, verify=t.gemm + t.dequant + t.attention + t.head, step=t.seconds + draft - hidden
    )


@pytest.mark.slow
def test_the_step_phase_reports_four_positive_splits_per_budget_and_mode(phase):
    d, _, _ = phase
    assert [b["budget"] for b in d["budgets"]] == [256, 1024] and d["layers"] == 4
    for b in d["budgets"]:
        for mode in ("without", "with"):
            got = {k: b[mode][k] for k in SPLITS}
            assert all(v > 0 for v in got.values()), (b["budget"], mode, got)
            assert len(b[mode]["steps"]) == d["repeats"] + 1


@pytest.mark.slow
def test_the_modelled_column_is_the_speed_model(phase):
    d, card, _ = phase
    for b in d["budgets"]:
        p = b["predicted"]
        assert "draftcost" in p["model"] and "passcost" in p["model"]
        want = modelled(d, b, card)
        assert {k: p[k] for k in want} == pytest.approx(want, rel=1e-5)  # PassTerms.to_json keeps 6 digits
        assert "accept" not in p  # the model has no accept term: the table says so


@pytest.mark.slow
def test_the_target_accepted_what_the_trace_says(phase):
    d, _, _ = phase
    tr = trace.load()
    for b in d["budgets"]:
        lengths = trace.accepted(tr, b["budget"])[: d["repeats"] + 1]
        for mode in ("without", "with"):
            rep = b[mode]["replayed"]
            assert rep["capped"] == 0 and rep["accepted"] == lengths, (b["budget"], mode, rep)
            assert [s["tokens"] for s in b[mode]["steps"]] == [n + 1 for n in lengths]


@pytest.mark.slow
def test_the_step_table_renders_every_split_beside_its_model(phase):
    _, _, summary = phase
    text = tables.render(summary)["step"]
    for budget in (256, 1024):
        for mode in ("without", "with"):
            for part in SPLITS:
                assert f"| {budget} | {mode} | {part} | " in text
    assert text.count("not modelled") == 4  # accept, per budget and mode


def _tree():
    """root(5) -> 10 (-0.1) -> {20 (-0.3), 21 (-0.2) -> 30 (-0.5)}; root -> 11 (-1.0)."""
    from specexec_cli.core.tree import Tree, subtree, top_budget

    tree = Tree.new(5)
    for parent, token, lp in ((0, 10, -0.1), (0, 11, -1.0), (1, 20, -0.3), (1, 21, -0.2), (4, 30, -0.5)):
        tree.add(torch.tensor([parent]), torch.tensor([token]), torch.tensor([lp]))
    return tree, subtree(tree, top_budget(tree.logp, 5))


def test_the_replay_makes_accept_tree_take_the_best_path_of_the_traced_length():
    from specexec_cli.core import verify
    from specexec_cli.core.sampling import SamplingParams

    tree, vt = _tree()
    logits = torch.randn(vt.size, 40, generator=torch.Generator().manual_seed(0))
    rep = replay.Replay([2, 5, 0])
    rep.tree = tree
    original = verify.walk
    with rep.patched():
        got = [verify.accept_tree(vt, logits, SamplingParams(), None, 0, frozenset(), 100) for _ in range(3)]
    assert verify.walk is original
    assert [a.tokens for a in got] == [[10, 21, 1], [10, 21, 30, 1], [1]]  # bonus: the smallest id no child holds
    assert all(a.bonus for a in got) and [len(a.path) for a in got] == [2, 3, 0]
    assert rep.accepted == [2, 3, 0] and rep.capped == 1  # 5 asked, the tree is 3 deep


def test_the_shipped_trace_is_small_and_well_formed():
    tr = trace.load()
    assert trace.TRACE.stat().st_size < 16 << 10
    assert set(tr["budgets"]) == {"256", "1024"}
    for rec in tr["budgets"].values():
        n = len(rec["accepted"])
        assert n >= 20 and len(rec["tree_depth"]) == n and len(rec["draft_forwards"]) == n
        assert all(0 <= a <= t for a, t in zip(rec["accepted"], rec["tree_depth"]))
        assert all(f >= 1 for f in rec["draft_forwards"])


def test_tables_write_into_bench_blocks_and_leave_a_page_without_them_untouched(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# P\n\n<!-- bench:gpuday-card -->\nold\n<!-- /bench:gpuday-card -->\n\ntail\n")
    tables.write_tables(page, {"card": "| new |"})
    assert page.read_text() == "# P\n\n<!-- bench:gpuday-card -->\n| new |\n<!-- /bench:gpuday-card -->\n\ntail\n"
    before = page.read_text()
    with pytest.raises(SystemExit, match="gpuday-step"):
        tables.write_tables(page, {"card": "| newer |", "step": "| s |"})
    assert page.read_text() == before
