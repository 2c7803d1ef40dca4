"""One generated table in a docs page: the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`.

Contract: `write_block(page, name, table)` replaces that block's body with `table`, or exits with a
one-line message naming the page and the missing markers. The benchmarks' `--table` modes use it.
"""

from __future__ import annotations

from pathlib import Path


def write_block(page: Path, name: str, table: str) -> None:
    text = page.read_text()
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    if start not in text or end not in text:
        raise SystemExit(f"{page} has no {start} ... {end} block")
    head, rest = text.split(start, 1)
    page.write_text(head + start + "\n" + table + "\n" + end + rest.split(end, 1)[1])
