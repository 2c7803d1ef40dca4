"""Structured output as a grammar: JSON (any object, or one JSON Schema) between literal text, as token masks.

Contract: `GrammarSpec` says what the reply must be (`kind` "json_object" | "json_schema", the schema
as JSON text, a literal `prefix` and `suffix` around the JSON value); `compile_grammar(tokenizer,
spec)` turns it into a `CompiledGrammar` (cached per tokenizer and spec) or raises `GrammarError`, one
line naming what is wrong. A `CompiledGrammar` makes matchers: the parser state after a sequence of
tokens, which answers "which tokens may come next" as a packed bitmask (bit t of 32-bit word t // 32
set = token t allowed), whether the text so far is complete (`is_accepting`) and whether nothing
more can follow (`is_stopped`: the reply ends there). EOS is allowed exactly where the grammar
accepts; every id of `eos_ids` counts as EOS.

The engine is llguidance (measured against xgrammar at a 128k vocabulary: bench/grammar.py --engines,
docs/performance.md); it is a core dependency, so a request with a grammar never fails for a missing
package. JSON layout: no free whitespace, ", " between items and ": " after keys (a small model
offered free whitespace can emit it forever); a schema's own "x-guidance" object overrides this.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass

from specexec_cli.errors import SpecxError

KINDS = ("json_object", "json_schema")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # see docstring
CACHE_SIZE = 32  # compiled grammars kept (least recently used dropped)


@dataclass(frozen=True)
class GrammarSpec:
    """What the reply must be: [prefix] JSON value [suffix], then EOS."""

    kind: str  # "json_object" (any JSON object) | "json_schema" (the value validates against `schema`)
    schema: str | None = None  # the JSON Schema as JSON text (kind "json_schema"); ignored for json_object
    prefix: str = ""  # literal text the output must start with (e.g. "<tool_call>\n")
    suffix: str = ""  # literal text after the JSON value (e.g. "\n</tool_call>")


class GrammarError(SpecxError):
    """A grammar that cannot be compiled (invalid schema, unknown kind, tokenizer without a fast backend)."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar bound to one tokenizer: makes matchers (llguidance.LLMatcher) at the grammar's start."""

    spec: GrammarSpec  # what was compiled
    text: str  # the llguidance (Lark) grammar text
    lltok: object  # llguidance.LLTokenizer of the tokenizer, EOS = `eos_ids`
    vocab: int  # tokens the masks cover; bitmask rows have (vocab + 31) // 32 int32 words
    eos_ids: tuple[int, ...]  # tokens that end the reply (allowed where the grammar accepts)

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab + 31) // 32

    def matcher(self):
        """A fresh matcher at the grammar's start (before the first generated token)."""
        import llguidance

        m = llguidance.LLMatcher(self.lltok, self.text, log_level=0)
        if m.is_error():
            raise GrammarError(f"grammar failed to start: {first_line(m.get_error())}")
        return m


_LOCK = threading.Lock()
_TOKENIZERS: dict[tuple[int, tuple[int, ...]], tuple[weakref.ref, object]] = {}  # (id, eos) -> (ref, LLTokenizer)
_COMPILED: dict[tuple[int, tuple[int, ...], GrammarSpec], CompiledGrammar] = {}  # insertion order = LRU order


def first_line(msg: str) -> str:
    """llguidance's message without its source excerpt and "at line(col): " location prefix."""
    line = (msg or "unknown error").strip().splitlines()[0]
    if line.startswith("at ") and ": " in line:
        line = line.split(": ", 1)[1]
    return line


def json_schema_of(spec: GrammarSpec) -> dict:
    """The schema object to compile, with the default JSON layout (GrammarError on bad input)."""
    if spec.kind not in KINDS:
        raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)} (got {spec.kind!r})")
    if spec.kind == "json_object":
        schema: object = {"type": "object"}
    else:
        if not spec.schema:
            raise GrammarError("json_schema needs a schema; pass the JSON Schema object")
        try:
            schema = json.loads(spec.schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON ({exc.msg} at character {exc.pos})") from None
        if schema is True or schema == {}:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be a JSON object (or true)")
    layout = {**JSON_LAYOUT, **(schema.get("x-guidance") or {})}
    return {**schema, "x-guidance": layout}


def lark_text(spec: GrammarSpec) -> str:
    """The Lark grammar: start: "prefix" value "suffix", value: %json {schema}."""
    body = json.dumps(json_schema_of(spec), ensure_ascii=False)
    seq = ([json.dumps(spec.prefix, ensure_ascii=False)] if spec.prefix else []) + ["value"]
    seq += [json.dumps(spec.suffix, ensure_ascii=False)] if spec.suffix else []
    return f"start: {' '.join(seq)}\nvalue: %json {body}\n"


def eos_of(tokenizer, eos_ids) -> tuple[int, ...]:
    ids = tuple(sorted(set(eos_ids))) if eos_ids else ()
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids = (int(tokenizer.eos_token_id),)
    if not ids:
        raise GrammarError("the tokenizer has no EOS token, so a constrained reply could never end")
    return ids


def ll_tokenizer(tokenizer, eos: tuple[int, ...]):
    """llguidance's view of `tokenizer` (about a second to build; cached per tokenizer object and EOS set)."""
    key = (id(tokenizer), eos)
    hit = _TOKENIZERS.get(key)
    if hit is not None and hit[0]() is tokenizer:
        return hit[1]
    import llguidance.hf

    try:
        lltok = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos))
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"structured output needs a fast (tokenizer.json) tokenizer: {first_line(str(exc))}") from None
    _TOKENIZERS[key] = (weakref.ref(tokenizer), lltok)
    return lltok


def compile_grammar(tokenizer, spec: GrammarSpec, eos_ids=None) -> CompiledGrammar:
    """`spec` compiled for `tokenizer` (cached per (tokenizer, spec, eos_ids)); GrammarError naming
    what is wrong. eos_ids: the tokens that end a reply (None: the tokenizer's EOS)."""
    eos = eos_of(tokenizer, eos_ids)
    key = (id(tokenizer), eos, spec)
    with _LOCK:
        hit = _COMPILED.pop(key, None)
        if hit is not None and _TOKENIZERS.get((id(tokenizer), eos), (lambda: None,))[0]() is tokenizer:
            _COMPILED[key] = hit
            return hit
        import llguidance

        text = lark_text(spec)
        lltok = ll_tokenizer(tokenizer, eos)
        err = llguidance.LLMatcher.validate_grammar(text, lltok)
        if err:
            what = "JSON schema" if spec.kind == "json_schema" else "grammar"
            raise GrammarError(f"invalid {what}: {first_line(err)}")
        compiled = CompiledGrammar(spec, text, lltok, int(lltok.vocab_size), eos)
        _COMPILED[key] = compiled
        while len(_COMPILED) > CACHE_SIZE:
            _COMPILED.pop(next(iter(_COMPILED)))
        return compiled
