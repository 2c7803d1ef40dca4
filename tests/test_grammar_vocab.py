"""Structured output on real vocabularies: padded output layers, special tokens, O(depth) masks, and
a calibration of its own.

The models are the tiny character-level JSON Llamas of tests/test_grammar.py, rebuilt here with
an output layer wider than the tokenizer (Qwen2.5 and Phi-3 pad theirs) or with special tokens
added to the tokenizer (`<|im_start|>` and a reserved token, as chat models have), and in both
cases the extra columns biased far above every real token in target AND draft, so that any mask
that lets one through is caught at once: the tokens must stay real, non-special ids, the JSON must
parse, and specexec must equal `--method ar` at T = 0 and for a seed at T = 0.7.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specexec_cli.core import calibrate, constrain
from specexec_cli.core.engine import DecodeState, sampling_key
from specexec_cli.core.grammar import GrammarSpec, compile_grammar, output_width
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.core.tree import Tree
from specexec_cli.session.loading import LoadOptions, load_models
from tests.test_grammar import JSON_CHARS, SCHEMA, SPEC, json_tokenizer, run

pytest.importorskip("xgrammar")  # the `grammar` extra

N_TOK = len(JSON_CHARS)  # 49 ids in the plain tokenizer
WIDE = 92  # output columns of the padded models: 49..63 share the last word of a 49-id mask row, 64..91 beyond it
SPECIALS = ["<|im_start|>", "<|reserved_special_token_0|>"]  # ids 49, 50 of the special-token tokenizer
BIAS = 50.0  # logit added to every extra column: far above any real token


def model(path, tok, width: int, seed: int, noise_from=None):
    """A 2-layer JSON Llama with `width` output columns and tokenizer `tok`, saved at `path`."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=width,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    lm = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in lm.parameters():
            p.mul_(3.0)
        if noise_from is not None:  # a related draft: the target plus noise
            lm.load_state_dict(LlamaForCausalLM.from_pretrained(noise_from, dtype=torch.float32).state_dict())
            for p in lm.parameters():
                p.add_(0.3 * p.std() * torch.randn_like(p))
    lm.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def biased_pair(root, tok, width: int):
    """Target and draft with every column from the plain tokenizer's size on biased by BIAS."""
    target = model(root / "target", tok, width, seed=3)
    draft = model(root / "draft", tok, width, seed=4, noise_from=target)
    m = load_models(LoadOptions(str(target), str(draft), dtype="fp32", device="cpu"))
    for lm in (m.target, m.draft):
        bias = torch.zeros(width)
        bias[N_TOK:] = BIAS
        lm.lm_head.bias = torch.nn.Parameter(bias)
    return m


@pytest.fixture(scope="module")
def padded_pair(tmp_path_factory):
    return biased_pair(tmp_path_factory.mktemp("padded"), json_tokenizer(), WIDE)


@pytest.fixture(scope="module")
def special_pair(tmp_path_factory):
    tok = json_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    assert [tok.convert_tokens_to_ids(s) for s in SPECIALS] == [N_TOK, N_TOK + 1]
    return biased_pair(tmp_path_factory.mktemp("special"), tok, N_TOK + len(SPECIALS))


def checked(m, ids, temperature: float, seed: int, n: int = 120):
    """Constrained ar and specexec ids for one seed: equal, below `N_TOK`, a complete valid JSON reply."""
    ar, ev = run(m, ids, method="ar", temperature=temperature, seed=seed, n=n)
    got, _ = run(m, ids, temperature=temperature, seed=seed, n=n)
    assert max(ar) < N_TOK and max(got) < N_TOK, (ar, got)
    assert got == ar
    assert ev[-1].finish == "stop"
    jsonschema.validate(json.loads(m.tokenizer.decode(ar, skip_special_tokens=True)), SCHEMA)
    return ar


def test_output_width_is_the_widest_head(padded_pair):
    assert output_width(padded_pair.target, padded_pair.draft) == WIDE
    assert output_width(padded_pair.target, None) == WIDE
    assert output_width(object()) is None  # a model that says nothing: the tokenizer's size is used


@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (0.7, 1), (0.7, 2)])
def test_padding_columns_never_drawn(padded_pair, temperature, seed):
    """Old masks, compiled for the 49 tokenizer ids, came back with ids 49..63 set inside a JSON
    string (xgrammar fills whole 32-bit words), so the biased padding won there."""
    checked(padded_pair, padded_pair.tokenizer("data:\n")["input_ids"], temperature, seed)


def test_padded_rows_cover_the_head_with_the_padding_off(padded_pair):
    m = padded_pair
    g = compile_grammar(m.tokenizer, SPEC, m.eos_ids, output_width(m.target, m.draft))
    assert g.vocab == WIDE and g.words == 3
    st = DecodeState(ids=[5] + [JSON_CHARS.index(c) for c in '{"id": 1, "name": "a'])  # inside a string
    run_ = constrain.GrammarRun(g, st, 1)
    ok = constrain.allowed(run_.root_bitmask(), WIDE)[0]
    assert ok[JSON_CHARS.index("b")] and not ok[N_TOK:].any()
    assert not (run_.root_bitmask()[0] & ~g.keep).any()


def test_a_refused_committed_token_is_an_error(json_pair):
    """The root used to skip a token its matcher refused and carry on out of step with the text."""
    g = compile_grammar(json_pair.tokenizer, SPEC, json_pair.eos_ids)
    st = DecodeState(ids=[5, JSON_CHARS.index("{")])
    gr = constrain.GrammarRun(g, st, 1)
    gr.root_bitmask()
    st.ids.append(JSON_CHARS.index("}"))  # {} lacks the required keys
    with pytest.raises(constrain.GrammarDesync, match="refused committed token 2 at position 2"):
        gr.root_bitmask()


@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (0.7, 1)])
def test_special_tokens_never_drawn(special_pair, monkeypatch, temperature, seed):
    """`<|im_start|>` and reserved tokens are text to xgrammar, so a JSON string allowed them (and the
    reply lost them on decoding). Neither the target's rows nor the draft's may let them through:
    every node of every draft tree is checked, n-gram chains included (the prompt holds them)."""
    from specexec_cli.core import engine

    m = special_pair
    prompt = '{"id": 1, "name": "a<|im_start|>b"}\n{"id": 2, "name": "a<|im_start|>'
    ids = m.tokenizer(prompt)["input_ids"]
    assert N_TOK in ids
    grown, nodes = engine.grow_tree, []

    def checking_grow(*args, **kw):
        tree = grown(*args, **kw)
        nodes.extend(tree.tokens[1:].tolist())
        return tree

    monkeypatch.setattr(engine, "grow_tree", checking_grow)
    checked(m, ids, temperature, seed)
    assert nodes and max(nodes) < N_TOK


def test_a_dead_end_is_an_error_not_id_0():
    """A literal only a special token spells: after "<" nothing is left (the special id is banned);
    the plain step raises instead of drawing from an all -inf row."""
    tok = json_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    g = compile_grammar(tok, GrammarSpec("json_object", prefix="<|im_start|>"), [0])
    st = DecodeState(ids=[5])
    gr = constrain.GrammarRun(g, st, 1)
    assert constrain.allowed(gr.root_bitmask(), g.vocab)[0].nonzero().flatten().tolist() == [JSON_CHARS.index("<")]
    st.ids.append(JSON_CHARS.index("<"))
    with pytest.raises(constrain.GrammarDesync, match="allows no token of this vocabulary after 1 reply tokens"):
        gr.root_bitmask()


def test_keep_row_forbids_specials_but_not_eos(special_pair):
    m = special_pair
    g = compile_grammar(m.tokenizer, SPEC, m.eos_ids, output_width(m.target, m.draft))
    ok = constrain.allowed(g.keep[None], g.vocab)[0]
    assert ok[0] and ok[1:N_TOK].all() and not ok[N_TOK:].any()  # <eos> (id 0) is special and ends the reply
    assert g.banned == frozenset({N_TOK, N_TOK + 1})


def test_masks_never_fork_the_parse_history(json_pair, monkeypatch):
    """A fork copies the whole parse history (O(reply) per node): the masks walk with rollback instead,
    and give the same ids."""
    import xgrammar

    ids = json_pair.tokenizer('{"id": 1, "name": "ab"}\ndata:\n')["input_ids"]
    ar, _ = run(json_pair, ids, method="ar", n=60)

    def no_fork(self):
        raise AssertionError("GrammarMatcher.fork called")

    monkeypatch.setattr(xgrammar.GrammarMatcher, "fork", no_fork)
    assert run(json_pair, ids, budget=64, n=60)[0] == ar
    for lanes, batch_min in ((1, 10**9), (3, 1)):  # one walker in this thread; three on the batch's threads
        monkeypatch.setattr(constrain, "LANES", lanes)
        monkeypatch.setattr(constrain, "BATCH_MIN", batch_min)
        got, _ = run(json_pair, ids, budget=64, n=60)
        assert got == ar, lanes


def test_walked_rows_equal_fresh_matchers_on_a_deep_tree(json_pair):
    """Rows of a tree whose branches diverge at every depth (rollbacks of every length), one walker
    and three lanes, equal a fresh matcher per node; nodes below a refused token are dead."""
    import xgrammar

    g = compile_grammar(json_pair.tokenizer, SPEC, json_pair.eos_ids)
    text = [JSON_CHARS.index(c) for c in '{"id": 12, "name": "ab", "tags": []}']
    st = DecodeState(ids=[5])
    tree = Tree.new(5)
    spine, paths = 0, {0: []}
    for _depth, t in enumerate(text):
        for alt in {t, JSON_CHARS.index("x"), JSON_CHARS.index("7")}:  # the text, and two branches each
            (node,) = tree.add(torch.tensor([spine]), torch.tensor([alt]), torch.zeros(1)).tolist()
            paths[node] = paths[spine] + [alt]
            if alt == t:
                nxt = node
        spine = nxt
    nodes = list(range(tree.size))[::-1]
    for lanes, batch_min in ((1, 10**9), (3, 1)):
        gr = constrain.GrammarRun(g, st, 1)
        gr.begin(tree)
        old = constrain.LANES, constrain.BATCH_MIN
        constrain.LANES, constrain.BATCH_MIN = lanes, batch_min
        try:
            rows = gr.bitmask(nodes)
        finally:
            constrain.LANES, constrain.BATCH_MIN = old
        for i, node in enumerate(nodes):
            m = xgrammar.GrammarMatcher(g.compiled)
            want = torch.zeros(g.words, dtype=torch.int32)
            if all(m.accept_token(t) for t in paths[node]) and not m.is_terminated():
                m.fill_next_token_bitmask(want[None])
            assert torch.equal(rows[i], want & g.keep), (lanes, node, paths[node])


def test_constrained_passes_keep_their_own_calibration(json_pair):
    """Grammar-forced acceptances used to feed the shared calibration, moving every later free-text
    request's trees; they now train a calibration of their own."""
    m = json_pair
    key = sampling_key(SamplingParams())
    free = calibrate.for_pair(m.target, m.draft, key)
    before = free.tests.clone()
    run(m, m.tokenizer("data:\n")["input_ids"], budget=64, n=40)
    assert torch.equal(free.tests, before)
    assert calibrate.for_pair(m.target, m.draft, key, constrained=True).tests.sum() > 0
    run(m, m.tokenizer("data:\n")["input_ids"], budget=64, n=20, spec=None)  # free text still learns
    assert free.tests.sum() > before.sum()


def test_host_allowed_never_reads_past_the_rows():
    """Fewer allowed tokens than the draft's top-k: top-k returns -inf columns, possibly past the
    rows' 32 W ids; they are refused, not gathered out of bounds."""
    bits = torch.tensor([[0b1010], [-1]], dtype=torch.int32)  # (2, 1): ids 1 and 3; ids 0..31
    tokens = torch.tensor([[1, 2, 40], [31, 32, -1]])
    assert constrain.host_allowed(bits, tokens).tolist() == [[True, False, False], [True, False, False]]


@pytest.fixture(scope="module")
def json_pair(tmp_path_factory):
    return biased_pair(tmp_path_factory.mktemp("plain"), json_tokenizer(), N_TOK)
