"""Strict loading: a checkpoint whose tensors don't match its architecture never runs.

Each case edits a tiny saved Llama (missing, unexpected, reshaped or integer tensors, a config
that claims another architecture) and runs `specx run` resident and offloaded: one `error:` line
naming the file and the offending tensor, exit 2, no traceback. Tied embeddings (no lm_head in
the file while config.json ties them) are the one exception and must load and run.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from tests.conftest import make_model

runner = CliRunner()
OFFLOADS = ["none", "disk"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("strict") / "base", seed=3, layers=2)


def variant(base, tmp_path, edit_tensors=None, edit_config=None):
    """A copy of `base` with its state dict and/or config.json edited in place."""
    out = tmp_path / "variant"
    shutil.copytree(base, out)
    if edit_tensors is not None:
        sd = load_file(out / "model.safetensors")
        edit_tensors(sd)
        save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    if edit_config is not None:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def run(model, tmp_path, offload):
    prompt = tmp_path / "p.txt"
    prompt.write_text("def f(x):")
    return runner.invoke(
        app,
        [
            "run",
            str(prompt),
            "--target",
            str(model),
            "--method",
            "ar",
            "--device",
            "cpu",
            "--max-new-tokens",
            "3",
            "--no-live",
            "--offload",
            offload,
        ],
    )


def assert_refused(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.output)
    err = result.stderr
    assert "Traceback" not in result.output
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for needle in needles:
        assert needle in err, err
    assert result.stdout == ""  # nothing generated


def _drop(sd):
    del sd["model.layers.1.mlp.down_proj.weight"]


def _extra(sd):
    sd["model.layers.1.mlp.extra.weight"] = torch.zeros(4)


def _reshape(sd):
    sd["model.layers.0.self_attn.o_proj.weight"] = sd["model.layers.0.self_attn.o_proj.weight"][:, :32].clone()


def _intify(sd):
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int32)


def _norm_scalar(sd):
    # One element would broadcast silently on copy_; strict loading must still refuse it.
    sd["model.norm.weight"] = torch.ones(1)


CASES = {
    "missing": (_drop, ["model.safetensors", "model.layers.1.mlp.down_proj.weight", "missing"]),
    "unexpected": (_extra, ["model.safetensors", "model.layers.1.mlp.extra.weight", "unexpected"]),
    "shape": (_reshape, ["model.safetensors", "model.layers.0.self_attn.o_proj.weight", "shape"]),
    "dtype": (_intify, ["model.safetensors", "model.norm.weight", "int32"]),
    "broadcastable": (_norm_scalar, ["model.safetensors", "model.norm.weight", "shape"]),
}


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatched_checkpoint_is_refused(base, tmp_path, offload, case):
    edit, needles = CASES[case]
    assert_refused(run(variant(base, tmp_path, edit_tensors=edit), tmp_path, offload), *needles)


def test_model_type_bert_on_llama_weights_is_refused(base, tmp_path):
    """The issue's report: config.json says bert, the weights are Llama → must not run at random."""
    bad = variant(base, tmp_path, edit_config=lambda c: c.update(model_type="bert", architectures=["BertLMHeadModel"]))
    for offload in ("none", "disk"):
        assert_refused(run(bad, tmp_path, offload), "config.json", "unsupported model_type 'bert'", "supported: llama")


def test_config_far_bigger_than_weights_is_refused_before_allocating(base, tmp_path):
    """A different architecture with a huge hidden size: refused on the meta device, not allocated."""
    bad = variant(
        base,
        tmp_path,
        edit_config=lambda c: c.update(
            model_type="bert",
            architectures=["BertLMHeadModel"],
            hidden_size=1024,
            intermediate_size=4096,
            num_attention_heads=16,
            num_hidden_layers=8,
            vocab_size=30000,
        ),
    )  # ~0.5 GB: safe even if the check regressed
    assert_refused(run(bad, tmp_path, "none"), "config.json")


@pytest.mark.parametrize("offload", OFFLOADS)
def test_tied_embeddings_without_lm_head_load(base, tmp_path, offload):
    """The documented exception: lm_head absent, config ties it to embed_tokens → loads and runs."""
    tied = variant(
        base,
        tmp_path,
        edit_tensors=lambda sd: sd.pop("lm_head.weight"),
        edit_config=lambda c: c.update(tie_word_embeddings=True),
    )
    r = run(tied, tmp_path, offload)
    assert r.exit_code == 0, r.output
    assert "error" not in r.stderr and "specx:" in r.stderr  # decoded to the end


def test_untied_lm_head_missing_is_refused(base, tmp_path):
    """Without tying, an absent lm_head would be random: refused (resident and offloaded)."""
    bad = variant(base, tmp_path, edit_tensors=lambda sd: sd.pop("lm_head.weight"))
    for offload in OFFLOADS:
        assert_refused(run(bad, tmp_path, offload), "lm_head.weight", "missing")
