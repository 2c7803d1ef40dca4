"""bench/auto_choices.py's --table: a tiny fake result renders into a page's auto-choices block,
with auto ÷ best explicit per choice, the draft auto took, failed rows marked, and the rest of
the page untouched."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("auto_choices", ROOT / "bench" / "auto_choices.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(name, tps, budgets, method="specexec", notice=None, lossless=True):
    return dict(
        row=name,
        tokens=96,
        decode_seconds=96 / tps,
        tokens_per_second=tps,
        tokens_per_pass=2.0,
        method=method,
        budgets=budgets,
        notice=notice,
        lossless=lossless,
    )


def test_table_block(tmp_path):
    mod = load()
    note = (
        "--draft auto: plain decoding is modelled faster (1.35 tokens/s against 0.50 for the self-draft "
        "at 4 bits), so decoding runs without a draft"
    )
    rows = [
        row("budget auto", 4.0, [1, 1]),
        row("budget 15", 8.0, [15, 15]),
        row("budget 31", 10.0, [31, 31]),
        dict(row="budget 63", error="boom"),
        row("draft auto", 2.0, [16, 16], "ar", note),
        row("draft self", 12.0, [15, 31]),
        row("draft none", 2.0, [64, 64], "ar", lossless=None),
    ]
    by = {r["row"]: r for r in rows}
    data = dict(prompts=[1, 4], n=48, rows=rows, ratios=mod.ratios(by))
    assert data["ratios"]["budget"] == dict(auto="budget auto", best="budget 31", ratio=0.4)
    assert data["ratios"]["draft"] == dict(auto="draft auto", best="draft self", ratio=round(2 / 12, 3))
    page = tmp_path / "perf.md"
    page.write_text("# P\n\n<!-- bench:auto-choices -->\nold\n<!-- /bench:auto-choices -->\n\ntail\n")
    mod.write_doc(data, page)
    text = page.read_text()
    assert text.startswith("# P\n\n<!-- bench:auto-choices -->\n") and text.endswith(
        "<!-- /bench:auto-choices -->\n\ntail\n"
    )
    assert "old" not in text and "../shared" not in text
    assert "auto ÷ best explicit = **0.40** (budget auto against budget 31)" in text
    assert "auto ÷ best explicit = **0.17** (draft auto against draft self)" in text
    assert (
        "| plain decoding; plain decoding is modelled faster (1.35 tokens/s against 0.50 for the "
        "self-draft at 4 bits) |" in text
    )
    assert "| budget | 63 | - | - | failed: boom | - |" in text
    assert "budget 15, 31" in text


def test_real_block_has_a_table_per_tier_and_the_width_ratio(tmp_path):
    mod = load()
    tiers = {}
    for tier, plain in (("resident", 50.0), ("disk", 12.0)):
        rows = [
            row("draft auto", plain, [16, 16], "ar"),
            row("draft self", 6.0, [15, 31]),
            row("draft none", plain, [16, 16], "ar", lossless=None),
            row("self budget 15", 7.0, [15, 15]),
            row("self budget 63", 5.0, [63, 63]),
            row("self bits 3", 6.6, [15, 15]),
            dict(row="self bits 2", error="nothing to substitute"),
        ]
        tiers[tier] = dict(rows=rows, ratios=mod.ratios({r["row"]: r for r in rows}))
    assert tiers["disk"]["ratios"]["width of the self-draft"] == dict(
        auto="draft self", best="self bits 3", ratio=round(6 / 6.6, 3)
    )
    assert tiers["disk"]["ratios"]["draft"]["ratio"] == 1.0
    page = tmp_path / "perf.md"
    page.write_text("<!-- bench:auto-choices-real -->\n<!-- /bench:auto-choices-real -->\n")
    mod.write_real_doc(dict(prompts=[0, 1], n=32, tiers=tiers), page)
    text = page.read_text()
    assert "**every layer resident**" in text and "**streamed from disk" in text
    assert "`--draft self --draft-bits 3`" in text and "failed: nothing to substitute" in text
