"""docs/formats.md's GGUF self-draft claim: a streamed GGUF target drafts with its own 3-bit HQQ
substitutes (`--draft self`, a candidate `--draft auto` weighs), and at T = 0 each prints exactly what
`--method ar` prints (a tiny Q8_0 file from tests/gguf_build.py). A GGUF target with a safetensors
draft is tests/test_gguf_llamacpp.py (llama.cpp's converter keeps the draft's tokenizer)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from tests.conftest import make_model

pytest.importorskip("gguf")
pytest.importorskip("hqq")


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    from tests.gguf_build import write_gguf

    root = tmp_path_factory.mktemp("gguf_self")
    return write_gguf(make_model(root / "hf", seed=1, layers=3), root / "m.gguf", "Q8_0")


def run(target, *extra):
    args = [
        "run",
        "-p",
        "the cat sat on",
        "--target",
        str(target),
        "--offload",
        "disk",
        "--device",
        "cpu",
        "-n",
        "24",
        "--temperature",
        "0",
        "--no-live",
        "--no-chat-template",
        "--budget",
        "16",
        *map(str, extra),
    ]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    return r


@pytest.mark.slow
def test_gguf_target_self_drafts_losslessly(gguf_pair):
    target = gguf_pair
    ar = run(target, "--method", "ar").stdout
    assert ar.strip()
    auto = run(target)
    notice = next(ln for ln in auto.stderr.splitlines() if ln.startswith("--draft auto:"))
    assert "self-draft at 3 bits" in notice and auto.stdout == ar  # a candidate, picked or not
    assert run(target, "--draft", "self", "--draft-bits", "3").stdout == ar
