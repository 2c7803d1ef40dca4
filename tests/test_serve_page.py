"""The chat page of `specx serve` in a real headless browser (Playwright with the system Chromium),
against a server started with --api-key: the key field (kept in localStorage, sent as Bearer), a
reply streaming in with the speculative stats, the Stop button aborting a running reply (the
server counts it cancelled), and Enter during an IME composition not sending. Skips cleanly where
Playwright or a system Chromium is not installed (.ci/run installs both where it can)."""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from tests.conftest import make_model
from tests.serve_util import Server

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium installed")
KEY = "page-key"


@pytest.fixture(scope="module")
def endless_pair(tmp_path_factory):
    """(target, draft) whose greedy decoding never ends by itself: the target's <eos> row of lm_head is
    zero, so <eos> scores 0 while 47 other logits of spread ~1.4 score around it, and greedy picks it
    only when all 47 are negative (about 2^-47). A long context (4096) leaves room for a reply that is
    still running when Stop is clicked, however slow or fast the machine is."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("endless")
    target = make_model(root / "target", seed=1, layers=3, max_pos=4096)
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[0].zero_()
    model.save_pretrained(target, safe_serialization=True)
    return target, make_model(root / "draft", seed=2, layers=3, noise_from=target, noise=0.3, max_pos=4096)


@pytest.fixture(scope="module")
def server(endless_pair, tmp_path_factory):
    target, draft = endless_pair
    srv = Server.start(
        ["--target", str(target), "--draft", str(draft), "--dtype", "fp32", "--device", "cpu", "--budget", "8"],
        tmp_path_factory.mktemp("page"),
        env={"SPECX_API_KEY": KEY},
    )
    yield srv
    assert srv.stop() == 0, srv.stderr()


@pytest.fixture(scope="module")
def browser(server):  # closed before the server stops (its keep-alive connections would hold the stop)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server):
    """A fresh browser context (empty localStorage) on the page, with the key typed in."""
    context = browser.new_context()
    page = context.new_page()
    page.goto(server.base + "/")
    page.wait_for_function("document.getElementById('stats').textContent.includes('API key')", timeout=30_000)
    page.fill("#key", KEY)
    page.press("#key", "Tab")  # the change event: stored, and the model list fetched with it
    page.wait_for_function("document.getElementById('model').textContent !== ''", timeout=30_000)
    yield page
    context.close()


def test_page_streams_a_reply_with_stats_and_keeps_the_key(page, server):
    page.fill("#max", "12")
    page.fill("#input", "def f(x):")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.assistant span", state="attached", timeout=30_000)  # a "\n" token's span has no box
    page.wait_for_function("document.getElementById('stats').textContent.includes('tokens/pass')", timeout=30_000)
    assert page.inner_text(".msg.user") == "def f(x):"
    assert page.inner_text(".msg.assistant")
    assert "tok/s" in page.inner_text("#stats")
    page.reload()
    assert page.input_value("#key") == KEY  # kept in localStorage
    page.wait_for_function("document.getElementById('model').textContent !== ''", timeout=30_000)
    assert "favicon" not in server.stderr()  # the page names no icon: no 404 line per page load


def test_stop_aborts_the_running_reply(page, server):
    page.fill("#max", "4000")  # greedy never ends on <eos> (endless_pair): the reply runs until Stop
    page.fill("#temp", "0")
    page.fill("#input", "import os")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.assistant span", state="attached", timeout=30_000)  # a "\n" token's span has no box
    assert page.is_visible("#stop") and page.is_disabled("#send")
    page.click("#stop")
    page.wait_for_function("document.getElementById('stats').textContent === 'stopped'", timeout=10_000)
    assert not page.is_visible("#stop") and not page.is_disabled("#send")
    partial = page.inner_text(".msg.assistant")
    time.sleep(0.5)
    assert page.inner_text(".msg.assistant") == partial and len(partial) < 4000  # nothing more arrived
    deadline = time.monotonic() + 10
    while 'outcome="cancelled"' not in (
        metrics := server.http("GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})[2]
    ):
        assert time.monotonic() < deadline, metrics  # the server stopped the reply too
        time.sleep(0.1)
    page.fill("#max", "4")  # the conversation goes on, the stopped reply in it
    page.fill("#input", "x = 1")
    page.press("#input", "Enter")
    page.wait_for_function(
        "document.querySelectorAll('.msg.assistant').length === 2 && "
        "document.getElementById('stats').textContent.includes('tokens/pass')",
        timeout=30_000,
    )
    assert page.locator(".msg.error").count() == 0


def test_enter_during_ime_composition_does_not_send(page):
    page.fill("#input", "にほんご")
    page.dispatch_event("#input", "keydown", {"key": "Enter", "isComposing": True, "bubbles": True})
    page.dispatch_event("#input", "keydown", {"key": "Enter", "keyCode": 229, "bubbles": True})
    time.sleep(0.3)
    assert page.locator(".msg.user").count() == 0 and page.input_value("#input") == "にほんご"
    page.fill("#max", "2")
    page.press("#input", "Enter")  # composition over: Enter sends
    page.wait_for_selector(".msg.user", timeout=10_000)
    assert page.inner_text(".msg.user") == "にほんご"
