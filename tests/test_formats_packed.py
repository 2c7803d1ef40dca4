"""AWQ (GEMM), GPTQ (v1/v2, sym/asym, act-order) and compressed-tensors pack-quantized W4A16:
per-tensor dequantization and greedy ids through specx's offloaded model, against outside oracles.

Oracles: compressed-tensors' own compressor writes the checkpoint and its own decompressor gives
each weight; transformers loads the (symmetric) compressed checkpoint on CPU and generates. GPTQ
and AWQ have no CPU-installable tooling here (gptqmodel/autoawq need CUDA builds), so
tests/formats_util.py packs them from the formats' published descriptions and the oracle is the
fp32 weight the codes mean, run by transformers' own LlamaForCausalLM.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from offload import OffloadedCausalLM, OffloadError
from offload.formats import open_checkpoint
from tests.conftest import make_model
from tests.formats_util import write_awq, write_compressed, write_gptq

GPTQ_CASES = {
    "gptq-sym": dict(sym=True),
    "gptq-asym": dict(sym=False),
    "gptq-actorder": dict(sym=False, act_order=True),
    "gptq-v2": dict(sym=False, v2=True),
}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("fmt") / "src", seed=5, layers=3)


@pytest.fixture(scope="module")
def packed(src, tmp_path_factory):
    """name -> (checkpoint dir, {hf weight: fp32 reference})."""
    root = tmp_path_factory.mktemp("packed")
    out = {name: (root / name, write_gptq(src, root / name, **kw)) for name, kw in GPTQ_CASES.items()}
    out["awq"] = (root / "awq", write_awq(src, root / "awq"))
    return out


def _raw(ckpt, name):
    return {n: ckpt.read(n) for n in ckpt.stored_parts(name)}


@pytest.mark.parametrize("case", [*GPTQ_CASES, "awq"])
def test_dequant_equals_reference(packed, case):
    path, refs = packed[case]
    ckpt = open_checkpoint(path)
    assert ckpt.format == ("awq" if case == "awq" else "gptq")
    for name, ref in refs.items():
        w = ckpt.reader.load_weight(ckpt, name, _raw(ckpt, name), torch.device("cpu"), torch.float32)
        assert torch.equal(w, ref), name  # exact: small ints times fp16 scales
        w16 = ckpt.reader.load_weight(ckpt, name, _raw(ckpt, name), torch.device("cpu"), torch.float16)
        assert torch.equal(w16, ref.half()), name  # one rounding, as an fp16 kernel makes


def _hf_reference(src, refs):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    sd = {k: v.half().float() for k, v in hf.state_dict().items()}  # non-linear tensors are stored fp16
    sd.update(refs)
    hf.load_state_dict(sd)
    return hf.eval()


def _greedy(model, ids, n):
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([out])).logits
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids) :]


@pytest.mark.parametrize("case", ["gptq-actorder", "awq"])
@pytest.mark.parametrize("offload", ["none", "disk"])
def test_greedy_ids_equal_transformers(src, packed, case, offload):
    path, refs = packed[case]
    ids = [3, 7, 11, 5]
    want = _greedy(_hf_reference(src, refs), ids, 10)
    model = OffloadedCausalLM.from_pretrained(
        path, dtype=torch.float32, offload=offload, max_device_memory=0 if offload == "disk" else None
    )
    try:
        assert _greedy(model, ids, 10) == want
    finally:
        model.close()


@pytest.fixture(scope="module")
def compressed(src, tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    out = {}
    for name, kw in {
        "ct-group-sym": dict(),
        "ct-group-asym": dict(sym=False),
        "ct-channel": dict(strategy="channel"),
    }.items():
        write_compressed(src, root / name, **kw)
        out[name] = root / name
    return out


@pytest.mark.parametrize("case", ["ct-group-sym", "ct-group-asym", "ct-channel"])
def test_compressed_dequant_equals_library(compressed, case):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    ckpt = open_checkpoint(compressed[case])
    assert ckpt.format == "compressed-tensors"
    assert ckpt.quant["strategy"] == ("channel" if case == "ct-channel" else "group")
    for name in ckpt.packed:
        raw = _raw(ckpt, name)
        base = name[: -len(".weight")]
        shape = tuple(int(v) for v in raw[f"{base}.weight_shape"])
        q = unpack_from_int32(raw[f"{base}.weight_packed"], 4, torch.Size(shape)).float()  # the library's unpacking
        scale = raw[f"{base}.weight_scale"].float()
        zp = raw.get(f"{base}.weight_zero_point")
        z = (
            unpack_from_int32(zp, 4, torch.Size((shape[0], scale.shape[1])), packed_dim=0).float()
            if zp is not None
            else torch.zeros_like(scale)
        )
        g = shape[1] // scale.shape[1]
        want = (q - z.repeat_interleave(g, 1)) * scale.repeat_interleave(g, 1)
        got = ckpt.reader.load_weight(ckpt, name, raw, torch.device("cpu"), torch.float32)
        assert torch.equal(got, want), name


@pytest.mark.parametrize("case, offload", [("ct-group-sym", "none"), ("ct-group-sym", "disk"), ("ct-channel", "disk")])
def test_compressed_greedy_equals_transformers(compressed, case, offload):
    from transformers import AutoModelForCausalLM

    path = compressed[case]
    ids = [2, 9, 4, 4]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # transformers + compressed-tensors
    want = _greedy(hf, ids, 10)
    model = OffloadedCausalLM.from_pretrained(
        path, dtype=torch.float32, offload=offload, max_device_memory=0 if offload == "disk" else None
    )
    try:
        assert _greedy(model, ids, 10) == want
    finally:
        model.close()


def _edit_qc(path, tmp_path, **qc):
    out = tmp_path / "edited"
    shutil.copytree(path, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"].update(qc)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_gptq_8bit_refused(packed, tmp_path):
    with pytest.raises(OffloadError, match=r"config\.json: GPTQ with 8 bits is not supported"):
        open_checkpoint(_edit_qc(packed["gptq-sym"][0], tmp_path, bits=8))


def test_awq_gemv_refused(packed, tmp_path):
    with pytest.raises(OffloadError, match=r"AWQ GEMV layout is not supported; use an AWQ checkpoint in the GEMM"):
        open_checkpoint(_edit_qc(packed["awq"][0], tmp_path, version="gemv"))


def test_missing_part_refused(packed, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "cut"
    shutil.copytree(packed["awq"][0], out)
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.scales"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(OffloadError, match=r"tensor 'model.layers.1.mlp.up_proj.scales' that model_type 'llama' needs"):
        open_checkpoint(out)


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_specx_run_awq_target(src, packed, offload, tmp_path):
    """`specx run` on an AWQ target: --method ar ids == transformers' greedy ids of the weights the
    codes mean; specexec (16-bit source as draft) == ar."""
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    path, refs = packed["awq"]
    prompt = tmp_path / "p.txt"
    prompt.write_text("def area(r):\n  return 3.14 * r")
    ids = {}
    for method in ("ar", "specexec"):
        stats = tmp_path / f"{method}.json"
        r = CliRunner().invoke(
            app,
            [
                "run",
                str(prompt),
                "--target",
                str(path),
                "--draft",
                str(src),
                "--device",
                "cpu",
                "--offload",
                offload,
                "--method",
                method,
                "--budget",
                "8",
                "--max-new-tokens",
                "12",
                "--stats-json",
                str(stats),
            ],
        )
        assert r.exit_code == 0, (r.output, r.exception)
        ids[method] = json.loads(stats.read_text())["token_ids"]
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(path)(prompt.read_text())["input_ids"]
    want = _greedy(_hf_reference(src, refs), prompt_ids, 12)
    assert ids["ar"] == want[: len(ids["ar"])] and len(ids["ar"]) > 0
    assert ids["specexec"] == ids["ar"]


def test_self_draft_on_gptq_target(src, packed, tmp_path):
    """--draft self on a GPTQ target: 3-bit HQQ substitutes of its dequantized weights; specexec's
    greedy ids equal ar's (verification is exact), and 4-bit substitutes are refused in one line."""
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    pytest.importorskip("hqq")
    path, _ = packed["gptq-actorder"]
    prompt = tmp_path / "p.txt"
    prompt.write_text("def area(r):")
    ids = {}
    for method, extra in (("ar", []), ("specexec", ["--draft", "self", "--draft-bits", "3"])):
        stats = tmp_path / f"{method}.json"
        r = CliRunner().invoke(
            app,
            [
                "run",
                str(prompt),
                "--target",
                str(path),
                "--device",
                "cpu",
                "--offload",
                "disk",
                "--method",
                method,
                "--budget",
                "8",
                "--max-new-tokens",
                "10",
                "--stats-json",
                str(stats),
                *extra,
            ],
        )
        assert r.exit_code == 0, (r.output, r.exception)
        ids[method] = json.loads(stats.read_text())["token_ids"]
        if method == "specexec":
            assert json.loads(stats.read_text())["tokens_per_pass"] > 1  # the substitutes drafted
    assert ids["specexec"] == ids["ar"] and ids["ar"]
    r = CliRunner().invoke(
        app,
        [
            "run",
            str(prompt),
            "--target",
            str(path),
            "--device",
            "cpu",
            "--offload",
            "disk",
            "--method",
            "specexec",
            "--draft",
            "self",
            "--draft-bits",
            "4",
            "--max-new-tokens",
            "4",
        ],
    )
    assert r.exit_code == 2 and "already 4-bit" in r.stderr, (r.output, r.exception)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (
            lambda t: t.__setitem__(
                "model.layers.0.self_attn.q_proj.qweight", t["model.layers.0.self_attn.q_proj.qweight"].float()
            ),
            "is torch.float32, the gptq layout",
        ),
        (
            lambda t: t.__setitem__(
                "model.layers.0.mlp.up_proj.qzeros", t["model.layers.0.mlp.up_proj.qzeros"][:1].clone()
            ),
            "'model.layers.0.mlp.up_proj.qzeros' has shape [1, 16], config.json implies [2, 16]",
        ),
        (lambda t: t.__setitem__("model.layers.2.mlp.up_proj.bogus", torch.zeros(2)), "unexpected tensor"),
    ],
)
def test_corrupt_gptq_refused_in_one_line(packed, tmp_path, edit, needle):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "bad"
    shutil.copytree(packed["gptq-sym"][0], out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(OffloadError, match=re.escape(needle)) as info:
        open_checkpoint(out)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("case", ["gptq-actorder", "awq", "ct-group-sym"])
def test_compiled_dequant_equals_eager(packed, compressed, case, monkeypatch):
    """The torch.compile'd dequantization (auto on CUDA) gives the eager kernel's values bitwise, and ran."""
    from offload.formats import gguf_quants as gq

    path = compressed[case] if case.startswith("ct") else packed[case][0]
    ckpt = open_checkpoint(path)
    for name in list(ckpt.packed)[:3]:
        raw = _raw(ckpt, name)
        monkeypatch.setenv(gq.KERNEL_ENV, "eager")
        want = ckpt.reader.load_weight(ckpt, name, raw, torch.device("cpu"), torch.float16)
        monkeypatch.setenv(gq.KERNEL_ENV, "compiled")
        got = ckpt.reader.load_weight(ckpt, name, raw, torch.device("cpu"), torch.float16)
        assert gq.kernel_status() is None and torch.equal(got, want), name
