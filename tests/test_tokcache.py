"""A GGUF's tokenizer is built from its metadata once per machine, then read from saved files
(offload/formats/tokcache.py): the saved one encodes, decodes and renders chat exactly as the one
transformers builds, and a changed file builds again."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("gguf")

from offload.formats import open_checkpoint, tokcache
from tests.conftest import make_model
from tests.gguf_build import write_gguf

TEXTS = ["hello world", "def f(x):\n    return x  # ünï", "<eos>abc<eos>", "   spaces  ", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <eos> there"}]


def _same(a, b, template: bool) -> None:
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        ids = a.encode(text)
        assert a.decode(ids) == b.decode(ids)
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id, len(a)) == (
        b.bos_token_id,
        b.eos_token_id,
        b.pad_token_id,
        len(b),
    )
    if template:
        kw = dict(tokenize=False, add_generation_prompt=True)
        assert a.apply_chat_template(MESSAGES, **kw) == b.apply_chat_template(MESSAGES, **kw)


def test_saved_tokenizer_equals_the_built_one_and_a_changed_file_rebuilds(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    f = write_gguf(make_model(tmp_path / "hf", seed=3), tmp_path / "m" / "t.gguf", "Q8_0", chat_template=template)
    built = AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)
    first = open_checkpoint(f).load_tokenizer()  # builds and saves
    saved = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer.json").exists()
    calls = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(k) or real(*a, **k))
    second = open_checkpoint(f).load_tokenizer()  # read from the saved files
    assert calls and all("gguf_file" not in k for k in calls)
    _same(built, first, True)
    _same(built, second, True)
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))  # the file changed
    calls.clear()
    open_checkpoint(f).load_tokenizer()
    assert any("gguf_file" in k for k in calls) and len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2


def test_unwritable_cache_still_loads(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SPECX_CACHE", str(blocker))
    f = write_gguf(make_model(tmp_path / "hf", seed=3), tmp_path / "m" / "t.gguf", "Q8_0")
    tok = tokcache.gguf_tokenizer(f.parent, f.name)
    assert tok.encode("hello") == open_checkpoint(f).load_tokenizer().encode("hello")


@pytest.mark.slow
def test_real_model_saved_tokenizer_is_the_same(smollm2, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("SPECX_CACHE", str(tmp_path))
    built = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    tokcache.gguf_tokenizer(smollm2.parent, smollm2.name)
    _same(built, tokcache.gguf_tokenizer(smollm2.parent, smollm2.name), True)
