"""Structured output as a grammar: JSON (any object, or one JSON Schema) between literal text, as token masks.

Contract: `GrammarSpec` says what the reply must be (`kind` "json_object" | "json_schema", the schema
as JSON text, a literal `prefix` and `suffix` around the JSON value, and `repeat`: None for one such
block, else the separator of one or more blocks, as several tool calls); `compile_grammar(tokenizer,
spec)` turns it into a `CompiledGrammar` (cached per tokenizer and spec) or raises `GrammarError`, one
line naming what is wrong. A `CompiledGrammar` makes matchers (xgrammar.GrammarMatcher): the parser
state after a sequence of tokens, which answers "which tokens may come next" as a packed bitmask
(bit t % 32 of int32 word t // 32 set = token t allowed). EOS (every id of `eos_ids`) is allowed
exactly where the grammar accepts; where EOS is the only token allowed, the text is complete and
nothing more can follow: the reply ends there (constrain.py).

The engine is xgrammar, chosen by measured mask time at a 128k vocabulary against llguidance
(bench/grammar.py --engines, docs/performance.md): an optional dependency (the `grammar` extra:
it requires triton on Linux), so a request with a grammar on an install without it gets one line
naming the install command. JSON layout: no free whitespace, ", " between items and ": " after keys
(a small model offered free whitespace can emit it forever); the schema is read as written (JSON
Schema's defaults: extra properties allowed unless "additionalProperties": false says otherwise).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass

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


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar bound to one tokenizer: makes matchers at the grammar's start."""

    spec: GrammarSpec  # what was compiled
    compiled: object  # xgrammar.CompiledGrammar
    vocab: int  # tokens the masks cover; bitmask rows have (vocab + 31) // 32 int32 words
    eos_ids: tuple[int, ...]  # tokens that end the reply (allowed where the grammar accepts)

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab + 31) // 32

    def matcher(self):
        """A fresh matcher at the grammar's start (before the first generated token)."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compiled)


_LOCK = threading.Lock()
_COMPILERS: dict[tuple[int, tuple[int, ...]], tuple[weakref.ref, object]] = {}  # (id, eos) -> (ref, GrammarCompiler)
_COMPILED: dict[tuple[int, tuple[int, ...], GrammarSpec], CompiledGrammar] = {}  # insertion order = LRU order


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
    """xgrammar.Grammar of [prefix] JSON value [suffix], repeated when `spec.repeat` says so
    (GrammarError naming what is wrong)."""
    import xgrammar

    text = schema_text(spec)
    try:
        parts = [xgrammar.Grammar.from_json_schema(text, any_whitespace=False, separators=SEPARATORS,
                                                   strict_mode=False)]
    except (RuntimeError, ValueError) as exc:
        what = "JSON schema" if spec.kind == "json_schema" else "grammar"
        raise GrammarError(f"invalid {what}: {first_line(str(exc))}") from None
    if spec.repeat is not None:   # block (repeat block)*: the JSON grammar's rules plus two of ours
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


def compiler_for(tokenizer, eos: tuple[int, ...]):
    """xgrammar's compiler for `tokenizer` (its token table read once; cached per tokenizer object and EOS set)."""
    key = (id(tokenizer), eos)
    hit = _COMPILERS.get(key)
    if hit is not None and hit[0]() is tokenizer:
        return hit[1]
    try:
        import xgrammar
    except ImportError:
        raise GrammarError(f"structured output needs the xgrammar package: {INSTALL}") from None
    try:
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=list(eos))
    except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
        raise GrammarError(f"structured output cannot read this tokenizer: {first_line(str(exc))}") from None
    compiler = xgrammar.GrammarCompiler(info)
    _COMPILERS[key] = (weakref.ref(tokenizer), compiler)
    return compiler


def compile_grammar(tokenizer, spec: GrammarSpec, eos_ids=None) -> CompiledGrammar:
    """`spec` compiled for `tokenizer` (cached per (tokenizer, spec, eos_ids)); GrammarError naming
    what is wrong. eos_ids: the tokens that end a reply (None: the tokenizer's EOS)."""
    eos = eos_of(tokenizer, eos_ids)
    key = (id(tokenizer), eos, spec)
    with _LOCK:
        hit = _COMPILED.pop(key, None)
        if hit is not None and _COMPILERS.get((id(tokenizer), eos), (lambda: None,))[0]() is tokenizer:
            _COMPILED[key] = hit
            return hit
        compiler = compiler_for(tokenizer, eos)
        grammar = build(spec)
        try:
            compiled = CompiledGrammar(spec, compiler.compile_grammar(grammar), len(tokenizer), eos)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(f"invalid grammar: {first_line(str(exc))}") from None
        _COMPILED[key] = compiled
        while len(_COMPILED) > CACHE_SIZE:
            _COMPILED.pop(next(iter(_COMPILED)))
        return compiled
