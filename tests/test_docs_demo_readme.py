"""tools/demo_pair_readme.py writes the demo pair's README from make_demo_pair's record, and the
docs section it points to exists (docs/performance.md, "The embedded demo pair")."""

from __future__ import annotations

from tests.conftest import ROOT, load_script
from tests.test_docs_links import anchors

MODEL = {"params": 1234, "shape": "2 x 64", "steps": 3, "tokens": 4096, "seconds": 1.0, "cpu_seconds": 2.0, "mb": 0.5}
INFO = {
    "command": "python tools/make_demo_pair.py --out /tmp/x",
    "seed": 1,
    "threads": 2,
    "corpus": "stdlib",
    "vocab": 4096,
    "batch": 8,
    "lrs": "0.004",
    "draft_obj": "cross-entropy",
    "target": MODEL,
    "draft": MODEL,
    "quality": {"eval_tokens": 100, "target_loss": 2.0, "draft_loss": 2.5, "top1_agreement": 0.5},
    "sample": {"nonblank_fraction": 0.9, "lines": 10, "text": "def f():\n    return 1\n"},
}


def test_the_demo_readme_records_the_run_and_points_at_the_docs(tmp_path):
    load_script("tools/demo_pair_readme.py").write_readme(tmp_path, INFO, "<|endoftext|>", 256)
    text = (tmp_path / "README.md").read_text()
    assert INFO["command"] in text and "| target | 1,234 | 2 x 64 |" in text and "def f():" in text
    assert '`docs/performance.md`, section "The embedded demo pair"' in text
    assert "the-embedded-demo-pair" in anchors(ROOT / "docs" / "performance.md")
