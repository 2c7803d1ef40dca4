#!/usr/bin/env python3
"""Distil a small Llama draft with the teacher's own tokenizer from a target model, on a CPU, in minutes.

Contract
--------
Usage:  python tools/distill_draft.py --teacher MODEL --out DIR [--minutes 45] [--hidden 96] [--layers 2]
        [--threads 1] [--cache FILE] [--seed 0]
Input:  MODEL, a GGUF file or an HF model directory (transformers loads both; a GGUF is de-quantized to
        fp32). Nothing is downloaded.
Data:   (a) the teacher's greedy replies (chat template applied when the tokenizer has one) to the prompts
        of tools/distill_data.chat_prompts, generated in left-padded batches; the top-k logits of every
        reply token come from generate itself; (b) the Python standard library's docstrings and source
        (tools/distill_data.offline_texts), cut into --seq-len token chunks and run through the teacher
        once (teacher forcing), keeping the top-k logits of every position. --cache FILE stores both (a
        torch file) and, when FILE exists, replaces the teacher phases (the teacher is then not loaded;
        only its tokenizer is, for the output).
Student: LlamaForCausalLM, --layers layers of width --hidden (head_dim 32), tied embeddings initialised by
        projecting the teacher's token embedding onto its top --hidden principal directions (SVD), the
        teacher's vocabulary, special ids, rope theta and context length.
Loss:   cross-entropy of the student's full-vocabulary log-softmax against the teacher's top-k
        probabilities (softmax of the cached top-k logits, renormalised) = KL to the truncated teacher
        plus its constant entropy; AdamW, warmup then cosine over the used fraction of the time budget
        (or over --steps, which trains exactly that many steps and ignores the clock).
Output: DIR with config.json, model.safetensors (bf16), generation_config.json, the teacher's tokenizer
        files (same vocabulary: usable as `specx --draft DIR`) and distill.json (the command's settings,
        data sizes, phase times (of the run that wrote the data; `data_from_cache` says whether it came
        from --cache) and held-out top-1 agreement with the teacher, before and after training).
Budget: --minutes M caps the whole run's wall time: about 35% for replies, 20% for text, the rest training
        (less what loading took). Run it under `nice -n 19` on a shared machine; --threads sets torch's.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill_data import chat_prompts, offline_texts


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path)


def load_teacher(path: Path):
    from transformers import AutoModelForCausalLM

    kw = dict(gguf_file=path.name) if path.suffix == ".gguf" else {}
    src = path.parent if path.suffix == ".gguf" else path
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw).eval()


def record(ids: torch.Tensor, pos: torch.Tensor, logits: torch.Tensor, k: int) -> dict:
    """One training sequence: ids (L,), the positions that carry targets (m,), their teacher top-k (m, k)."""
    vals, idx = logits.float().topk(k, dim=-1)
    return dict(ids=ids.to(torch.int32), pos=pos.to(torch.int32), vals=vals.half(), idx=idx.to(torch.int32))


@torch.no_grad()
def gen_replies(model, tok, prompts: list[str], args, deadline: float) -> list[dict]:
    """Greedy replies in left-padded batches; target at prompt_len - 1 + j is the logit row of reply token j."""
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = set(filter(lambda x: x is not None, [tok.eos_token_id, model.generation_config.eos_token_id]))
    eos = {e for x in eos for e in (x if isinstance(x, list) else [x])}
    out: list[dict] = []
    for start in range(0, len(prompts), args.gen_batch):
        if time.time() > deadline:
            break
        chunk = prompts[start : start + args.gen_batch]
        if tok.chat_template:
            msgs = [[{"role": "user", "content": p}] for p in chunk]
            enc = tok.apply_chat_template(
                msgs, add_generation_prompt=True, padding=True, return_dict=True, return_tensors="pt"
            )
        else:
            enc = tok(chunk, padding=True, return_tensors="pt")
        res = model.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            do_sample=False,
            max_new_tokens=args.gen_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
        )
        logits = torch.stack(res.logits, 1)  # (B, steps, V)
        plen = enc["input_ids"].shape[1]
        for b in range(len(chunk)):
            prompt = enc["input_ids"][b][enc["attention_mask"][b].bool()]
            reply = res.sequences[b, plen:]
            n = len(reply)
            for j, t in enumerate(reply.tolist()):  # keep the first EOS, drop what follows it
                if t in eos:
                    n = j + 1
                    break
            ids = torch.cat([prompt, reply[:n]])
            pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + n)
            out.append(record(ids, pos, logits[b, :n], args.topk))
        print(f"  replies: {len(out)} of {len(prompts)} ({sum(len(r['pos']) for r in out)} tokens)", flush=True)
    return out


@torch.no_grad()
def text_records(model, tok, texts: list[str], args, deadline: float) -> list[dict]:
    """Teacher-forced top-k on every position of --seq-len chunks of the offline text (EOS between texts)."""
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    stream: list[int] = []
    for t in texts:
        stream += tok(t, add_special_tokens=False)["input_ids"] + [eos]
        if len(stream) > args.text_tokens:
            break
    L = args.seq_len
    chunks = [torch.tensor(stream[i : i + L]) for i in range(0, len(stream) - L + 1, L)]
    out: list[dict] = []
    for start in range(0, len(chunks), args.text_batch):
        if time.time() > deadline:
            break
        batch = torch.stack(chunks[start : start + args.text_batch])
        logits = model(batch).logits
        out += [record(batch[b], torch.arange(L), logits[b], args.topk) for b in range(len(batch))]
        if len(out) % (args.text_batch * 10) == 0:
            print(f"  text: {len(out)} of {len(chunks)} chunks", flush=True)
    return out


def build_student(teacher_cfg, embed: torch.Tensor, hidden: int, layers: int):
    """A Llama student whose tied embedding is the teacher's projected on its top `hidden` principal axes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, hidden // 32)
    cfg = LlamaConfig(
        vocab_size=embed.shape[0],
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=math.ceil(hidden * 8 / 3 / 32) * 32,
        tie_word_embeddings=True,
        max_position_embeddings=getattr(teacher_cfg, "max_position_embeddings", 2048),
        rms_norm_eps=getattr(teacher_cfg, "rms_norm_eps", 1e-5),
        bos_token_id=teacher_cfg.bos_token_id,
        eos_token_id=teacher_cfg.eos_token_id,
        pad_token_id=getattr(teacher_cfg, "pad_token_id", None),
        rope_parameters=dict(
            getattr(teacher_cfg, "rope_parameters", None) or {"rope_theta": 10000.0, "rope_type": "default"}
        ),
    )
    student = LlamaForCausalLM(cfg)
    # E (V, d) ~ U S V^T: E V_h = U_h S_h keeps the most variance of the rows in `hidden` dimensions.
    # Scaled to a mean row norm of 1: against a normalised final hidden state the first logits then have a
    # spread of about 1 (the teacher's rows are longer and would start the loss far above log V).
    u, s, _ = torch.linalg.svd(embed.float(), full_matrices=False)
    emb = u[:, :hidden] * s[:hidden]
    with torch.no_grad():
        student.get_input_embeddings().weight.copy_(emb / emb.norm(dim=1).mean())
    student.tie_weights()
    return student


def batch_loss(student, recs: list[dict], negatives: int = 0) -> tuple[torch.Tensor, int, int]:
    """(mean soft cross-entropy over target positions, positions, top-1 agreements) of right-padded recs.

    negatives = 0: the student's softmax runs over the whole vocabulary. negatives > 0 (training): over a
    sampled candidate set instead, the union of the batch's teacher top-k ids and `negatives` uniformly
    drawn ids (sampled softmax: the head's cost falls from V to |set| columns; every teacher target is in
    the set, and the random ids push the rest of the vocabulary down over the steps)."""
    L = max(len(r["ids"]) for r in recs)
    ids = torch.zeros(len(recs), L, dtype=torch.long)
    for b, r in enumerate(recs):
        ids[b, : len(r["ids"])] = r["ids"].long()
    hid = student.model(input_ids=ids).last_hidden_state  # (B, L, h); causal: padding is harmless
    rows = torch.cat([torch.full((len(r["pos"]),), b) for b, r in enumerate(recs)])
    pos = torch.cat([r["pos"].long() for r in recs])
    idx = torch.cat([r["idx"].long() for r in recs])  # (m, k) teacher ids
    p = F.softmax(torch.cat([r["vals"].float() for r in recs]), -1)  # (m, k), renormalised top-k
    weight = student.lm_head.weight  # (V, h), tied to the embedding
    if negatives:
        cand = torch.unique(torch.cat([idx.flatten(), torch.randint(weight.shape[0], (negatives,))]))  # sorted
        logq = F.log_softmax((hid[rows, pos] @ weight[cand].T).float(), -1)  # (m, |cand|)
        col = torch.searchsorted(cand, idx)  # teacher ids -> columns
        loss = -(p * logq.gather(1, col)).sum(-1).mean()
        return loss, len(pos), int((cand[logq.argmax(-1)] == idx[:, 0]).sum())
    logq = F.log_softmax(student.lm_head(hid[rows, pos]).float(), -1)  # (m, V)
    loss = -(p * logq.gather(1, idx)).sum(-1).mean()
    return loss, len(pos), int((logq.argmax(-1) == idx[:, 0]).sum())


@torch.no_grad()
def agreement(student, recs: list[dict], bs: int = 16) -> float:
    """Held-out share of positions where the student's argmax is the teacher's."""
    n = a = 0
    for i in range(0, len(recs), bs):
        _, m, k = batch_loss(student, recs[i : i + bs])
        n, a = n + m, a + k
    return a / max(1, n)


def batches(recs: list[dict], max_tokens: int, rng: random.Random):
    """Endless random batches of about max_tokens tokens."""
    while True:
        order = list(range(len(recs)))
        rng.shuffle(order)
        cur: list[dict] = []
        for i in order:
            cur.append(recs[i])
            if sum(len(r["ids"]) for r in cur) >= max_tokens:
                yield cur
                cur = []


def train(student, recs: list[dict], args, deadline: float) -> dict:
    """AdamW with warmup + cosine over the used fraction of the time (or of --steps)."""
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    rng = random.Random(args.seed)
    t0, step, losses = time.time(), 0, []
    for batch in batches(recs, args.batch_tokens, rng):
        frac = step / args.steps if args.steps else (time.time() - t0) / max(1e-9, deadline - t0)
        if frac >= 1:
            break
        lr = args.lr * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * frac))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, m, agree = batch_loss(student, batch, args.negatives)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(loss.item())
        if step % 20 == 0 or step == 1:
            print(f"  step {step} frac {frac:.2f} lr {lr:.2e} loss {losses[-1]:.3f} agree {agree / m:.3f}", flush=True)
    # first: the first step's loss; last: the mean of the last 5 steps (one batch is noisy)
    return dict(
        steps=step,
        seconds=round(time.time() - t0, 1),
        first_loss=round(losses[0], 4) if losses else None,
        last_loss=round(sum(losses[-5:]) / len(losses[-5:]), 4) if losses else None,
    )


def collect(args, tok, t_start: float) -> tuple[dict, object]:
    """The cached data (or a fresh teacher's replies and text logits) and the teacher's config/embedding."""
    if args.cache and Path(args.cache).exists():  # its "times" are those of the run that wrote it
        return dict(torch.load(args.cache, weights_only=False), from_cache=True), None
    t = time.time()
    teacher = load_teacher(Path(args.teacher))
    times = dict(load=round(time.time() - t, 1))
    total = args.minutes * 60
    left = total - (time.time() - t_start)
    t = time.time()
    replies = gen_replies(teacher, tok, chat_prompts(args.prompts, args.seed), args, t + 0.35 * total)
    times["replies"] = round(time.time() - t, 1)
    t = time.time()
    text = text_records(teacher, tok, offline_texts(args.text_tokens * 5, args.seed), args, t + 0.2 * total)
    times["text"] = round(time.time() - t, 1)
    data = dict(
        replies=replies,
        text=text,
        times=times,
        left=left,
        embed=teacher.get_input_embeddings().weight.detach().clone(),
        config=teacher.config.to_dict(),
    )
    if args.cache:
        torch.save(data, args.cache)
    return data, teacher


def split(recs: list[dict], seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held out): one record in 20 held out, at least one when there are two."""
    order = list(range(len(recs)))
    random.Random(seed).shuffle(order)
    n = max(1 if len(recs) > 1 else 0, len(recs) // 20)
    return [recs[i] for i in order[n:]], [recs[i] for i in order[:n]]


def main(argv=None) -> int:
    args = parse(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    tok = load_tokenizer(Path(args.teacher))
    data, _ = collect(args, tok, t_start)
    from transformers import PretrainedConfig

    tcfg = PretrainedConfig.from_dict(data["config"])
    student = build_student(tcfg, data["embed"], args.hidden, args.layers)
    r_train, r_held = split(data["replies"], args.seed)
    x_train, x_held = split(data["text"], args.seed)
    before = dict(replies=agreement(student, r_held), text=agreement(student, x_held))
    print(f"held-out top-1 agreement before: {before}", flush=True)
    deadline = t_start + args.minutes * 60 - 60  # a minute for evaluation and saving
    fit = train(student, r_train + x_train, args, deadline)
    student.eval()
    after = dict(replies=agreement(student, r_held), text=agreement(student, x_held))
    print(f"held-out top-1 agreement after: {after}", flush=True)
    save(
        student,
        tok,
        args,
        dict(
            before=before,
            after=after,
            train=fit,
            times=data["times"],
            data_from_cache=data.get("from_cache", False),
            replies=len(data["replies"]),
            text_chunks=len(data["text"]),
            reply_tokens=sum(len(r["pos"]) for r in data["replies"]),
            text_tokens=sum(len(r["pos"]) for r in data["text"]),
        ),
    )
    return 0


def save(student, tok, args, report: dict) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    student.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "cache")}
    settings["teacher"] = Path(args.teacher).name
    (out / "distill.json").write_text(json.dumps(dict(settings=settings, **report), indent=1) + "\n")
    print(f"wrote {out} ({sum(p.stat().st_size for p in out.iterdir()) / 1e6:.1f} MB)")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", required=True, help="GGUF file or HF directory of the target")
    ap.add_argument("--out", required=True, help="output directory (HF format, usable as --draft)")
    ap.add_argument("--minutes", type=float, default=45.0, help="wall-time cap for the whole run")
    ap.add_argument("--steps", type=int, default=0, help="train exactly this many steps (ignores the clock)")
    ap.add_argument("--hidden", type=int, default=96)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=512, help="chat prompts for the teacher to answer")
    ap.add_argument("--gen-tokens", type=int, default=128, help="reply tokens per prompt")
    ap.add_argument("--gen-batch", type=int, default=16)
    ap.add_argument("--text-tokens", type=int, default=120_000, help="offline text tokens (teacher-forced)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--text-batch", type=int, default=8)
    ap.add_argument("--topk", type=int, default=32, help="teacher logits kept per position")
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument(
        "--negatives",
        type=int,
        default=4096,
        help="sampled-softmax negatives per training step (0: the full vocabulary)",
    )
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--cache", help="torch file holding the teacher data (written, or read when it exists)")
    args = ap.parse_args(argv)
    if args.hidden % 32 or args.hidden <= 0:
        ap.error("--hidden must be a positive multiple of 32 (head_dim 32)")
    if not Path(args.teacher).exists():
        ap.error(f"--teacher {args.teacher}: no such file or directory")
    return args


if __name__ == "__main__":
    sys.exit(main())
