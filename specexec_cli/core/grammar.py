"""Structured output as a grammar: JSON (any object, or one JSON Schema) between literal text, as token masks.

Contract: `compile_grammar(tokenizer, spec, eos_ids, width)` turns a `GrammarSpec` into a
`CompiledGrammar` (cached) or raises `GrammarError`, one line naming what is wrong. Its matchers
(xgrammar.GrammarMatcher) answer "which tokens may come next" as packed bitmask rows (bit t % 32 of
int32 word t // 32 = token t allowed); EOS is allowed exactly where the grammar accepts. Rows cover
`width` columns (`output_width`: the widest output layer, which may pad past the tokenizer), and
`keep` is every id a reply may hold: the tokenizer's ids except special tokens, plus EOS (xgrammar
sets the bits past its vocabulary in the last word, so constrain.py ANDs every row with it).
xgrammar is an optional dependency (the `grammar` extra); without it a request gets one line naming
the install command. JSON layout: no free whitespace (a small model could emit it forever), ", " and
": "; the schema is read as written (extra properties allowed unless it says otherwise).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass

import torch

from specexec_cli.errors import SpecxError

KINDS = ("json_object", "json_schema")
SEPARATORS = (", ", ": ")  # between items, after keys (module docstring)
INSTALL = "pip install -e '.[grammar]' in your specx clone"  # what a missing xgrammar asks for
CACHE_SIZE = 32  # compiled grammars kept (least recently used dropped)


@dataclass(frozen=True)
class GrammarSpec:
    """What the reply must be: [prefix] JSON value [suffix], then EOS; with `repeat`, one or more
    such blocks separated by it (several tool calls), then EOS."""

    kind: str  # "json_object" (any JSON object) | "json_schema" (the value validates against `schema`)
    schema: str | None = None  # the JSON Schema as JSON text (kind "json_schema"); ignored for json_object
    prefix: str = ""  # literal text the output must start with (e.g. "<tool_call>\n")
    suffix: str = ""  # literal text after the JSON value (e.g. "\n</tool_call>")
    repeat: str | None = None  # None: one block; else the literal separator between repeated blocks


class GrammarError(SpecxError):
    """A grammar that cannot be compiled (invalid schema, unknown kind, tokenizer without a fast backend)."""


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar bound to one tokenizer: makes matchers at the grammar's start."""

    spec: GrammarSpec  # what was compiled
    compiled: object  # xgrammar.CompiledGrammar
    vocab: int  # columns the masks cover (the output layer's width); rows have (vocab + 31) // 32 int32 words
    eos_ids: tuple[int, ...]  # tokens that end the reply (allowed where the grammar accepts)
    keep: torch.Tensor  # (words,) int32 packed: the ids a reply may hold (module docstring)
    banned: frozenset[int]  # the ids below `vocab` that `keep` forbids (special tokens, padding columns)

    def may_hold(self, token: int) -> bool:
        """`keep`'s bit of one token id (ids outside [0, vocab) are never allowed)."""
        return 0 <= token < self.vocab and token not in self.banned

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab + 31) // 32

    def matcher(self):
        """A fresh matcher at the grammar's start (before the first generated token)."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compiled)


_LOCK = threading.Lock()
# (id(tokenizer), eos, width) -> (weakref to the tokenizer, xgrammar.GrammarCompiler, keep_row's pair)
_COMPILERS: dict[tuple[int, tuple[int, ...], int], tuple[weakref.ref, object, tuple]] = {}
_COMPILED: dict[tuple[int, tuple[int, ...], int, GrammarSpec], CompiledGrammar] = {}  # insertion order = LRU order


def pack(ok: torch.Tensor) -> torch.Tensor:
    """(..., 32 W) bool -> (..., W) int32 packed rows (bit t % 32 of word t // 32 = ok[t])."""
    v = (ok.reshape(*ok.shape[:-1], -1, 32).long() << torch.arange(32)).sum(-1)  # (..., W) in [0, 2^32)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def output_width(*models) -> int | None:
    """Columns of the widest output layer among `models` (lm_head rows, else vocab_size); None if none says."""
    widths = []
    for model in models:
        head = getattr(model, "lm_head", None)
        if head is None and hasattr(model, "get_output_embeddings"):
            head = model.get_output_embeddings()
        rows = getattr(head, "out_features", None)
        if rows is None:
            cfg = getattr(model, "config", None)
            cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
            rows = getattr(cfg, "vocab_size", None)
        if isinstance(rows, int) and rows > 0:
            widths.append(rows)
    return max(widths) if widths else None


def special_ids(tokenizer) -> set[int]:
    """The tokenizer's named special ids and every added token flagged special (skip_special_tokens drops them)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def keep_row(tokenizer, width: int, eos: tuple[int, ...]) -> tuple[torch.Tensor, frozenset[int]]:
    """((W,) int32 packed row, banned ids): the row allows the ids below min(tokenizer size, width)
    that are not special, and the EOS ids; banned = the ids below `width` it forbids."""
    ok = torch.zeros((width + 31) // 32 * 32, dtype=torch.bool)
    ok[: min(len(tokenizer), width)] = True
    ok[[i for i in special_ids(tokenizer) if i < width]] = False
    ok[[i for i in eos if i < width]] = True
    return pack(ok), frozenset((~ok[:width]).nonzero().flatten().tolist())


def first_line(msg: str) -> str:
    """xgrammar's message without its "[time] source.cc:line: " prefix, first line only."""
    line = (msg or "unknown error").strip().splitlines()[0]
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", line)


def schema_text(spec: GrammarSpec) -> str:
    """The JSON Schema to compile, as text (GrammarError on bad input)."""
    if spec.kind not in KINDS:
        raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)} (got {spec.kind!r})")
    if spec.kind == "json_object":
        return '{"type": "object"}'
    if not spec.schema:
        raise GrammarError("json_schema needs a schema; pass the JSON Schema object")
    try:
        schema = json.loads(spec.schema)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"the JSON schema is not valid JSON ({exc.msg} at character {exc.pos})") from None
    if schema is True:
        return "{}"
    if not isinstance(schema, dict):
        raise GrammarError("the JSON schema must be a JSON object (or true)")
    return spec.schema


def build(spec: GrammarSpec):
    """xgrammar.Grammar of [prefix] JSON value [suffix], repeated when `spec.repeat` says so."""
    import xgrammar

    text = schema_text(spec)
    try:
        parts = [
            xgrammar.Grammar.from_json_schema(text, any_whitespace=False, separators=SEPARATORS, strict_mode=False)
        ]
    except (RuntimeError, ValueError) as exc:
        what = "JSON schema" if spec.kind == "json_schema" else "grammar"
        raise GrammarError(f"invalid {what}: {first_line(str(exc))}") from None
    if spec.repeat is not None:  # block (repeat block)*: the JSON grammar's rules plus two of ours

        def lit(text: str) -> str:
            return json.dumps(text, ensure_ascii=False) if text else ""

        block = " ".join(filter(None, (lit(spec.prefix), "root", lit(spec.suffix))))
        sep = lit(spec.repeat)
        ebnf = f"{parts[0]}\nspecx_block ::= {block}\nspecx_blocks ::= specx_block ({sep} specx_block)*\n"
        return xgrammar.Grammar.from_ebnf(ebnf, root_rule_name="specx_blocks")
    if spec.prefix:
        parts.insert(0, xgrammar.Grammar.from_ebnf("root ::= " + json.dumps(spec.prefix, ensure_ascii=False)))
    if spec.suffix:
        parts.append(xgrammar.Grammar.from_ebnf("root ::= " + json.dumps(spec.suffix, ensure_ascii=False)))
    return parts[0] if len(parts) == 1 else xgrammar.Grammar.concat(*parts)


def eos_of(tokenizer, eos_ids) -> tuple[int, ...]:
    ids = tuple(sorted(set(eos_ids))) if eos_ids else ()
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids = (int(tokenizer.eos_token_id),)
    if not ids:
        raise GrammarError("the tokenizer has no EOS token, so a constrained reply could never end")
    return ids


def compiler_for(tokenizer, eos: tuple[int, ...], width: int):
    """(xgrammar's compiler, keep row) for `tokenizer` at `width` columns (cached per tokenizer, EOS, width)."""
    key = (id(tokenizer), eos, width)
    hit = _COMPILERS.get(key)
    if hit is not None and hit[0]() is tokenizer:
        return hit[1], hit[2]
    try:
        import xgrammar
    except ImportError:
        raise GrammarError(f"structured output needs the xgrammar package: {INSTALL}") from None
    try:
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=width, stop_token_ids=list(eos))
    except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
        raise GrammarError(f"structured output cannot read this tokenizer: {first_line(str(exc))}") from None
    compiler, keep = xgrammar.GrammarCompiler(info), keep_row(tokenizer, width, eos)
    _COMPILERS[key] = (weakref.ref(tokenizer), compiler, keep)
    return compiler, keep  # keep: (row, banned ids)


def compile_grammar(tokenizer, spec: GrammarSpec, eos_ids=None, width: int | None = None) -> CompiledGrammar:
    """`spec` compiled for `tokenizer` (cached, LRU); eos_ids None: the tokenizer's EOS; width None: its size."""
    eos = eos_of(tokenizer, eos_ids)
    width = width or len(tokenizer)
    key = (id(tokenizer), eos, width, spec)
    with _LOCK:
        hit = _COMPILED.pop(key, None)
        if hit is not None and _COMPILERS.get(key[:3], (lambda: None,))[0]() is tokenizer:
            _COMPILED[key] = hit
            return hit
        compiler, keep = compiler_for(tokenizer, eos, width)
        grammar = build(spec)
        try:
            compiled = CompiledGrammar(spec, compiler.compile_grammar(grammar), width, eos, *keep)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(f"invalid grammar: {first_line(str(exc))}") from None
        _COMPILED[key] = compiled
        while len(_COMPILED) > CACHE_SIZE:
            _COMPILED.pop(next(iter(_COMPILED)))
        return compiled
