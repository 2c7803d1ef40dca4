"""specx chat: scripted turns, KV reuse across turns, commands, templates, overflow and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import GenerationConfig
from specexec_cli.session.chat import ChatSession, common_prefix
from specexec_cli.session.loading import LoadOptions, load_models
from specexec_cli.terminal.app import app

TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


@pytest.fixture(autouse=True)
def no_user_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def models(tiny_pair):
    return load_models(LoadOptions(str(tiny_pair[0]), str(tiny_pair[1]), dtype="fp32", device="cpu"))


def chat(tiny_pair, text: str, *args: str):
    target, draft = tiny_pair
    result = CliRunner().invoke(
        app,
        ["chat", "--target", str(target), "--draft", str(draft), "--dtype", "fp32", "--device", "cpu", *args],
        input=text,
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result


def turns(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def hf_greedy(m, ids, n):
    out = m.target.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_second_turn_prefills_only_new_tokens_and_stays_lossless(tiny_pair, models, tmp_path):
    log = tmp_path / "turns.jsonl"
    res = chat(tiny_pair, "def f(x):\nclass a:\n", "--max-new-tokens", "16", "--budget", "8", "--stats-json", str(log))
    assert res.exit_code == 0, res.stderr
    t1, t2 = turns(log)
    assert (t1["turn"], t2["turn"]) == (1, 2)
    tok = models.tokenizer
    first = tok("User: def f(x):\nAssistant:")["input_ids"]
    new = tok("\nUser: class a:\nAssistant:", add_special_tokens=False)["input_ids"]
    assert t1["prefill_tokens"] == len(first)
    assert t2["prefill_tokens"] <= len(new) + 1  # + the last reply token (the root) at most
    assert t2["context_tokens"] > t1["context_tokens"] > t2["prefill_tokens"]
    # the reused caches give exactly what a fresh greedy run over the whole conversation gives
    history = first + [t for t in t1["token_ids"] if t not in models.eos_ids] + new
    assert t2["token_ids"] == hf_greedy(models, history, len(t2["token_ids"]))
    # scriptable stdout: one line per reply (replies may span lines; each ends with a newline)
    assert res.stdout.endswith("\n") and "User:" not in res.stdout
    assert "no chat template" in res.stderr and "2 turns" in res.stderr


def test_set_clear_save_round_trip_and_hints(tiny_pair, tmp_path):
    a, b, log = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "t.jsonl"
    script = (
        f"def f(x):\n/set max_new_tokens 5\n/set temperature -1\n/set top_k many\n/set bogus 1\n"
        f'/save {a}\n/clear\n"""\nx = 1\ny = 2\n"""\n/save {b}\n/stats\n/frobnicate\n/help\n/exit\nnever\n'
    )
    res = chat(tiny_pair, script, "--max-new-tokens", "12", "--stats-json", str(log))
    assert res.exit_code == 0, res.stderr
    err = res.stderr
    assert "temperature must be >= 0" in err and "needs an integer" in err and "unknown setting 'bogus'" in err
    assert "unknown command /frobnicate; type /help" in err and "/save FILE" in err
    saved_a, saved_b = json.loads(a.read_text()), json.loads(b.read_text())
    assert saved_a["version"] == 1 and saved_a["settings"]["max_new_tokens"] == 5
    assert [m["role"] for m in saved_a["messages"]] == ["user", "assistant"]
    reply1 = saved_a["messages"][1]["content"]
    assert res.stdout.startswith(reply1)
    assert next(m["content"] for m in saved_b["messages"]) == "x = 1\ny = 2"  # multi-line, fresh history
    t1, t2 = turns(log)
    assert t1["new_tokens"] <= 12 and t2["new_tokens"] <= 5
    assert t2["context_tokens"] == t2["prefill_tokens"] + t2["new_tokens"]  # /clear: full re-prefill
    assert len(turns(log)) == 2  # "never" came after /exit


def test_set_budget_auto_builds_the_tuner_a_run_would_and_a_number_drops_it(models):
    """`/set budget auto` gives the session the tuner of its models (resident on the CPU: the prior's
    timings) and decodes with it; `/set budget 8` goes back to a fixed budget."""
    from specexec_cli.core.budget import BudgetTuner

    s = ChatSession(models, GenerationConfig(shape=TreeShape(8, 8), max_new_tokens=6))
    assert s.set_option("budget", "auto") == f"budget auto (now {s.tuner.shape.budget})"
    assert isinstance(s.tuner, BudgetTuner) and s.tuner.timing.source == "prior"
    assert s.settings()["budget"] == "auto" and s.reply("def f(x):", lambda text: None).new_tokens > 0
    assert s.set_option("budget", "8") == "budget = 8" and s.tuner is None and s.cfg.shape.budget == 8


def test_context_overflow_is_a_message_not_a_crash(tiny_pair, tmp_path):
    res = chat(tiny_pair, "a" * 600 + "\ndef f(x):\n", "--max-new-tokens", "4", "--stats-json", str(tmp_path / "t"))
    assert res.exit_code == 0, res.stderr
    assert "no longer fits" in res.stderr and "/clear" in res.stderr
    assert len(turns(tmp_path / "t")) == 1  # the next turn still works


def test_template_turns_reuse_the_prefix_and_recover_from_divergence(models):
    tok = models.tokenizer
    tok.chat_template = TEMPLATE
    try:
        cfg = GenerationConfig(shape=TreeShape(16, 16), max_new_tokens=10)
        s = ChatSession(models, cfg, system="be brief")
        assert s.templated
        out: list[str] = []
        s.reply("def f(x):", out.append)
        committed = len(s.state.ids)
        st2 = s.reply("class a:", out.append)
        assert st2.prompt_tokens < committed  # only the new turn's suffix was prefilled
        # divergence: rewrite the history; the rendering no longer extends the committed ids
        s.messages[1]["content"] = "import os"
        full = s._render(s.messages + [{"role": "user", "content": "x"}])
        keep = common_prefix(full, s.state.ids)
        st3 = s.reply("x", out.append)
        assert st3.prompt_tokens == len(full) - keep
        ref = hf_greedy(models, full, len(st3.token_ids))
        assert st3.token_ids == ref
        assert s.state.target_len == len(s.state.ids) - 1 or st3.finish == "eos"
    finally:
        tok.chat_template = None


NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)


def test_a_template_that_rejects_the_system_role_gets_it_folded(models):
    """Gemma-2's template raises for a system message: `specx chat --system` folds it into the first
    user turn (as llama.cpp and ollama do); a template error for another reason is a TemplateError."""
    from specexec_cli.session.chat import TemplateError, render_template

    tok = models.tokenizer
    tok.chat_template = NO_SYSTEM
    try:
        s = ChatSession(models, GenerationConfig(shape=TreeShape(8, 8), max_new_tokens=6), system="be brief")
        out: list[str] = []
        s.reply("def f(x):", out.append)
        s.reply("x = 1", out.append)
        assert s.turn_stats[1].prompt_tokens < len(s.state.ids) // 2  # the folded rendering is stable: reused
        assert render_template(tok, s.messages[:2]) == "u: be brief\n\ndef f(x):\na:"
        with pytest.raises(TemplateError, match="roles must alternate"):
            render_template(
                tok,
                [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": "b"},
                ],
            )
    finally:
        tok.chat_template = None


def test_ctrl_c_mid_reply_keeps_the_partial_reply(tiny_pair, random_draft, tmp_path):
    """SIGINT a real `specx chat` process mid-reply: partial reply kept, clean exit with a summary."""
    log, saved = tmp_path / "t.jsonl", tmp_path / "c.json"
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "xdg"), PYTHONUNBUFFERED="1")
    env.pop("SPECX_DEBUG", None)
    cmd = [
        sys.executable,
        "-m",
        "specexec_cli",
        "chat",
        "--target",
        str(tiny_pair[0]),
        "--draft",
        str(random_draft),
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--budget",
        "256",
        "--max-new-tokens",
        "480",
        "--stats-json",
        str(log),
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        proc.stdin.write(b"def f(x):\n")
        proc.stdin.flush()
        first = proc.stdout.read(8)  # blocks until the reply has started streaming
        assert first
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(f"/save {saved}\n".encode(), timeout=120)
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode in (0, 130), err
    assert "Traceback" not in err and "chat: 1 turns" in err
    (rec,) = turns(log)
    assert rec["finish_reason"] == "interrupted", err
    assert 0 < rec["new_tokens"] < 480
    reply = json.loads(saved.read_text())["messages"][-1]["content"]
    assert reply and (first + rest).decode().rstrip("\n") == reply.rstrip("\n")  # a reply may end in a newline token
