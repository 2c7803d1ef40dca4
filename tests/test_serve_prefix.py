"""A conversation's prefix stays cached through Open WebUI's background requests at any --parallel:
real `specx serve` processes through the `openai` client.

The interleaved conversation, as Open WebUI sends it: a streamed chat turn, then its title and tags
requests together (not streamed, no max_tokens, the history pasted into one user message: the task
prompts serve/limits.py recognises), then the next turn, five turns. The server's --system prompt
(about 5,000 tokens of the tiny character-level pair) opens every request, so the background
requests share it with the conversation: they must get it without taking the conversation's
sequence, or the prompt cache must keep the conversation. On turns 2-5 at least 99% of each turn's
prompt is cached (`usage.prompt_tokens_details.cached_tokens`; the rest is the new user message),
and the replies (T = 0) equal those of a fresh server with no prompt cache that saw no background
request. Cases: --parallel 1, 2 and the default with the default prompt cache, and --parallel 2 and
the default with none (`--cache-ram 0`: the sequences alone must hold the conversation).
"""

from __future__ import annotations

import shutil
import threading

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import CHARS, make_model
from tests.serve_util import Server

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
SYSTEM = " ".join(
    f"rule {i}: answer in short sentences, use plain words, and say so when you do not know." for i in range(60)
)
TURNS = ["what is a list", "and a tuple", "show me code", "why is it faster", "one more example"]
REPLY_TOKENS = 16
KEEP = set(CHARS[1:])
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def clean(text: str) -> str:
    return "".join(c for c in text.lower() if c in KEEP)


def history(msgs: list[dict]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in msgs)


def title(msgs: list[dict]) -> list[dict]:
    """Open WebUI's title task (its default template's shape): the last two messages pasted in."""
    return [
        {
            "role": "user",
            "content": "### Task:\nGenerate a concise, 3-5 word title summarizing the chat "
            f"history.\n### Chat History:\n<chat_history>\n{clean(history(msgs[-2:]))}\n</chat_history>",
        }
    ]


def tags(msgs: list[dict]) -> list[dict]:
    """Open WebUI's tags task: the last six messages pasted in."""
    return [
        {
            "role": "user",
            "content": "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the "
            f"chat history.\n### Chat History:\n<chat_history>\n{clean(history(msgs[-6:]))}\n</chat_history>",
        }
    ]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(templated target, draft), 8192 positions: room for the long system prompt and five turns."""
    root = tmp_path_factory.mktemp("prefix")
    target = make_model(root / "target", seed=1, layers=2, max_pos=8192)
    draft = make_model(root / "draft", seed=2, layers=2, noise_from=target, noise=0.3, max_pos=8192)
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


def stop(srv: Server) -> None:
    assert srv.stop() == 0, srv.stderr()
    assert "Traceback" not in srv.stderr() and "Warning" not in srv.stderr(), srv.stderr()


def background_task(api: OpenAI, messages: list[dict], errors: list) -> None:
    try:
        res = api.chat.completions.create(model="tiny", messages=messages, temperature=0)
        assert res.choices[0].finish_reason in ("stop", "length")
    except BaseException as exc:  # noqa: BLE001 - raised on the test's thread
        errors.append(exc)


def conversation(srv: Server, background: bool) -> list[tuple[str, int, int]]:
    """(reply, prompt tokens, cached tokens) per turn; with `background`, a title and a tags request
    at once after each reply, both answered before the next turn."""
    with OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=120) as api:
        return turns(api, background)


def turns(api: OpenAI, background: bool) -> list[tuple[str, int, int]]:
    msgs, out = [], []
    for text in TURNS:
        msgs.append({"role": "user", "content": text})
        chunks = list(
            api.chat.completions.create(
                model="tiny",
                messages=msgs,
                temperature=0,
                max_tokens=REPLY_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        out.append((reply, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
        msgs.append({"role": "assistant", "content": reply})
        if background:
            errors: list[BaseException] = []
            threads = [
                threading.Thread(target=background_task, args=(api, m, errors)) for m in (title(msgs), tags(msgs))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
    return out


@pytest.fixture(scope="module")
def fresh(pair, tmp_path_factory):
    """The replies of a server with no prompt cache and no background requests."""
    srv = start(pair, tmp_path_factory, "--parallel", "1", "--cache-ram", "0")
    try:
        return [reply for reply, _, _ in conversation(srv, background=False)]
    finally:
        stop(srv)


@pytest.mark.parametrize(
    "extra",
    [("--parallel", "1"), ("--parallel", "2"), (), ("--parallel", "2", "--cache-ram", "0"), ("--cache-ram", "0")],
    ids=["parallel-1", "parallel-2", "default", "parallel-2-no-cache", "default-no-cache"],
)
def test_the_prefix_stays_cached_through_background_requests(pair, tmp_path_factory, fresh, extra):
    srv = start(pair, tmp_path_factory, *extra)
    try:
        got = conversation(srv, background=True)
    finally:
        stop(srv)
    assert [reply for reply, _, _ in got] == fresh  # T = 0: what a fresh server replies
    shares = [cached / prompt for _, prompt, cached in got]
    print(f"{' '.join(extra) or 'default'}: cached share per turn {[round(s, 4) for s in shares]}")
    assert got[0][1] > 4000 and all(s >= 0.99 for s in shares[1:]), shares
