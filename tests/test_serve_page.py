"""The chat page of `specx serve` in a real headless browser (Playwright with the system Chromium):
type a message, see the reply stream in and the speculative stats appear. Skips cleanly where
Playwright or a system Chromium is not installed (.ci/run installs both where it can)."""

from __future__ import annotations

import shutil

import pytest

from tests.serve_util import Server

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium installed")


def test_page_streams_a_reply_with_stats(tiny_pair, tmp_path):
    target, draft = tiny_pair
    srv = Server.start(["--target", str(target), "--draft", str(draft), "--dtype", "fp32", "--device", "cpu",
                        "--budget", "8", "--max-new-tokens", "12"], tmp_path)  # fmt: skip
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(srv.base + "/")
            page.fill("#input", "def f(x):")
            page.press("#input", "Enter")
            page.wait_for_selector(".msg.assistant span", timeout=30_000)
            page.wait_for_function("document.getElementById('stats').textContent.includes('tokens/pass')",
                                   timeout=30_000)  # fmt: skip
            assert page.inner_text(".msg.user") == "def f(x):"
            assert page.inner_text(".msg.assistant")
            assert "tok/s" in page.inner_text("#stats")
            browser.close()
    finally:
        assert srv.stop() == 0
