"""Where a bf16 speculative run and `--method ar` part ways: the first differing token and how close
the target's top two logits were there.  Run by hand (not a test).

    python bench/ties.py --target /tmp/target-xl --prompts 1:11 [--draft self] [--budget 64]

Contract: loads the target in bf16 with every layer streamed from disk and the given draft, decodes
each prompt greedily with `--method ar` and with specexec, and for every prompt whose ids differ
prints the first differing position, both tokens, and the target's top-two logits there from ONE
forward over the prompt plus the common prefix, with their gap in bf16 ulps (eps x max(|top logit|, 1)).
A gap under about one ulp is a rounding tie: a one-token step and a tree batch reduce in different
orders, so either token is the target's argmax within bf16's precision (fp32 runs match exactly:
bench/selfdraft.py's default, tests/test_selfdraft.py). A larger gap would be a real loss.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accept import SHARED, load_prompts  # noqa: E402

from specexec_cli.core.draft import TreeShape  # noqa: E402
from specexec_cli.core.engine import DecodeState, GenerationConfig  # noqa: E402
from specexec_cli.core.methods import generate  # noqa: E402
from specexec_cli.session.loading import LoadOptions, load_models, quiet_transformers  # noqa: E402


def decode(models, ids: list[int], method: str, budget: int, n: int) -> list[int]:
    cfg = GenerationConfig(method=method, shape=TreeShape(budget, 64, 32, 32), max_new_tokens=n)
    return [t for ev in generate(models, DecodeState(), ids, cfg) for t in ev.tokens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(SHARED / "models" / "target"))
    ap.add_argument("--draft", default=str(SHARED / "models" / "draft"), help="a draft dir, or self")
    ap.add_argument("--prompts", default="1:11")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    quiet_transformers()
    models = load_models(LoadOptions(args.target, args.draft, dtype="bf16", device="cpu", offload="disk", max_ram=0))
    for i, prompt in load_prompts(args.prompts):
        ids = models.tokenizer(prompt)["input_ids"]
        ar, spec = (decode(models, ids, m, args.budget, args.max_new_tokens) for m in ("ar", "specexec"))
        if ar == spec:
            print(f"prompt {i}: equal ({len(ar)} tokens)")
            continue
        k = next((j for j in range(min(len(ar), len(spec))) if ar[j] != spec[j]), min(len(ar), len(spec)))
        logits = models.target(input_ids=torch.tensor([ids + ar[:k]])).logits[0, -1].float()
        top = logits.topk(2)
        ulp = torch.finfo(torch.bfloat16).eps * top.values[0].abs().clamp(min=1.0)
        print(
            f"prompt {i}: first difference at token {k}: ar {ar[k] if k < len(ar) else 'end'}, specexec "
            f"{spec[k] if k < len(spec) else 'end'}; the target's top two there {top.indices.tolist()} "
            f"{[round(v, 4) for v in top.values.tolist()]}: gap {float((top.values[0] - top.values[1]) / ulp):.2f} ulp"
        )


if __name__ == "__main__":
    main()
