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
    return dict(row=name, tokens=96, decode_seconds=96 / tps, tokens_per_second=tps, tokens_per_pass=2.0,
                method=method, budgets=budgets, notice=notice, lossless=lossless)


def test_table_block(tmp_path):
    mod = load()
    note = ("--draft auto: plain decoding is modelled faster (1.35 tokens/s against 0.50 for the self-draft "
            "at 4 bits), so decoding runs without a draft")
    rows = [row("budget auto", 4.0, [1, 1]), row("budget 15", 8.0, [15, 15]), row("budget 31", 10.0, [31, 31]),
            dict(row="budget 63", error="boom"), row("draft auto", 2.0, [16, 16], "ar", note),
            row("draft self", 12.0, [15, 31]), row("draft none", 2.0, [64, 64], "ar", lossless=None)]
    by = {r["row"]: r for r in rows}
    data = dict(prompts=[1, 4], n=48, rows=rows, ratios=mod.ratios(by))
    assert data["ratios"]["budget"] == dict(auto="budget auto", best="budget 31", ratio=0.4)
    assert data["ratios"]["draft"] == dict(auto="draft auto", best="draft self", ratio=round(2 / 12, 3))
    page = tmp_path / "perf.md"
    page.write_text("# P\n\n<!-- bench:auto-choices -->\nold\n<!-- /bench:auto-choices -->\n\ntail\n")
    mod.write_doc(data, page)
    text = page.read_text()
    assert text.startswith("# P\n\n<!-- bench:auto-choices -->\n") and text.endswith("<!-- /bench:auto-choices -->\n\ntail\n")
    assert "old" not in text and "../shared" not in text
    assert "auto ÷ best explicit = **0.40** (budget auto against budget 31)" in text
    assert "auto ÷ best explicit = **0.17** (draft auto against draft self)" in text
    assert "| plain decoding; plain decoding is modelled faster (1.35 tokens/s against 0.50 for the " \
        "self-draft at 4 bits) |" in text
    assert "| budget | 63 | - | - | failed: boom | - |" in text
    assert "budget 15, 31" in text
