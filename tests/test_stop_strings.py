"""A checkpoint's own stop strings (an ollama name's params) end `specx run` and `specx chat` replies: the text
stops before the first one, which is never shown."""

from __future__ import annotations

import pytest

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import GenerationConfig
from specexec_cli.session.chat import ChatSession
from specexec_cli.session.loading import LoadOptions, load_models
from specexec_cli.terminal.streaming import decode_to_stdout

CFG = GenerationConfig(shape=TreeShape(8, 8), max_new_tokens=16)


@pytest.fixture(scope="module")
def models(tiny_pair):
    return load_models(LoadOptions(str(tiny_pair[0]), str(tiny_pair[1]), dtype="fp32", device="cpu"))


def _stop_in(text: str) -> str:
    """Two characters that first occur past the text's start (the reply must end right before them)."""
    return next(text[i : i + 2] for i in range(1, len(text) - 2) if text.find(text[i : i + 2]) == i)


def _run(models, capsys) -> tuple[str, str | None]:
    ids = models.tokenizer("def f(x):")["input_ids"]
    stats = decode_to_stdout(models, ids, CFG, live=False, stats_json=None)
    return capsys.readouterr().out, stats.finish


def _chat(models) -> tuple[str, ChatSession, str | None]:
    out: list[str] = []
    session = ChatSession(models, CFG, code=True)
    stats = session.reply("def f(x):", out.append)
    return "".join(out), session, stats.finish


def test_run_stops_before_the_checkpoints_stop_string(models, capsys):
    full, finish = _run(models, capsys)
    stop = _stop_in(full.rstrip("\n"))
    models.stop_strings = (stop,)
    try:
        cut, cut_finish = _run(models, capsys)
    finally:
        models.stop_strings = ()
    assert finish == "length" and cut.rstrip("\n") == full[: full.find(stop)] and cut_finish == "stop"


def test_chat_reply_stops_before_it_and_keeps_only_the_shown_text(models):
    full, _, _ = _chat(models)
    stop = _stop_in(full)
    models.stop_strings = (stop,)
    try:
        cut, session, finish = _chat(models)
    finally:
        models.stop_strings = ()
    assert cut == full[: full.find(stop)] and finish == "stop"
    assert session.messages[-1] == {"role": "assistant", "content": cut}
