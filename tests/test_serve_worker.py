"""The serve worker in-process (no HTTP): templated prefix reuse, losslessness under reuse, the queue
bound, sampling defaults from generation_config.json, and the stop-string scanner."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import GenerationConfig
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.serve.jobs import Delta, Done, Failed, Job, Started
from specexec_cli.serve.metrics import Metrics
from specexec_cli.serve.models import APIError, Work
from specexec_cli.serve.worker import Worker
from specexec_cli.session.chat import ChatSession, StopScanner, plain_prompt
from specexec_cli.session.gendefaults import GREEDY, checkpoint_sampling, merge, read_generation_config
from specexec_cli.session.loading import LoadOptions, load_models

TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a: {% endif %}"
)  # the reply follows "a: " as rendered


@pytest.fixture(scope="module")
def worker(tiny_pair):
    models = load_models(LoadOptions(str(tiny_pair[0]), str(tiny_pair[1]), dtype="fp32", device="cpu"))
    models.tokenizer.chat_template = TEMPLATE
    session = ChatSession(models, GenerationConfig(shape=TreeShape(8, 8), max_new_tokens=10))
    assert session.templated
    w = Worker(lambda: (session, GREEDY), max_queue=2, metrics=Metrics())
    w.start()
    while w.state == "loading":
        time.sleep(0.01)
    assert w.state == "ready"
    yield w
    w.shutdown()


def run(worker: Worker, work: Work) -> list:
    async def go():
        job = Job(work, asyncio.get_running_loop(), "chat")
        worker.submit(job)
        items = []
        while not items or not isinstance(items[-1], (Done, Failed)):
            items.append(await asyncio.wait_for(job.events.get(), 60))
        return items

    return asyncio.run(go())


def test_templated_turns_reuse_the_prefix_and_stay_lossless(worker):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    first = run(worker, Work(messages=msgs))
    reply = first[-1].text
    assert isinstance(first[0], Started) and "".join(i.text for i in first if isinstance(i, Delta)) == reply
    second_msgs = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "x = 1"}]
    second = run(worker, Work(messages=second_msgs))
    started, done = second[0], second[-1]
    assert started.cached_tokens > first[0].prompt_tokens  # the first turn and its reply came from the caches
    assert done.specx["prefill_tokens"] == started.prompt_tokens - started.cached_tokens
    assert done.usage["prompt_tokens_details"]["cached_tokens"] == started.cached_tokens
    run(worker, Work(messages=[{"role": "user", "content": "class z:"}]))  # another conversation in between
    again = run(worker, Work(messages=second_msgs))
    assert again[0].cached_tokens < started.cached_tokens
    assert again[-1].text == done.text  # reused caches or not, the same greedy text


def test_defaults_come_from_the_checkpoint_and_requests_override_them(worker):
    old = worker.defaults
    try:
        worker.defaults = SamplingParams(temperature=1.0, top_k=50, top_p=1.0)
        implicit = run(worker, Work(prompt="def g(", seed=5))[-1].text
        explicit = run(worker, Work(prompt="def g(", seed=5, temperature=1.0, top_k=50))[-1].text
        greedy = run(worker, Work(prompt="def g(", seed=5, temperature=0))[-1].text
        worker.defaults = GREEDY
        assert implicit == explicit and greedy == run(worker, Work(prompt="def g(", seed=9))[-1].text
    finally:
        worker.defaults = old


def test_queue_bound_is_429_with_retry_after(worker):
    with worker.lock:
        worker.pending += worker.max_queue + 1
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(APIError) as err:
            worker.submit(Job(Work(prompt="x"), loop, "completions"))
        assert err.value.status == 429 and int(err.value.headers["Retry-After"]) >= 1
    finally:
        loop.close()
        with worker.lock:
            worker.pending -= worker.max_queue + 1


def test_stop_scanner_holds_back_partial_matches():
    s = StopScanner(["END", "##"])
    assert s.feed("abc E") == "abc " and s.feed("N") == "" and s.feed("x #") == "ENx "
    assert s.feed("#tail") == "" and s.stopped and s.flush() == ""
    s = StopScanner(["END"])
    assert s.feed("foo EN") == "foo " and s.flush() == "EN"
    assert StopScanner([]).feed("END") == "END"


def test_plain_prompt_matches_the_turn_by_turn_format():
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": " yo"},
        {"role": "user", "content": "more"},
    ]
    assert plain_prompt(msgs, code=False) == "sys\n\nUser: hi\nAssistant: yo\nUser: more\nAssistant:"
    assert (
        plain_prompt(
            [
                {"role": "user", "content": "def f():"},
                {"role": "assistant", "content": "  pass"},
                {"role": "user", "content": "x = 1"},
            ],
            code=True,
        )
        == "def f():\n  pass\nx = 1\n"
    )


def test_checkpoint_sampling(tmp_path):
    def with_config(cfg):
        (tmp_path / "generation_config.json").write_text(json.dumps(cfg) if isinstance(cfg, dict) else cfg)
        return checkpoint_sampling(read_generation_config(tmp_path))

    assert with_config({"do_sample": False, "temperature": 0.7}) == GREEDY
    assert with_config({"do_sample": True}) == SamplingParams(1.0, 50, 1.0)
    assert with_config({"do_sample": True, "temperature": 0.6, "top_p": 0.9}) == SamplingParams(0.6, 50, 0.9)
    assert with_config({"do_sample": True, "top_p": 7}) == SamplingParams(1.0, 50, 1.0)
    assert with_config("{not json") == GREEDY and checkpoint_sampling({}) == GREEDY
    assert merge(SamplingParams(0.6, 50, 0.9), temperature=0) == SamplingParams(0.0, 50, 0.9)


def test_budget_auto_reports_the_tuned_shape(tiny_pair):
    """With --budget auto the response names the budget the tuner ran (the flag's 64 is only its start)."""
    from specexec_cli.core.budget import make_tuner

    models = load_models(LoadOptions(str(tiny_pair[0]), str(tiny_pair[1]), dtype="fp32", device="cpu"))
    shape = TreeShape(64, 8)
    tuner = make_tuner(None, shape, on_cuda=False)
    tuner.holder.shape = TreeShape(5, 3)  # as a retune would leave it
    session = ChatSession(
        models,
        GenerationConfig(shape=shape, max_new_tokens=6),
        tuner=tuner,
        config_record=lambda c: {"budget": c.shape.budget},
        code=True,
    )
    w = Worker(lambda: (session, GREEDY), max_queue=2, metrics=Metrics())
    w.start()
    try:
        while w.state == "loading":
            time.sleep(0.01)
        done = run(w, Work(prompt="def f(x):"))[-1]
    finally:
        w.shutdown()
    assert isinstance(done, Done) and done.specx["budget"] == tuner.shape.budget != 64


def test_slot_is_free_when_the_last_event_arrives(worker):
    """A client that sends its next request the moment a reply ends must not get a 429: the slot is
    given back before Done (and Failed) reach the client, checked at the instant each arrives."""
    seen = []

    async def go():
        loop = asyncio.get_running_loop()
        for prompt in ("x", "y", "z"):
            job = Job(Work(prompt=prompt, max_tokens=3), loop, "completions")
            worker.submit(job)
            while True:
                item = await asyncio.wait_for(job.events.get(), 60)
                if isinstance(item, (Done, Failed)):
                    with worker.lock:
                        seen.append(worker.pending)
                    break

    asyncio.run(go())
    assert seen == [0, 0, 0]


def test_checkpoint_stop_strings_end_a_request_that_sets_none(worker):
    """The checkpoint's own stop strings (an ollama name's params) end a request that sends no `stop`;
    a request's own `stop` replaces them."""
    models = worker.session.models
    full = run(worker, Work(prompt="def g(", temperature=0))[-1].text
    stop = next(full[i : i + 2] for i in range(1, len(full) - 2) if full.find(full[i : i + 2]) == i)
    try:
        models.stop_strings = (stop,)
        cut = run(worker, Work(prompt="def g(", temperature=0))
        own = run(worker, Work(prompt="def g(", temperature=0, stops=["\x00"]))[-1]
    finally:
        models.stop_strings = ()
    assert cut[-1].text == full[: full.find(stop)] and cut[-1].finish == "stop"
    assert own.text == full
