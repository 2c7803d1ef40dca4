"""`specx quantize` and mixed precision across the pair (--draft-dtype), through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from tests.conftest import make_tokenizer
from tests.test_families import make_family

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def pair16(tmp_path_factory):
    """bf16 target and draft of one family (Qwen3, in_features multiples of 64) with a tokenizer."""
    root = tmp_path_factory.mktemp("pair16")
    target = make_family("qwen3", root / "target", seed=21, dtype=torch.bfloat16, intermediate_size=128)
    draft = make_family("qwen3", root / "draft", seed=22, dtype=torch.bfloat16, intermediate_size=128)
    for path in (target, draft):
        make_tokenizer().save_pretrained(path)
    prompt = root / "p.txt"
    prompt.write_text("def area(r):\n  return 3.14 * r")
    return target, draft, prompt


def _run(tmp_path, name, *args):
    stats = tmp_path / f"{name}.json"
    r = CliRunner().invoke(
        app,
        [
            "run",
            *map(str, args),
            "--device",
            "cpu",
            "--max-new-tokens",
            "16",
            "--budget",
            "8",
            "--stats-json",
            str(stats),
        ],
    )
    assert r.exit_code == 0, r.output
    return json.loads(stats.read_text())["token_ids"]


def test_quantize_writes_a_checkpoint_specx_and_transformers_load(pair16, tmp_path):
    target, _draft, prompt = pair16
    out = tmp_path / "q4"
    r = CliRunner().invoke(app, ["quantize", "--target", str(target), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "use --target" in r.stderr
    assert (out / "tokenizer.json").exists() and (out / "specx-manifest.json").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["load_in_4bit"] and cfg["model_type"] == "qwen3"
    # the written checkpoint runs as a target, and equals --dtype nf4 on the 16-bit source (same bytes)
    pre = _run(tmp_path, "pre", prompt, "--target", out, "--method", "ar", "--offload", "disk")
    cached = _run(
        tmp_path, "cache", prompt, "--target", target, "--method", "ar", "--dtype", "nf4", "--offload", "disk"
    )
    assert pre == cached and len(pre) > 4
    # transformers loads it as a 4-bit model
    from bitsandbytes.nn import Linear4bit
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    assert isinstance(hf.model.layers[1].self_attn.o_proj, Linear4bit)
    again = CliRunner().invoke(app, ["quantize", "--target", str(target), "--out", str(out)])
    assert again.exit_code == 2 and "already exists" in again.stderr and "Traceback" not in again.output


def test_quantize_refuses_a_4bit_source(pair16, tmp_path):
    target, _, _ = pair16
    CliRunner().invoke(app, ["quantize", "--target", str(target), "--out", str(tmp_path / "a")])
    r = CliRunner().invoke(app, ["quantize", "--target", str(tmp_path / "a"), "--out", str(tmp_path / "b")])
    assert r.exit_code == 2 and "already quantized" in r.stderr


@pytest.mark.parametrize("dtype,draft_dtype,want", [("nf4", "bf16", torch.bfloat16), ("bf16", "fp16", torch.float16)])
def test_mixed_precision_pair_is_lossless(pair16, tmp_path, dtype, draft_dtype, want):
    """bf16 draft + nf4 target, fp16 draft + bf16 target: specexec == ar, and the draft has its own dtype."""
    from specexec_cli.session.loading import LoadOptions, load_models

    target, draft, prompt = pair16
    models = load_models(
        LoadOptions(
            target=str(target), draft=str(draft), dtype=dtype, draft_dtype=draft_dtype, device="cpu", offload="disk"
        )
    )
    assert models.draft.dtype == want
    flags = ["--target", target, "--draft", draft, "--dtype", dtype, "--draft-dtype", draft_dtype, "--offload", "disk"]
    ar = _run(tmp_path, "ar", prompt, *flags, "--method", "ar")
    spec = _run(tmp_path, "spec", prompt, *flags, "--method", "specexec")
    assert spec == ar and len(ar) > 4


def test_bad_draft_dtype_is_one_line(pair16):
    target, draft, prompt = pair16
    r = CliRunner().invoke(
        app,
        [
            "run",
            str(prompt),
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--device",
            "cpu",
            "--draft-dtype",
            "int8",
        ],
    )
    assert r.exit_code == 2 and "--draft-dtype must be one of" in r.stderr and "Traceback" not in r.output
