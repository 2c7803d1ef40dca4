"""`specx serve` against `specx run` on the shared pair, interleaved in one run.  Run by hand.

Contract: starts one `specx serve` process (the same flags as the `specx run` calls) and, per
prompt, alternates `specx run --no-chat-template --stats-json` (a fresh process: its engine-timed
tok/s) with a streamed /v1/completions request through the `openai` client (tok/s = tokens after
the first ÷ wall time from the first to the last content chunk, as a user sees it; also the time
to first token). Rates are total tokens / total time over the prompts whose reply has >= 2 tokens
(one that stops at its first token has no streaming rate); the server's own engine rate is beside
them, so HTTP/SSE overhead shows as serve ÷ engine. All greedy, so both must print the same text (`same_text`). Then a five-turn
chat conversation twice: with prefix reuse (turns sent back to back) and without it (an unrelated
request between turns evicts the conversation from the caches), reporting the prefill tokens of
every turn (`specx.prefill_tokens`). Writes --out/serve.json and prints markdown tables; the
serve tables of CONTRIBUTING.md come from its JSON
(tools/perf_tables.py). The ratio server ÷ run should be >= 0.95.

`--background`: instead, the prompt cache against the one-entry cache (`--cache-ram 0 --parallel 1`: only the
live device state, as before the prompt cache): one server each, both up at once and both with a
system prompt, the same five-turn streamed chat conversation (user turns: the bench prompts) with
Open WebUI's background requests after every reply (a title and a follow-up suggestion request,
not streamed, one user message with the history pasted in), turn by turn in alternating order.
Per turn: time to first token (restore + prefill, wall), the server's prefill seconds, turn time,
prompt and cached tokens; the replies must be equal (T = 0). Writes --out/cache.json.

    python bench/serve.py --num-prompts 5 --max-new-tokens 128 --out /tmp/serve-bench
    python bench/serve.py --background --out bench/results/serve
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TURNS = ["def parse(line):", "class Config:", "import os", "def main():", "x = parse(line)"]


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "specexec_cli", "serve", "--port", str(port), *flags], env=env, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                return proc, base
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not become ready")


def run_cli(flags: list[str], prompt: str, n: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "s.json"
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "specexec_cli",
                "run",
                "-p",
                prompt,
                "--no-chat-template",
                "--temperature",
                "0",
                "-n",
                str(n),
                "--no-live",
                "--stats-json",
                str(stats),
                *flags,
            ],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            check=True,
        )
        rec = json.loads(stats.read_text())
    return {"text": out.stdout, "tokens": rec["new_tokens"], "tok_s": rec["tokens_per_second"]}


def run_server(client, prompt: str, n: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    parts, usage, stats = [], None, {}
    for chunk in client.completions.create(
        model="specx", prompt=prompt, max_tokens=n, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
            parts.append(chunk.choices[0].text)
        stats = (chunk.model_extra or {}).get("specx") or stats
        usage = chunk.usage or usage
    tokens = usage.completion_tokens
    rate = (tokens - 1) / (last - first) if last and first and last > first else 0.0
    return {
        "text": "".join(parts),
        "tokens": tokens,
        "tok_s": rate,
        "ttft_s": (first or t0) - t0,
        "engine_tok_s": stats.get("tokens_per_second"),
    }


def conversation(client, n: int, reuse: bool) -> list[int]:
    msgs, prefill = [], []
    for turn in TURNS:
        msgs.append({"role": "user", "content": turn})
        if not reuse:  # evict: another conversation takes the caches before every turn
            client.completions.create(model="specx", prompt="# unrelated\n", max_tokens=1, temperature=0)
        res = client.chat.completions.create(model="specx", messages=msgs, max_tokens=n, temperature=0)
        prefill.append(res.model_extra["specx"]["prefill_tokens"])
        msgs.append({"role": "assistant", "content": res.choices[0].message.content})
    return prefill


SYSTEM = (
    "You are a careful Python reviewer. Read the code the user sends, continue it in the same style, keep "
    "names consistent, and do not repeat the code back."
)


def history(msgs: list[dict], last: int) -> str:
    return "\n".join(f"{m['role'].upper()}: {m['content']}" for m in msgs[-last:])


def background(client, msgs: list[dict]) -> None:
    """Open WebUI's tasks after a reply: a title, then follow-up suggestions (not streamed)."""
    for task, last in (
        ("Generate a concise, 3-5 word title with an emoji summarizing the chat history.", 2),
        ("Suggest 3-5 relevant follow-up questions the user might ask next.", 6),
    ):
        prompt = f"### Task:\n{task}\n### Chat History:\n<chat_history>\n{history(msgs, last)}\n</chat_history>"
        client.chat.completions.create(
            model="specx", messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0
        )


def chat_turn(client, msgs: list[dict], turn: str, n: int) -> dict:
    """One streamed turn (then the background requests): TTFT, turn time, tokens, the server's prefill time."""
    msgs.append({"role": "user", "content": turn})
    t0 = time.perf_counter()
    first, parts, usage, stats = None, [], None, {}
    for chunk in client.chat.completions.create(
        model="specx", messages=msgs, max_tokens=n, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        stats = (chunk.model_extra or {}).get("specx") or stats
        usage = chunk.usage or usage
    end = time.perf_counter()
    row = {
        "ttft_s": (first or end) - t0,
        "turn_s": end - t0,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
        "completion_tokens": usage.completion_tokens,
        "prefill_s": stats.get("prefill_seconds"),
        "reply": "".join(parts),
    }
    msgs.append({"role": "assistant", "content": row["reply"]})
    background(client, msgs)
    return row


def cache_bench(args, flags: list[str], prompts: list[str]) -> None:
    """Both servers up at once; turn by turn, alternating which goes first, so load drift hits both alike."""
    from openai import OpenAI

    turns = [p[: args.turn_chars] for p in prompts[: args.num_prompts]]
    extra = {
        "cache": ["--cache-ram", args.cache_ram] if args.cache_ram else [],
        "one_entry": ["--cache-ram", "0", "--parallel", "1"],
    }
    procs, clients = [], {}
    try:
        for name, more in extra.items():
            proc, base = start_server([*flags, "--system", SYSTEM, *more])
            procs.append(proc)
            clients[name] = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=3600)
        sides = {name: [] for name in extra}
        msgs = {name: [] for name in extra}
        for i, turn in enumerate(turns):
            for name in ("cache", "one_entry") if i % 2 == 0 else ("one_entry", "cache"):
                sides[name].append(chat_turn(clients[name], msgs[name], turn, args.max_new_tokens))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    later = slice(1, None)  # turns 2..5: the ones a cache can serve
    summary = {
        k: {
            "ttft_s_turns_2_5": sum(r["ttft_s"] for r in v[later]),
            "prefill_s_turns_2_5": sum(r["prefill_s"] for r in v[later]),
            "turn_s_turns_2_5": sum(r["turn_s"] for r in v[later]),
            "cached_fraction_turns_2_5": sum(r["cached_tokens"] for r in v[later])
            / sum(r["prompt_tokens"] for r in v[later]),
        }
        for k, v in sides.items()
    }
    summary["same_replies"] = [r["reply"] for r in sides["cache"]] == [r["reply"] for r in sides["one_entry"]]
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"summary": summary, "flags": flags, "max_new_tokens": args.max_new_tokens, "turns": sides}
    (args.out / "cache.json").write_text(json.dumps(record, indent=1) + "\n")
    print(
        "| turn | prompt | cached | TTFT s | prefill s | cached, one entry | TTFT s, one entry | prefill s, one entry |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for t, (a, b) in enumerate(zip(sides["cache"], sides["one_entry"]), 1):
        print(
            f"| {t} | {a['prompt_tokens']} | {a['cached_tokens']} | {a['ttft_s']:.3f} | {a['prefill_s']:.3f} "
            f"| {b['cached_tokens']} | {b['ttft_s']:.3f} | {b['prefill_s']:.3f} |"
        )
    print(json.dumps(summary, indent=1))


def summarize(rows: list[dict]) -> dict:
    """Aggregate rates (total tokens / total time) over the prompts that produced >= 2 tokens: a reply that
    ends at its first token has no streaming rate."""
    timed = [r for r in rows if r["run"]["tokens"] >= 2 and r["serve"]["tokens"] >= 2]

    def rate(side: str, key: str, skip_first: bool) -> float:
        toks = sum(r[side]["tokens"] - skip_first for r in timed)
        secs = sum((r[side]["tokens"] - skip_first) / r[side][key] for r in timed if r[side][key])
        return toks / secs if secs else 0.0

    run, serve = rate("run", "tok_s", False), rate("serve", "tok_s", True)
    return {
        "prompts_timed": len(timed),
        "run_tok_s": run,
        "serve_tok_s": serve,
        "serve_engine_tok_s": rate("serve", "engine_tok_s", False),
        "ratio": serve / run if run else 0.0,
        "ttft_s": sum(r["serve"]["ttft_s"] for r in timed) / max(1, len(timed)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(SHARED / "models" / "target"))
    ap.add_argument("--draft", default=str(SHARED / "models" / "draft"))
    ap.add_argument("--prompts", default=str(SHARED / "bench" / "prompts.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("bench-serve"))
    ap.add_argument("--background", action="store_true", help="the prompt cache against --cache-ram 0 (see above)")
    ap.add_argument(
        "--cache-ram", default=None, help="--background: the cached server's --cache-ram (default: its own)"
    )
    ap.add_argument("--turn-chars", type=int, default=1200, help="--background: characters of each user turn")
    ap.add_argument("flags", nargs="*", help="extra flags for both specx run and specx serve (after --)")
    args = ap.parse_args()
    from openai import OpenAI

    flags = ["--target", args.target, "--draft", args.draft, *args.flags]
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    if args.background:
        return cache_bench(args, flags, prompts)
    proc, base = start_server(flags)
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=3600)
    rows = []
    try:
        for i, prompt in enumerate(prompts[: args.num_prompts]):
            order = ("run", "serve") if i % 2 == 0 else ("serve", "run")  # alternate: drift hits both alike
            res = {
                k: run_cli(flags, prompt, args.max_new_tokens)
                if k == "run"
                else run_server(client, prompt, args.max_new_tokens)
                for k in order
            }
            rows.append(
                {
                    "prompt": i,
                    "run": res["run"],
                    "serve": res["serve"],
                    "same_text": res["run"]["text"] in (res["serve"]["text"], res["serve"]["text"] + "\n"),
                }
            )
        turns = {
            "reuse": conversation(client, args.turn_tokens, True),
            "no_reuse": conversation(client, args.turn_tokens, False),
        }
    finally:
        proc.terminate()
        proc.wait(60)
    summary = dict(summarize(rows), turn_prefill=turns, all_same_text=all(r["same_text"] for r in rows))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps({"summary": summary, "prompts": rows}, indent=1) + "\n")
    print("| prompt | run tok/s | serve tok/s | TTFT s | same text |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['prompt']} | {r['run']['tok_s']:.1f} | {r['serve']['tok_s']:.1f} | {r['serve']['ttft_s']:.2f} "
            f"| {r['same_text']} |"
        )
    print(
        f"\nover {summary['prompts_timed']} prompts with >= 2 tokens: run {summary['run_tok_s']:.1f} tok/s, server "
        f"{summary['serve_tok_s']:.1f} (its engine {summary['serve_engine_tok_s']:.1f}), TTFT {summary['ttft_s']:.3f} s"
    )
    print(f"server / run = {summary['ratio']:.3f}\n\n| turn | prefill (reuse) | prefill (no reuse) |\n|---|---|---|")
    for t, (a, b) in enumerate(zip(turns["reuse"], turns["no_reuse"]), 1):
        print(f"| {t} | {a} | {b} |")


if __name__ == "__main__":
    main()
