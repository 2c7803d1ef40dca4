"""The one Checkpoint object: what `open_checkpoint` reports, that a `specx run` opens (and reads
the headers of) each checkpoint once, and that packed tensors reach their kernels 256-byte aligned
in every tier."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from offload import OffloadedCausalLM, OffloadError
from offload.formats import open_checkpoint
from offload.formats.qlinear import PackedLinear
from tests.conftest import make_model
from tests.formats_util import write_gptq
from tests.probes import after_each_layer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    target = make_model(root / "t", seed=11, layers=3)
    draft = make_model(root / "d", seed=12, layers=3, noise_from=target, noise=0.2)
    (target / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    return target, draft


def test_fields_of_a_16bit_checkpoint(models):
    ck = open_checkpoint(models[0])
    assert ck.format == "fp32" and ck.quant is None and not ck.packed and not ck.quantized
    assert ck.num_layers == 3 and ck.hf_config.model_type == "llama" and ck.config["num_hidden_layers"] == 3
    assert ck.generation["temperature"] == 0.6 and ck.tokenizer_path == models[0]
    assert set(ck.layer_tensors(1)) == {n for n in ck.tensors if n.startswith("model.layers.1.")}
    assert ck.layer_bytes(1) == sum(t.nbytes for t in ck.layer_tensors(1).values()) > 0
    assert ck.shapes["model.layers.0.mlp.up_proj.weight"] == (128, 64)
    assert torch.equal(ck.read("model.norm.weight"), ck.read("model.norm.weight"))
    assert ck.load_tokenizer()("ab")["input_ids"]


def test_fields_of_a_gptq_checkpoint(models, tmp_path):
    write_gptq(models[0], tmp_path / "g", sym=False, act_order=True)
    ck = open_checkpoint(tmp_path / "g")
    assert ck.format == "gptq" and ck.quantized and ck.quant["desc_act"] and not ck.quant["sym"]
    assert ck.packed["model.layers.0.self_attn.q_proj.weight"] == tuple(
        f"model.layers.0.self_attn.q_proj.{p}" for p in ("qweight", "qzeros", "scales", "g_idx")
    )
    assert ck.logical_shape("model.layers.0.mlp.down_proj.weight") == (64, 128)


def test_unclaimed_path_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(OffloadError, match=r"no \*\.safetensors or \.gguf weights found"):
        open_checkpoint(tmp_path)
    with pytest.raises(OffloadError, match="no such file or directory"):
        open_checkpoint(tmp_path / "nope")


def test_specx_run_opens_each_checkpoint_once(models, tmp_path, monkeypatch):
    from offload.formats import safetensors as st_reader
    from offload.formats import st_index
    from specexec_cli.terminal.app import app

    opened, headers = [], []
    real_open, real_init = st_reader.SafetensorsReader.open, st_index.SafetensorsIndex.__init__
    monkeypatch.setattr(st_reader.SafetensorsReader, "open", lambda self, p: opened.append(p) or real_open(self, p))
    monkeypatch.setattr(st_index.SafetensorsIndex, "__init__", lambda self, p: headers.append(p) or real_init(self, p))
    prompt = tmp_path / "p.txt"
    prompt.write_text("ab")
    r = CliRunner().invoke(
        app,
        [
            "run",
            str(prompt),
            "--target",
            str(models[0]),
            "--draft",
            str(models[1]),
            "--device",
            "cpu",
            "--offload",
            "disk",
            "--method",
            "specexec",
            "--budget",
            "4",
            "--max-new-tokens",
            "4",
            "--no-live",
        ],
    )
    assert r.exit_code == 0, (r.output, r.exception)
    assert sorted(map(str, opened)) == sorted(map(str, models)), opened  # plan, loader, checks: one open each
    assert sorted(map(str, headers)) == sorted(map(str, models)), headers


@pytest.mark.parametrize("offload", ["none", "ram", "disk"])
def test_packed_tensors_are_256_byte_aligned(models, tmp_path, offload):
    write_gptq(models[0], tmp_path / "g", sym=True)
    model = OffloadedCausalLM.from_pretrained(
        tmp_path / "g", dtype=torch.float32, offload=offload, max_device_memory=0 if offload != "none" else None
    )
    seen = []

    def check(layer):
        for mod in model.layers[layer].modules():
            if isinstance(mod, PackedLinear):
                for attr in mod.parts:
                    seen.append(getattr(mod, attr).data_ptr() % 256)

    after_each_layer(model, check)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]))
    finally:
        model.close()
    assert seen and set(seen) == {0}
