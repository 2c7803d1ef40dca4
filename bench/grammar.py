"""Structured output costs: grammar engines' mask time at a 128k vocabulary, and the constrained step.

Three measurements, each writing JSON (`--out`) and printing a table:

* `--engines --tokenizer DIR`: llguidance against xgrammar (whichever is installed), one JSON-schema
  grammar (`SCHEMA`) in two layouts (compact: no free whitespace, ", " and ": " separators, as
  specx compiles it; flexible: any whitespace between tokens), a 128k-token byte-level BPE tokenizer. Each engine compiles the grammar, then
  walks the tokens of one valid document (`DOCUMENT`, tokenized by the tokenizer) computing the
  full next-token bitmask before every token; seconds per mask (median, mean, max over the walk)
  and the compile seconds (tokenizer wrapping excluded); `--repeat` walks, each mask's fastest walk
  counts (the machine may be shared). `--build-tokenizer DIR` first trains such
  a tokenizer (`tokenizers`' BPE trainer, 128256 tokens, on the first 60 MB of .py files of this
  Python's standard library and site-packages, sorted by path), for machines without a 128k
  tokenizer at hand.
* default: specx's decode on the shared pair (`--target`, `--draft`, fp32 on the CPU), the first
  `--n-prompts` prompts of `--prompts` (jsonl, field "prompt") each followed by `--suffix`, at
  T = 0: specexec without a grammar, specexec and `--method ar` with one (`--schema`, a JSON-schema
  file; default `DECODE_SCHEMA`). Per run: tokens per target pass (the prefill's token excluded), mask
  seconds per pass (host time in core/constrain.py: forks, mask rows, catching up the committed
  state; wall time, so on a loaded machine it carries others' load) and mask rows per pass, and
  whether constrained specexec's ids equal constrained ar's.
* `--masks --tokenizer DIR [DIR ...]`: the host time of one pass's grammar masks as the reply grows,
  walk against fork, per tokenizer (bench/grammar_masks.py says what it measures).
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import statistics
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `offload` is the package, not bench/offload.py beside this script
sys.path.append(os.path.join(ROOT, "bench"))  # after the package: bench/offload.py must not shadow offload/

import grammar_masks  # noqa: E402  (bench/ is not a package)
from docblock import md_table  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}
# the decode runs' default: short strings, so a small model's replies complete within the token limit
DECODE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "size": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "debug": {"type": "boolean"},
    },
    "required": ["name", "size", "tags", "debug"],
    "additionalProperties": False,
}
DOCUMENT = (
    '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", '
    '"poetry"], "address": {"street": "12 St James Square", "city": "London", "zip": "01234"}, '
    '"active": true}'
)


def build_tokenizer(out: str, vocab: int = 128256, corpus_bytes: int = 60_000_000) -> None:
    """Train a byte-level BPE tokenizer of `vocab` tokens on local Python sources (module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    texts, total = [], 0
    for path in sorted(p for r in roots for p in glob.glob(os.path.join(r, "**", "*.py"), recursive=True)):
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        except (OSError, UnicodeDecodeError):
            continue
        total += len(texts[-1])
        if total > corpus_bytes:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)


def walk_llguidance(hf_tok, schema: dict, ids: list[int], compact: bool) -> dict:
    import llguidance
    import llguidance.hf

    lltok = llguidance.hf.from_tokenizer(hf_tok)
    t0 = time.perf_counter()
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "} if compact else None
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=layout)
    m = llguidance.LLMatcher(lltok, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    times = []
    for t in ids:
        t0 = time.perf_counter()
        m.compute_bitmask()
        times.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    return {"version": llguidance.__version__, "compile_s": compile_s, "mask_s": times}


def walk_xgrammar(hf_tok, schema: dict, ids: list[int], compact: bool) -> dict:
    import importlib.metadata

    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=len(hf_tok))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=not compact, separators=(", ", ": ") if compact else None
    )
    m = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - t0
    bits = xgr.allocate_token_bitmask(1, len(hf_tok))
    times = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bits)
        times.append(time.perf_counter() - t0)
        assert m.accept_token(t)
    return {"version": importlib.metadata.version("xgrammar"), "compile_s": compile_s, "mask_s": times}


def engines(args) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = tok.encode(DOCUMENT, add_special_tokens=False)
    rows = {}
    for (name, fn), layout in itertools.product(
        (("llguidance", walk_llguidance), ("xgrammar", walk_xgrammar)), ("compact", "flexible")
    ):
        try:
            runs = [fn(tok, SCHEMA, ids, layout == "compact") for _ in range(args.repeat)]
        except ImportError as exc:
            print(f"{name}: not installed ({exc})", file=sys.stderr)
            continue
        # per position, the fastest of the repeats (the machine is shared: slower ones carry others' load)
        s = [min(col) for col in zip(*(r["mask_s"] for r in runs))]
        rows[f"{name} {layout}"] = {
            "engine": name,
            "layout": layout,
            "version": runs[0]["version"],
            "compile_s": min(r["compile_s"] for r in runs),
            "repeats": args.repeat,
            "masks": len(s),
            "mask_median_s": statistics.median(s),
            "mask_mean_s": statistics.mean(s),
            "mask_max_s": max(s),
            "mask_total_s": sum(s),
        }
    res = {
        "what": "engines",
        "vocab": len(tok),
        "tokenizer": args.tokenizer,
        "document_tokens": len(ids),
        "schema": SCHEMA,
        "engines": rows,
    }
    print(engines_table(res))
    return res


def engines_table(data: dict) -> str:
    """`--engines`' table from its JSON (docs/performance.md's `bench:grammar-engines`)."""
    head = ["engine", "JSON whitespace", "compile s", "mask median µs", "mask mean µs", "mask max µs"]
    rows = [
        [f"{r['engine']} {r['version']}", r["layout"], f"{r['compile_s']:.3f}"]
        + [f"{r[k] * 1e6:.0f}" for k in ("mask_median_s", "mask_mean_s", "mask_max_s")]
        for r in data["engines"].values()
    ]
    return md_table(head, rows)


def decode_one(m, ids: list[int], cfg) -> dict:
    """One reply: ids, passes after the prefill, and the grammar's mask work (None without one)."""
    from specexec_cli.core.engine import DecodeState
    from specexec_cli.core.methods import generate

    st, run, tokens, passes, finish = DecodeState(), None, [], 0, None
    for ev in generate(m, st, list(ids), cfg):
        run = run or st.grammar  # the call's GrammarRun (dropped when the call ends)
        tokens += ev.tokens
        passes += ev.pass_index > 0
        finish = ev.finish
    out = {"ids": tokens, "passes": passes, "finish": finish}
    if run is not None:
        out.update(masks=run.stats.masks, mask_s=run.stats.seconds)
    return out


def decode(args) -> dict:
    """Tokens per target pass and mask seconds per pass, with and without a grammar (module docstring)."""
    from dataclasses import replace

    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import GenerationConfig
    from specexec_cli.core.grammar import GrammarSpec
    from specexec_cli.session.loading import LoadOptions, load_models

    m = load_models(LoadOptions(args.target, args.draft, dtype="fp32", device="cpu"))
    schema = DECODE_SCHEMA
    if args.schema:
        with open(args.schema) as f:
            schema = json.load(f)
    spec = GrammarSpec("json_schema", json.dumps(schema))
    with open(args.prompts) as f:
        lines = f.read().splitlines()[: args.n_prompts]
    base = GenerationConfig(shape=TreeShape(args.budget, args.max_depth), max_new_tokens=args.max_new_tokens)
    rows = {"specexec, free": [], "specexec, grammar": [], "ar, grammar": []}
    for line in lines:
        ids = m.tokenizer(json.loads(line)["prompt"] + args.suffix)["input_ids"]
        rows["specexec, free"].append(decode_one(m, ids, base))
        rows["specexec, grammar"].append(decode_one(m, ids, replace(base, grammar=spec)))
        rows["ar, grammar"].append(decode_one(m, ids, replace(base, method="ar", grammar=spec)))
    equal = all(a["ids"] == b["ids"] for a, b in zip(rows["specexec, grammar"], rows["ar, grammar"]))
    table = {}
    for name, runs in rows.items():
        passes = sum(r["passes"] for r in runs)
        tokens = sum(len(r["ids"]) - 1 for r in runs)  # the prefill's token came without a decode pass
        table[name] = {
            "tokens": tokens,
            "passes": passes,
            "tokens_per_pass": tokens / passes,
            "mask_s_per_pass": (sum(r.get("mask_s", 0.0) for r in runs) / passes) if "grammar" in name else None,
            "masks_per_pass": (sum(r.get("masks", 0) for r in runs) / passes) if "grammar" in name else None,
            "finish": {f: sum(r["finish"] == f for r in runs) for f in {r["finish"] for r in runs}},
        }
    print("| run | tokens per target pass | mask ms per pass | masks per pass | finish |")
    print("|---|---|---|---|---|")
    for name, r in table.items():
        ms = "-" if r["mask_s_per_pass"] is None else f"{r['mask_s_per_pass'] * 1e3:.1f}"
        mp = "-" if r["masks_per_pass"] is None else f"{r['masks_per_pass']:.0f}"
        print(f"| {name} | {r['tokens_per_pass']:.2f} | {ms} | {mp} | {r['finish']} |")
    print(f"constrained specexec ids == constrained ar ids: {equal}")
    return {
        "what": "decode",
        "target": args.target,
        "draft": args.draft,
        "prompts": len(lines),
        "budget": args.budget,
        "max_depth": args.max_depth,
        "max_new_tokens": args.max_new_tokens,
        "temperature": 0.0,
        "schema": schema,
        "prompt_suffix": args.suffix,
        "vocab": len(m.tokenizer),
        "specexec_equals_ar": equal,
        "rows": table,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", action="store_true", help="grammar engines' mask time (needs --tokenizer)")
    ap.add_argument("--masks", action="store_true", help="mask time per pass by reply length (needs --tokenizer)")
    ap.add_argument("--tokenizer", nargs="+", help="tokenizer directories (--engines: the first; --masks: each)")
    ap.add_argument("--build-tokenizer", help="train a byte-level BPE tokenizer into this directory first")
    ap.add_argument("--vocab", type=int, default=128256, help="tokens of --build-tokenizer's tokenizer")
    ap.add_argument("--corpus-mb", type=int, default=60, help="MB of Python sources --build-tokenizer trains on")
    ap.add_argument("--replies", type=int, nargs="+", default=[100, 1000, 4000], help="reply tokens (--masks)")
    ap.add_argument("--passes", type=int, default=8, help="passes per reply length (--masks)")
    ap.add_argument("--branch", type=int, default=4, help="children per spine node (--masks)")
    ap.add_argument("--depth", type=int, default=16, help="spine depth (--masks)")
    ap.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="walks per engine (--engines; per mask the fastest counts), runs per reply (--masks)",
    )
    ap.add_argument("--out", help="JSON results file")
    shared = os.path.join(os.path.dirname(ROOT), "shared")
    ap.add_argument("--target", default=os.path.join(shared, "models", "target"))
    ap.add_argument("--draft", default=os.path.join(shared, "models", "draft"))
    ap.add_argument("--prompts", default=os.path.join(shared, "bench", "prompts.jsonl"))
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--suffix", default="\nCONFIG = ", help="text after each prompt (the reply starts there)")
    ap.add_argument("--schema", help="a JSON Schema file (default: the module's DECODE_SCHEMA)")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--max-depth", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    if args.build_tokenizer:
        build_tokenizer(args.build_tokenizer, args.vocab, args.corpus_mb * 1_000_000)
        args.tokenizer = args.tokenizer or [args.build_tokenizer]
    if args.engines:
        args.tokenizer = args.tokenizer[0]
        res = engines(args)
    elif args.masks:
        print(grammar_masks.HEADER)
        res = grammar_masks.masks(args)
        print(grammar_masks.table(res))
    else:
        res = decode(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
