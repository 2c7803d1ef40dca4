#!/usr/bin/env python3
"""Build the embedded demo target/draft pair shipped in ``specexec_cli/demo``.

Contract
--------
Input:  the Python standard library of the interpreter running this script
        (``sysconfig.get_paths()["stdlib"]``), excluding ``test/``, ``tests/``,
        ``idlelib``, ``lib2to3`` and ``site-packages``.  About 1 file in 20 is
        held out for evaluation, chosen by an MD5 hash of its relative path.
Output: ``<out>/target`` and ``<out>/draft``, each a directory loadable with
        ``transformers.AutoModelForCausalLM.from_pretrained`` and
        ``transformers.AutoTokenizer.from_pretrained``.  Both directories hold
        byte-identical tokenizer files (byte-level BPE, ``<|endoftext|>`` as
        BOS/EOS/PAD, no chat template), bf16 safetensors weights and a
        generation_config with ``eos_token_id``.  ``<out>/README.md`` records
        the command, seed, sizes, training times and measured quality
        (held-out teacher-forced loss of both models and the draft's top-1
        agreement with the target).
Method: a Llama-architecture target and a smaller Llama draft are trained
        from scratch on CPU (AdamW, warmup + cosine schedule driven by the
        used fraction of a time budget, seq len 256).  A budget of M minutes
        means M minutes of process CPU time per thread (M min on --threads
        otherwise idle cores), hard-capped at --wall-cap-factor * M wall
        minutes, so a shared, busy machine still gets most of the compute.  By default the
        draft uses plain next-token cross-entropy on the same data;
        ``--distill-alpha a < 1`` instead trains it on a*CE + (1-a)*KL to the
        target's soft labels (costs a target forward per draft step).
        ``--target-steps N`` / ``--draft-steps N`` instead train exactly N steps
        (the schedule then follows the step fraction), which is what the
        shipped pair uses; the README also records the target's greedy 64-token
        continuation of ``examples/prompt.txt`` and its share of non-blank lines.
Determinism: seeds are fixed; with --*-steps the weights depend only on the
        seed and the thread count, with --*-minutes also on machine speed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_pair_readme import write_readme

EOT = "<|endoftext|>"
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}
SEQ_LEN = 256


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="specexec_cli/demo", help="output directory")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--target-minutes", type=float, default=10.0)
    p.add_argument("--draft-minutes", type=float, default=4.0)
    p.add_argument(
        "--target-steps",
        type=int,
        default=0,
        help="train the target for exactly this many steps (0 = use --target-minutes)",
    )
    p.add_argument(
        "--draft-steps",
        type=int,
        default=0,
        help="train the draft for exactly this many steps (0 = use --draft-minutes)",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-seqs", type=int, default=96, help="held-out sequences for eval")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--wall-cap-factor", type=float, default=2.2, help="hard wall-clock cap per model = factor * its budget"
    )
    p.add_argument("--target-lr", type=float, default=4e-3)
    p.add_argument("--draft-lr", type=float, default=6e-3)
    p.add_argument(
        "--distill-alpha",
        type=float,
        default=1.0,
        help="draft loss = a*CE + (1-a)*KL(target||draft); 1.0 = no distillation",
    )
    return p.parse_args(argv)


def collect_sources(stdlib: Path) -> tuple[list[str], list[str]]:
    """Return (train_texts, heldout_texts) from stdlib .py files."""
    train, held = [], []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in SKIP_PARTS for part in rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        bucket = int(hashlib.md5(str(rel).encode()).hexdigest(), 16) % 20
        (held if bucket == 0 else train).append(text)
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int):
    """Train a byte-level BPE and wrap it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT, unk_token=None)
    fast.model_max_length = 2048
    return fast


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Concatenate all texts as ids, each followed by EOS."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def make_config(kind: str, vocab_size: int, eos: int):
    from transformers import LlamaConfig

    if kind == "target":
        dims = dict(
            hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=688
        )
    else:
        dims = dict(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=344
        )
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        attention_dropout=0.0,
        **dims,
    )


def lr_at(frac: float, peak: float, warmup_frac: float = 0.05, floor: float = 0.1) -> float:
    """Warmup then cosine decay to floor*peak, as a function of elapsed budget fraction."""
    if frac < warmup_frac:
        return peak * max(frac / warmup_frac, 0.02)
    t = min((frac - warmup_frac) / (1.0 - warmup_frac), 1.0)
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t)))


def budget_fraction(t0: float, c0: float, budget: float, cap: float, threads: int) -> float:
    """Fraction of the budget used: CPU time per thread (so contention from other
    processes does not shrink training), bounded by a hard wall-clock cap."""
    cpu = (time.process_time() - c0) / max(threads, 1)
    return max(cpu / budget, (time.time() - t0) / cap)


def sample_batch(stream: torch.Tensor, batch: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - SEQ_LEN - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + SEQ_LEN + 1] for s in starts.tolist()])


def train_loop(model, stream, args, minutes, peak_lr, teacher=None, alpha=0.5, tag="", steps=0):
    """AdamW training for `steps` steps (or, when 0, a time budget of `minutes`); with
    ``teacher`` mixes CE and KL(teacher||model). The LR schedule follows the used fraction."""
    gen = torch.Generator().manual_seed(args.seed + (1 if teacher is not None else 0))
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget, cap = minutes * 60.0, minutes * 60.0 * args.wall_cap_factor
    t0, c0, step, ema = time.time(), time.process_time(), 0, None
    model.train()

    def used() -> float:
        return step / steps if steps else budget_fraction(t0, c0, budget, cap, args.threads)

    while (frac := used()) < 1.0:
        for g in opt.param_groups:
            g["lr"] = lr_at(frac, peak_lr)
        batch = sample_batch(stream, args.batch_size, gen)
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        if teacher is not None:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(input_ids=x).logits, dim=-1)
            kl = F.kl_div(F.log_softmax(logits, -1), t_logp, log_target=True, reduction="batchmean") / x.size(1)
            loss = alpha * loss + (1 - alpha) * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 25 == 0:
            print(
                f"[{tag}] step {step} wall {time.time() - t0:6.0f}s budget {frac:.0%} loss(ema) {ema:.3f}", flush=True
            )
    model.eval()
    return {
        "steps": step,
        "seconds": round(time.time() - t0, 1),
        "cpu_seconds": round(time.process_time() - c0, 1),
        "tokens": step * args.batch_size * SEQ_LEN,
    }


def eval_batches(stream: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Deterministic, non-overlapping held-out windows (batches of 16)."""
    step = max((stream.numel() - SEQ_LEN - 1) // n, SEQ_LEN + 1)
    wins = [stream[i * step : i * step + SEQ_LEN + 1] for i in range(n) if i * step + SEQ_LEN + 1 <= stream.numel()]
    return [torch.stack(wins[i : i + 16]) for i in range(0, len(wins), 16)]


@torch.no_grad()
def evaluate(target, draft, batches) -> dict:
    """Held-out teacher-forced loss (nats/token) and draft/target top-1 agreement."""
    tot = {"target": 0.0, "draft": 0.0}
    agree = count = 0
    for b in batches:
        x, y = b[:, :-1], b[:, 1:]
        lt, ld = target(input_ids=x).logits.float(), draft(input_ids=x).logits.float()
        tot["target"] += F.cross_entropy(lt.flatten(0, 1), y.flatten(), reduction="sum").item()
        tot["draft"] += F.cross_entropy(ld.flatten(0, 1), y.flatten(), reduction="sum").item()
        agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        count += y.numel()
    return {
        "target_loss": tot["target"] / count,
        "draft_loss": tot["draft"] / count,
        "top1_agreement": agree / count,
        "eval_tokens": count,
    }


def save_model(model, tokenizer, out: Path) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    eos = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def build_model(kind: str, tokenizer, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = make_config(kind, len(tokenizer), tokenizer.eos_token_id)
    model = LlamaForCausalLM(cfg)
    return model, sum(p.numel() for p in model.parameters())


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_txt, held_txt = collect_sources(stdlib)
    corpus = (
        f"{len(train_txt)} train / {len(held_txt)} held-out .py files from "
        f"CPython {sys.version.split()[0]} stdlib ({sum(map(len, train_txt)):,} chars train)"
    )
    print(corpus, flush=True)
    t0 = time.time()
    tokenizer = train_tokenizer(train_txt, args.vocab_size)
    train_ids, held_ids = encode_stream(tokenizer, train_txt), encode_stream(tokenizer, held_txt)
    print(
        f"tokenizer {time.time() - t0:.0f}s; train {train_ids.numel():,} tokens, held-out {held_ids.numel():,} tokens",
        flush=True,
    )

    target, t_params = build_model("target", tokenizer, args.seed)
    t_stats = train_loop(
        target, train_ids, args, args.target_minutes, args.target_lr, tag="target", steps=args.target_steps
    )
    draft, d_params = build_model("draft", tokenizer, args.seed + 1)
    for p in target.parameters():
        p.requires_grad_(False)
    teacher = target if args.distill_alpha < 1.0 else None
    d_stats = train_loop(
        draft,
        train_ids,
        args,
        args.draft_minutes,
        args.draft_lr,
        teacher=teacher,
        alpha=args.distill_alpha,
        tag="draft",
        steps=args.draft_steps,
    )

    save_model(target, tokenizer, out / "target")
    save_model(draft, tokenizer, out / "draft")
    quality = evaluate_saved(out, held_ids, args.eval_seqs)
    print(json.dumps(quality, indent=1), flush=True)
    info = {
        "command": command_line(),
        "seed": args.seed,
        "threads": args.threads,
        "corpus": corpus,
        "vocab": len(tokenizer),
        "batch": args.batch_size,
        "quality": quality,
        "lrs": f"target {args.target_lr:g} / draft {args.draft_lr:g}",
        "draft_obj": (
            "next-token cross-entropy on the same data (no distillation)"
            if teacher is None
            else f"{args.distill_alpha:g} * CE + {1 - args.distill_alpha:g} * KL(target || draft)"
        ),
        "target": {**t_stats, "params": t_params, "mb": dir_mb(out / "target"), "shape": shape_of(target)},
        "draft": {**d_stats, "params": d_params, "mb": dir_mb(out / "draft"), "shape": shape_of(draft)},
    }
    prompt = Path(__file__).resolve().parents[1] / "examples" / "prompt.txt"
    info["sample"] = greedy_sample(out, prompt) if prompt.exists() else None
    print(json.dumps(info["sample"], indent=1), flush=True)
    write_readme(out, info, EOT, SEQ_LEN)
    print(json.dumps({k: info[k] for k in ("target", "draft")}, indent=1))
    return 0


@torch.no_grad()
def greedy_sample(out: Path, prompt_path: Path, n: int = 64) -> dict:
    """The shipped target's greedy n-token continuation of `prompt_path` (what `specx run` shows
    with the demo pair: decoding is lossless), and the fraction of its lines that are non-blank."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "target")
    model = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    ids = tok(prompt_path.read_text(), return_tensors="pt")["input_ids"]
    for _ in range(n):
        nxt = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        if nxt.item() == tok.eos_token_id:
            break
    n_prompt = len(tok(prompt_path.read_text())["input_ids"])
    text = tok.decode(ids[0, n_prompt:], skip_special_tokens=True)
    lines = text.split("\n")
    if lines and not lines[-1]:
        lines.pop()  # a trailing newline does not start a line
    nonblank = sum(bool(line.strip()) for line in lines)
    return {"text": text, "nonblank_fraction": nonblank / max(len(lines), 1), "lines": len(lines)}


def command_line() -> str:
    env = "".join(f"{k}={os.environ[k]} " for k in ("OMP_WAIT_POLICY",) if k in os.environ)
    return env + "nice -n 10 python " + " ".join(shlex.quote(a) for a in sys.argv)


def shape_of(model) -> str:
    c = model.config
    return f"{c.num_hidden_layers} x {c.hidden_size}"


def evaluate_saved(out: Path, held_ids: torch.Tensor, n: int) -> dict:
    """Reload the shipped bf16 checkpoints as fp32 and evaluate them."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(out / "draft", dtype=torch.float32).eval()
    return evaluate(target, draft, eval_batches(held_ids, n))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    # NB: set OMP_WAIT_POLICY=PASSIVE in the environment (before torch loads) on
    # a shared machine so idle OpenMP threads sleep instead of spinning.
    raise SystemExit(main())
