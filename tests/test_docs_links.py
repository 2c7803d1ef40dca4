"""Every relative link and #anchor in README.md, CONTRIBUTING.md, bench/README.md and docs/*.md resolves.

A link `[text](path#anchor)` outside code must name a file or folder that exists (relative to the
page that holds it) and, when it carries an anchor into a markdown page, a heading of that page as
GitHub spells it (lower case, punctuation dropped, spaces to hyphens, `-1`, `-2` for repeats).
External links (http, https, mailto) are not fetched. The last tests prove the checker fails on a
broken path and a broken anchor.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", lambda m: m.group(0) if "](" not in m.group(0) else "``", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").replace("*", "").lower().strip()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(page.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """`page: target (why)` for every relative link of `page` that does not resolve."""
    bad = []
    for line in prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.name}: {target} (no heading #{anchor} in {dest.name})")
    return bad


def pages() -> list[Path]:
    return [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "bench" / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
    ]


def test_every_relative_link_resolves():
    assert len(pages()) > 5
    assert [b for p in pages() for b in broken_links(p)] == []


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text() + (ROOT / "docs" / "README.md").read_text()
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md" and p.name not in readme]
    assert unlinked == []


def test_github_slugs():
    assert (
        slug("`--draft self`: the target's own low-bit substitute") == "--draft-self-the-targets-own-low-bit-substitute"
    )
    assert slug("1. Grow a tree with the draft (SpecExec)") == "1-grow-a-tree-with-the-draft-specexec"
    assert slug("Sampling (T > 0) shares its randomness") == "sampling-t--0-shares-its-randomness"


def test_a_broken_path_and_a_broken_anchor_are_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nSee [ok](other.md#a-section), [top](#page), [dir](.), [web](https://example.com/x),\n"
        "[gone](missing.md), [bad anchor](other.md#no-such-section), [self](#nowhere) and\n"
        "[code block heading](other.md#not-a-heading).\n\n```text\n[in code](missing-too.md)\n```\n"
    )
    assert broken_links(page) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#no-such-section (no heading #no-such-section in other.md)",
        "page.md: #nowhere (no heading #nowhere in page.md)",
        "page.md: other.md#not-a-heading (no heading #not-a-heading in other.md)",
    ]
