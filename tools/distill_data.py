"""Training text for tools/distill_draft.py: chat prompts for the teacher to answer, and offline prose/code.

Contract
--------
`chat_prompts(n, seed)` -> n distinct user messages (str), built from fixed templates x topics and shuffled
by `seed`. They are deliberately unlike the prompts bench/distilled_draft.py measures on (those are
written out there; tests/test_distill_draft.py checks that none of them is produced here).

`offline_texts(limit_chars, seed)` -> a list of strings found on this machine without any network: the
docstrings (prose) and the source (code) of the Python standard library's .py files, read with `ast` and
never imported (importing `antigravity` opens a browser, `this` prints). Files under test/, tests/,
idlelib/, lib2to3/ and site-packages/ are skipped. The order is shuffled by `seed`; the total is capped
at about `limit_chars` characters, half docstrings, half source.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

TEMPLATES = (
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Give me three facts about {t}.",
    "Why is {t} important?",
    "Write a short paragraph about {t}.",
    "How would you teach {t} to a child?",
    "What are the pros and cons of {t}?",
    "Summarize the history of {t} in a few sentences.",
    "List some common misconceptions about {t}.",
    "Write a short poem about {t}.",
    "How does {t} work?",
    "Can you compare {t} with something similar?",
)
TOPICS = (
    "photosynthesis",
    "the water cycle",
    "black holes",
    "the Roman Empire",
    "machine learning",
    "volcanoes",
    "the stock market",
    "climate change",
    "the human heart",
    "electric cars",
    "honey bees",
    "the internet",
    "vaccines",
    "the moon landing",
    "coffee",
    "chess",
    "the French Revolution",
    "gravity",
    "rainbows",
    "sleep",
    "recycling",
    "the Pacific Ocean",
    "dinosaurs",
    "democracy",
    "solar panels",
    "bread baking",
    "the immune system",
    "earthquakes",
    "jazz music",
    "the printing press",
    "renewable energy",
    "DNA",
    "Python programming",
    "binary numbers",
    "a healthy diet",
    "meditation",
    "the Great Wall of China",
    "the periodic table",
    "interest rates",
    "time zones",
    "the Olympic Games",
    "coral reefs",
    "tea",
    "public speaking",
    "the theory of evolution",
    "batteries",
    "spiders",
    "the Renaissance",
    "inflation",
    "composting",
    "glaciers",
    "cryptography",
    "the Amazon rainforest",
    "hiking safety",
    "the violin",
    "sorting algorithms",
    "friendship",
    "the speed of light",
    "origami",
    "bicycles",
    "the Silk Road",
)


def chat_prompts(n: int, seed: int) -> list[str]:
    """n distinct user messages, shuffled by seed (all template x topic pairs first, then repeats)."""
    pairs = [tpl.format(t=topic) for topic in TOPICS for tpl in TEMPLATES]
    random.Random(seed).shuffle(pairs)
    return pairs[:n]


SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts))


def _docstrings(tree: ast.AST) -> list[str]:
    """Every module/class/function docstring of a parsed file, stripped of leading indentation."""
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    docs = (ast.get_docstring(n) for n in nodes)
    return [d for d in docs if d and len(d) > 40]


def offline_texts(limit_chars: int, seed: int) -> list[str]:
    """About limit_chars characters of stdlib docstrings (half) and source (half), shuffled by seed."""
    files = _stdlib_files()
    random.Random(seed).shuffle(files)
    docs: list[str] = []
    code: list[str] = []
    n_docs = n_code = 0
    half = limit_chars // 2
    for path in files:
        if n_docs >= half and n_code >= half:
            break
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        if n_docs < half:
            found = _docstrings(tree)
            docs.extend(found)
            n_docs += sum(map(len, found))
        if n_code < half:
            code.append(src[:8000])  # the head of a file: imports, classes, a few functions
            n_code += len(code[-1])
    texts = docs + code
    random.Random(seed + 1).shuffle(texts)
    return texts
