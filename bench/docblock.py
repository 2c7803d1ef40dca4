"""The one marker dialect of generated text in the docs: `<!-- bench:NAME -->` ... `<!-- /bench:NAME -->`.

Contract: a page holds a block as `<!-- bench:NAME -->\\n{body}\\n<!-- /bench:NAME -->`, at most once per
NAME. `replace_block(text, name, body)` returns `text` with that block's body replaced (ValueError
unless the text holds it exactly once); `write_block(page, name, body)` does so to a file, or exits
with a one-line message naming the page and the missing markers; `read_block(page, name)` returns
the body as `write_block` wrote it; `block_names(text)` lists a text's blocks in order (ValueError on
an unclosed one). `md_table(header, rows)` is the markdown table the generators write: a header
row, `|---|` per column, then one line per row, each cell `str()`-ed and joined by ` | `.
Which script, JSON and renderer make each block: bench/manifest.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

OPEN = re.compile(r"<!-- bench:([a-z0-9_.-]+) -->")


def markers(name: str) -> tuple[str, str]:
    """The opening and closing marker of block `name`."""
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def block_names(text: str) -> list[str]:
    """The names of the blocks in `text`, in order; ValueError on one opened and never closed."""
    names = OPEN.findall(text)
    unclosed = [n for n in names if markers(n)[1] not in text.split(markers(n)[0], 1)[1]]
    if unclosed:
        raise ValueError(f"unclosed block(s): {', '.join(unclosed)}")
    return names


def _span(text: str, name: str) -> tuple[int, int]:
    """Where block `name`'s body lies in `text` (between the markers' newlines)."""
    start, end = markers(name)
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"needs exactly one {start} ... {end} block")
    lo, hi = text.index(start) + len(start), text.index(end)
    if hi < lo:
        raise ValueError(f"{end} comes before {start}")
    return lo, hi


def read_body(text: str, name: str) -> str:
    """The body of block `name` in `text`, without the newlines that follow and precede the markers."""
    lo, hi = _span(text, name)
    body = text[lo:hi]
    body = body[1:] if body.startswith("\n") else body
    return body[:-1] if body.endswith("\n") else body


def replace_block(text: str, name: str, body: str) -> str:
    """`text` with block `name`'s body replaced by `body`."""
    lo, hi = _span(text, name)
    return text[:lo] + "\n" + body + "\n" + text[hi:]


def read_block(page: Path, name: str) -> str:
    """The body of block `name` in `page`, as `write_block` wrote it."""
    return read_body(Path(page).read_text(), name)


def write_block(page: Path, name: str, table: str) -> None:
    """Replace block `name`'s body in `page` with `table`; exit with one line when the block is missing."""
    text = Path(page).read_text()
    try:
        page_text = replace_block(text, name, table)
    except ValueError as exc:
        raise SystemExit(f"{page}: {exc}") from None
    Path(page).write_text(page_text)


def md_table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: the header, its `|---|` line and one line per row."""

    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(c) for c in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(r) for r in rows])
