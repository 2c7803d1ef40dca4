"""`specx bench`'s table fits the terminal: at COLUMNS=80 no cell is cut ("…"), whether the records fit
the table (short figures) or need the one-line-per-cell layout (long ones)."""

from __future__ import annotations

import re

import pytest

from specexec_cli.terminal import display


def record(method: str, budget: int, t: float, scale: float, lossless) -> dict:
    return dict(
        temperature=t,
        budget=budget,
        method=method,
        tokens_per_pass=2.345 * scale,
        tokens_per_second=12.345 * scale,
        draft_seconds=1.23 * scale,
        target_seconds=4.56 * scale,
        mean_tree_size=63.5 * scale,
        lossless=lossless,
        budget_independent=method == "ar",
    )


def plain(cell: str) -> str:
    return re.sub(r"\[/?[a-z ]+\]", "", cell)


@pytest.mark.parametrize("scale", [1, 100_000])
def test_no_cell_is_cut_at_80_columns(monkeypatch, capsys, scale):
    monkeypatch.setenv("COLUMNS", "80")
    recs = [
        record(m, b, t, scale, lossless)
        for m, lossless in (("ar", None), ("specinfer", False), ("specexec", True))
        for b in (16, 1024)
        for t in (0.0, 0.7)
    ]
    display.print_bench_table(recs)
    err = capsys.readouterr().err
    assert "…" not in err
    assert max(map(len, err.splitlines())) <= 80
    flat = " ".join(err.split())
    for r in recs:
        for cell in display.bench_cells(r):
            assert plain(cell) in flat, (cell, err)
    table = any(line.split()[:2] == ["T", "budget"] for line in err.splitlines())
    assert table is (scale == 1)  # short figures: the table; long ones: one wrapped line per cell
