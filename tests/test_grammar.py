"""Structured output inside the speculative step: constrained specexec is exactly constrained decoding.

The models are tiny seeded Llamas whose character-level tokenizer can spell JSON (`JSON_CHARS`).
The reference is written here, independently of specx's decoding code: plain greedy decoding with
transformers' own forward over the whole sequence each step and xgrammar's own matcher
(`reference_greedy`). `--method ar` with a grammar must equal it, and specexec (tree budgets 1..128,
a related draft) must equal `ar` token for token at T = 0 and, with the coupled draws, at T > 0 too.
Outputs parse and validate against the schema; the reply ends ("stop") when the grammar is complete.
The distribution at T > 0 is tested with power in tests/test_grammar_distribution.py.
"""

from __future__ import annotations

import json
import sys

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.grammar import GrammarError, GrammarSpec, compile_grammar
from specexec_cli.core.methods import generate
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.session.loading import LoadOptions, load_models

JSON_CHARS = (
    ["<eos>"] + list('{}[]",: ') + list("abcdefghijklmnopqrstuvwxyz") + list("0123456789") + ["\n", "<", ">", "/"]
)
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["id", "name", "tags"],
    "additionalProperties": False,
}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
TOOL = GrammarSpec("json_schema", json.dumps(SCHEMA), prefix="<call>\n", suffix="\n</call>")


def json_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, byte-level (GPT-2's byte alphabet: " " is "Ġ", "\n" is "Ċ"), so
    llguidance can read every token's bytes."""
    byte_char = {" ": "\u0120", "\n": "\u010a"}
    vocab = {byte_char.get(c, c): i for i, c in enumerate(JSON_CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def json_model(path, seed: int, layers: int, noise_from=None, noise: float = 0.0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(JSON_CHARS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
        if noise_from is not None:
            model.load_state_dict(LlamaForCausalLM.from_pretrained(noise_from, dtype=torch.float32).state_dict())
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    json_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def json_pair(tmp_path_factory):
    pytest.importorskip("xgrammar")  # the `grammar` extra
    root = tmp_path_factory.mktemp("json-models")
    target = json_model(root / "target", seed=3, layers=2)
    draft = json_model(root / "draft", seed=4, layers=2, noise_from=target, noise=0.3)
    return load_models(LoadOptions(str(target), str(draft), dtype="fp32", device="cpu"))


def run(m, ids, method="specexec", budget=64, temperature=0.0, spec=SPEC, n=80, **kw):
    cfg = GenerationConfig(
        method=method,
        shape=TreeShape(budget, 32),
        max_new_tokens=n,
        grammar=spec,
        sampling=SamplingParams(temperature=temperature),
        **kw,
    )
    events = list(generate(m, DecodeState(), ids, cfg))
    return [t for ev in events for t in ev.tokens], events


def reference_greedy(m, ids: list[int], spec: GrammarSpec, n: int) -> list[int]:
    """Constrained greedy decoding without specx's decoding code: transformers' forward over the
    whole sequence, xgrammar's own matcher and mask, argmax; stops after EOS or where the grammar
    allows nothing but EOS."""
    import xgrammar

    g = compile_grammar(m.tokenizer, spec)
    matcher = xgrammar.GrammarMatcher(g.compiled)
    bits = xgrammar.allocate_token_bitmask(1, g.vocab)
    seq, out = list(ids), []
    for _ in range(n):
        with torch.no_grad():
            logits = m.target(torch.tensor([seq])).logits[0, -1]
        matcher.fill_next_token_bitmask(bits)
        ok = torch.tensor([bool(int(bits[0, i // 32]) >> (i % 32) & 1) for i in range(logits.shape[0])])
        tok = int(logits.masked_fill(~ok, float("-inf")).argmax())
        out.append(tok)
        seq.append(tok)
        assert matcher.accept_token(tok)
        matcher.fill_next_token_bitmask(bits)
        only_eos = [i for i in range(g.vocab) if int(bits[0, i // 32]) >> (i % 32) & 1] == list(m.eos_ids)
        if tok in m.eos_ids or only_eos:
            break
    return out


PROMPTS = ["data:\n", "abc"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ar_equals_reference_and_specexec_equals_ar(json_pair, prompt):
    m = json_pair
    ids = m.tokenizer(prompt)["input_ids"]
    ref = reference_greedy(m, ids, SPEC, 80)
    ar, ar_events = run(m, ids, method="ar")
    assert ar == ref
    for budget in (1, 16, 128):
        got, events = run(m, ids, budget=budget)
        assert got == ar, budget
        assert events[-1].finish == ar_events[-1].finish
    text = m.tokenizer.decode(ar, skip_special_tokens=True)
    if ar_events[-1].finish == "stop":
        jsonschema.validate(json.loads(text), SCHEMA)


def test_prefix_suffix_and_stop(json_pair):
    m = json_pair
    ids = m.tokenizer("call:")["input_ids"]
    got, events = run(m, ids, spec=TOOL, n=200)
    text = m.tokenizer.decode(got, skip_special_tokens=True)
    assert events[-1].finish == "stop", text
    assert text.startswith("<call>\n") and text.endswith("\n</call>")
    jsonschema.validate(json.loads(text[len("<call>\n") : -len("\n</call>")]), SCHEMA)
    assert 0 not in got  # the grammar stops after the suffix: no EOS needed
    ar, _ = run(m, ids, method="ar", spec=TOOL, n=200)
    assert got == ar


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_sampled_specexec_equals_sampled_ar(json_pair, temperature):
    """The coupled draws make the emitted tokens a function of (seed, position, masked distribution):
    at T > 0 constrained specexec and constrained ar give the same ids for the same seed."""
    m = json_pair
    ids = m.tokenizer("data:\n")["input_ids"]
    for seed in range(3):
        ar, ev = run(m, ids, method="ar", temperature=temperature, seed=seed, n=60)
        got, _ = run(m, ids, temperature=temperature, seed=seed, n=60)
        assert got == ar
        if ev[-1].finish == "stop":
            jsonschema.validate(json.loads(m.tokenizer.decode(ar, skip_special_tokens=True)), SCHEMA)


def test_json_object_from_unconstrained_prompt(json_pair):
    m = json_pair
    ids = m.tokenizer("abc")["input_ids"]
    got, events = run(m, ids, spec=GrammarSpec("json_object"), n=120)
    text = m.tokenizer.decode(got, skip_special_tokens=True)
    assert text.startswith("{")
    if events[-1].finish == "stop":
        assert isinstance(json.loads(text), dict)


def test_eos_only_where_the_grammar_accepts(json_pair):
    """A target that wants EOS at once cannot end the reply before the JSON is complete."""
    m = json_pair
    ids = m.tokenizer("data:\n")["input_ids"]
    bias = torch.zeros(len(JSON_CHARS))
    bias[0] = 50.0  # EOS first by a mile, whatever the context
    head = m.target.lm_head
    old = head.bias
    head.bias = torch.nn.Parameter(bias)
    try:
        got, events = run(m, ids, spec=GrammarSpec("json_schema", json.dumps({"type": "array", "maxItems": 0})))
    finally:
        head.bias = old
    assert m.tokenizer.decode(got, skip_special_tokens=True) == "[]"
    assert events[-1].finish == "stop"


@pytest.mark.parametrize(
    "spec, needle",
    [
        (GrammarSpec("xml"), "kind must be one of"),
        (GrammarSpec("json_schema", "{"), "not valid JSON"),
        (GrammarSpec("json_schema", '{"type": "foo"}'), "invalid JSON schema"),
        (GrammarSpec("json_schema", "[1]"), "must be a JSON object"),
        (GrammarSpec("json_schema", None), "needs a schema"),
    ],
)
def test_bad_grammars_are_one_line_errors(json_pair, spec, needle):
    with pytest.raises(GrammarError) as exc:
        compile_grammar(json_pair.tokenizer, spec)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_missing_grammar_extra_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if not installed
    with pytest.raises(GrammarError, match=r"needs the xgrammar package: pip install .*\[grammar\]"):
        compile_grammar(json_tokenizer(), SPEC)  # a new tokenizer object: nothing cached for it


def test_compile_is_cached_per_tokenizer_and_spec(json_pair):
    a = compile_grammar(json_pair.tokenizer, SPEC)
    assert compile_grammar(json_pair.tokenizer, GrammarSpec("json_schema", json.dumps(SCHEMA))) is a
    assert compile_grammar(json_pair.tokenizer, TOOL) is not a


def test_other_methods_refuse_a_grammar(json_pair):
    ids = json_pair.tokenizer("abc")["input_ids"]
    with pytest.raises(GrammarError, match="--method specexec or ar"):
        run(json_pair, ids, method="chain")


def test_shared_pair_constrained_specexec_equals_ar(shared_pair):
    pytest.importorskip("xgrammar")
    target, draft = shared_pair
    m = load_models(LoadOptions(str(target), str(draft), dtype="fp32", device="cpu"))
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "size": {"type": "integer"},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "size", "ok"],
        "additionalProperties": False,
    }
    spec = GrammarSpec("json_schema", json.dumps(schema))
    ids = m.tokenizer("def config():\n    return ")["input_ids"]
    ar, ar_events = run(m, ids, method="ar", spec=spec, n=64)
    got, events = run(m, ids, budget=128, spec=spec, n=64)
    assert got == ar
    assert events[-1].finish == ar_events[-1].finish == "stop"
    jsonschema.validate(json.loads(m.tokenizer.decode(got, skip_special_tokens=True)), schema)
    assert len(got) / (len(events) - 1) > 1.5  # well over one token per target pass


def test_every_draft_node_is_grammar_valid(json_pair, monkeypatch):
    """The draft grows only grammar-valid branches: each node's path, after the committed reply, is
    accepted token by token by a fresh xgrammar matcher (n-gram chains included)."""
    import xgrammar

    from specexec_cli.core import engine

    m = json_pair
    ids = m.tokenizer('{"id": 1, "name": "ab"}\ndata:\n')["input_ids"]  # n-gram matches to propose
    g = compile_grammar(m.tokenizer, SPEC, m.eos_ids)
    grown, checked = engine.grow_tree, []

    def checking_grow(*args, grammar=None, **kw):
        tree = grown(*args, grammar=grammar, **kw)
        reply = grammar.state.ids[len(ids) :]
        for node in range(1, tree.size):
            path = []
            while node > 0:
                path.append(int(tree.tokens[node]))
                node = int(tree.parents[node])
            matcher = xgrammar.GrammarMatcher(g.compiled)
            assert all(matcher.accept_token(t) for t in reply + path[::-1]), path[::-1]
            checked.append(1)
        return tree

    monkeypatch.setattr(engine, "grow_tree", checking_grow)
    got, _ = run(m, ids, budget=64, n=40)
    assert len(checked) > 100
    monkeypatch.undo()
    assert got == run(m, ids, method="ar", n=40)[0]


def test_batched_mask_rows_equal_one_matcher_each(json_pair):
    """Rows filled by the batch matcher (>= BATCH_MIN nodes) and one by one agree with a fresh
    matcher per node; refused tokens give all-zero rows."""
    import xgrammar

    from specexec_cli.core import constrain
    from specexec_cli.core.engine import DecodeState
    from specexec_cli.core.tree import Tree

    g = compile_grammar(json_pair.tokenizer, SPEC, json_pair.eos_ids)
    st = DecodeState(ids=[5, 6, 1])  # the reply so far: "{" (id 1)
    tree = Tree.new(1)
    kids = tree.add(
        torch.zeros(len(JSON_CHARS), dtype=torch.long), torch.arange(len(JSON_CHARS)), torch.zeros(len(JSON_CHARS))
    )
    below = [JSON_CHARS.index(c) for c in "intab"]  # below '"' (id 5): key starts, valid and not
    tree.add(kids[5:6].repeat(len(below)), torch.tensor(below), torch.zeros(len(below)))
    nodes = list(range(1, tree.size))
    for batch_min in (1000, 1):
        run = constrain.GrammarRun(g, st, 2)
        run.begin(tree)
        old, constrain.BATCH_MIN = constrain.BATCH_MIN, batch_min
        try:
            rows = run.bitmask(nodes)
        finally:
            constrain.BATCH_MIN = old
        for i, node in enumerate(nodes):
            path = [int(tree.tokens[node])] if int(tree.parents[node]) == 0 else [5, int(tree.tokens[node])]
            m = xgrammar.GrammarMatcher(g.compiled)
            want = torch.zeros(g.words, dtype=torch.int32)
            if all(m.accept_token(t) for t in [1] + path):
                m.fill_next_token_bitmask(want[None])
            assert torch.equal(rows[i], want), (node, path)
