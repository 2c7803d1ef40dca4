"""`specx serve` with the prompt cache, through the real `openai` client against real uvicorn processes.

A tiny pair (2048 positions) whose tokenizer carries a Gemma-2-style chat template: it rejects the
system role and non-alternating roles. Both servers run with `--system`, so every request is folded.
- a five-turn conversation with a title and a follow-up request between turns (Open WebUI's shapes:
  one user message with the history pasted in) prefills only the new turn on turns 2-5 and replies
  what the same conversation without them replies on a server with no prompt cache (T = 0); the
  server runs --parallel 1, so the prompt cache is what keeps the conversation (with more sequences
  its own sequence keeps it: tests/test_serve_prefix.py);
- a system message is folded (200), a template error for another reason is a 400 with its message;
- no max_tokens and no --max-new-tokens: the reply stops at the flag's default, 256 tokens; max_tokens
  -1 runs on past it (the 512-position tiny pair).
"""

from __future__ import annotations

import re
import shutil

import pytest
from openai import BadRequestError, OpenAI
from transformers import AutoTokenizer

from tests.conftest import CHARS, make_model
from tests.serve_util import Server

TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}: {{ m['content'] | trim }}\n"
    "{% endfor %}{% if add_generation_prompt %}model: {% endif %}"
)
SYSTEM = (
    "you are a helpful assistant. answer in short sentences, use plain words, and say so when you do not "
    "know. keep code short. " * 4
).strip()
TURNS = ["what is a list", "and a tuple", "show me code", "why is it faster", "thanks, one more example"]
REPLY_TOKENS = 16
KEEP = set(CHARS[1:])
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # tiny models: one thread is fastest, and far faster on a loaded host


def clean(text: str) -> str:
    """The text in the tiny tokenizer's alphabet (it has no capitals, quotes or brackets)."""
    return "".join(c for c in text.lower() if c in KEEP)


def history(msgs: list[dict]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in msgs if m["role"] != "system")


def title_request(msgs: list[dict]) -> list[dict]:
    """Open WebUI's title task: one user message, the last messages pasted in."""
    return [
        {
            "role": "user",
            "content": clean(
                "### task:\ngenerate a concise, 3 to 5 word title summarizing the chat history.\n"
                f"### chat history:\n{history(msgs[-2:])}\n### output: the title only"
            ),
        }
    ]


def follow_up_request(msgs: list[dict]) -> list[dict]:
    """Open WebUI's follow-up task: suggest questions from the last six messages."""
    return [
        {
            "role": "user",
            "content": clean(
                "### task:\nsuggest 3 to 5 relevant follow up questions the user might ask next, based on the chat "
                f"history.\n### chat history:\n{history(msgs[-6:])}"
            ),
        }
    ]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(templated target, draft), 2048 positions."""
    root = tmp_path_factory.mktemp("long")
    target = make_model(root / "target", seed=1, layers=2, max_pos=2048)
    draft = make_model(root / "draft", seed=2, layers=2, noise_from=target, noise=0.3, max_pos=2048)
    templated = root / "templated"
    shutil.copytree(target, templated)
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(templated)
    return templated, draft


def start(pair, tmp_path_factory, *extra: str) -> Server:
    target, draft = pair
    return Server.start(
        [
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--budget",
            "8",
            "--model-name",
            "tiny",
            "--system",
            SYSTEM,
            *extra,
        ],
        tmp_path_factory.mktemp("serve"),
        env=ONE_THREAD,
    )


@pytest.fixture(scope="module")
def servers(pair, tmp_path_factory):
    cached = start(pair, tmp_path_factory, "--parallel", "1")  # one sequence: the prompt cache keeps the conversation
    plain = start(pair, tmp_path_factory, "--cache-ram", "0", "--parallel", "1")
    yield cached, plain
    for srv in (cached, plain):
        assert srv.stop() == 0, srv.stderr()
        assert "Traceback" not in srv.stderr() and "Warning" not in srv.stderr(), srv.stderr()


def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)


def conversation(api: OpenAI, background: bool, turns: list[str] = TURNS) -> list:
    """The turns; returns (reply, prompt_tokens, cached_tokens) per turn."""
    msgs, out = [], []
    for text in turns:
        msgs.append({"role": "user", "content": text})
        res = api.chat.completions.create(
            model="tiny",
            messages=msgs,
            temperature=0,
            max_tokens=REPLY_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(res)
        reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        out.append((reply, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
        msgs.append({"role": "assistant", "content": reply})
        if background:  # what Open WebUI sends after a reply (not streamed, as it does)
            for task in (title_request(msgs), follow_up_request(msgs)):
                api.chat.completions.create(model="tiny", messages=task, temperature=0, max_tokens=8)
    return out


def metric(server: Server, name: str) -> float:
    text = server.http("GET", "/metrics")[2]
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_background_requests_do_not_cost_the_conversation(servers):
    cached, plain = servers
    want = conversation(client(plain), background=False)
    got = conversation(client(cached), background=True)
    assert [r for r, _, _ in got] == [r for r, _, _ in want]  # T = 0: the same replies
    for turn, (_, prompt, hit) in enumerate(got[1:], 2):
        assert hit >= 0.9 * prompt, (turn, hit, prompt)
    assert metric(cached, "specx_prompt_cache_hits_total") >= 4
    assert metric(cached, "specx_prompt_cache_entries") >= 2
    # without the cache, the same background requests do cost the conversation its prefix
    lost = conversation(client(plain), background=True, turns=TURNS[:2])
    assert lost[1][2] < 0.9 * lost[1][1]


def test_system_role_is_folded_and_other_template_errors_are_400(servers):
    api = client(servers[0])
    res = api.chat.completions.create(
        model="tiny",
        temperature=0,
        max_tokens=4,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
    )
    assert res.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(BadRequestError) as err:
        api.chat.completions.create(
            model="tiny",
            max_tokens=4,
            messages=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
        )
    body = err.value.body
    assert err.value.status_code == 400 and body["code"] == "chat_template_error"
    assert "roles must alternate" in body["message"]


def no_eos_target(tiny_pair, root):
    """The tiny target with its EOS row of the output layer zeroed: greedy text never ends (512 positions)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[0].zero_()  # logit 0 for EOS; some other token's logit is always higher
    shutil.copytree(tiny_pair[0], root)
    model.save_pretrained(root, safe_serialization=True)
    return root


def test_no_max_tokens_stops_at_the_default_and_minus_one_runs_on(tiny_pair, tmp_path):
    """No --max-new-tokens: a reply without max_tokens stops at the flag's default (256 tokens, as
    --help says); max_tokens -1 runs on to EOS or the context end, the same text further."""
    target = no_eos_target(tiny_pair, tmp_path / "noeos")
    srv = Server.start(
        [
            "--target",
            str(target),
            "--draft",
            str(tiny_pair[1]),
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--budget",
            "8",
            "--model-name",
            "tiny",
        ],
        tmp_path,
        env=ONE_THREAD,
    )
    try:
        api = client(srv)
        res = api.completions.create(model="tiny", prompt="def parse(line):\n", temperature=0)
        assert res.usage.completion_tokens == 256 and res.choices[0].finish_reason == "length"
        full = api.completions.create(model="tiny", prompt="def parse(line):\n", temperature=0, max_tokens=-1)
        assert full.usage.completion_tokens > 256
        assert full.choices[0].text.startswith(res.choices[0].text)
    finally:
        assert srv.stop() == 0, srv.stderr()
