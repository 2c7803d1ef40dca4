"""`specx info` and the memory plan on real-sized AWQ / GPTQ checkpoints made of headers only.

The sparse files list every tensor Llama-3.1-70B's AWQ and GPTQ repositories hold (packed int32
qweight/qzeros, fp16 scales, GPTQ's g_idx, fp16 norms and embeddings) with holes for data:
`describe` must read them without touching tensor data, and the plan must count each layer's
stored bytes and fit a 24 GB card.
"""

from __future__ import annotations

import json
import math
import struct

import pytest

from offload.planning.memplan import PlanRequest, plan_memory
from specexec_cli.session.info import describe, rows
from tests.sparse_ckpt import FIXTURES, read_checkpoint, tensor_shapes

GB = 1024**3
SIZES = {"I32": 4, "F16": 2}


def _parts(method: str, n: int, k: int, g: int = 128) -> dict[str, tuple[str, list[int]]]:
    if method == "awq":
        return {"qweight": ("I32", [k, n // 8]), "qzeros": ("I32", [k // g, n // 8]), "scales": ("F16", [k // g, n])}
    return {
        "qweight": ("I32", [k // 8, n]),
        "qzeros": ("I32", [k // g, n // 8]),
        "scales": ("F16", [k // g, n]),
        "g_idx": ("I32", [k]),
    }


def _write(path, header: dict) -> None:
    off, meta = 0, {}
    for name, (dtype, shape) in header.items():
        nbytes = math.prod(shape) * SIZES[dtype]
        meta[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(meta).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + off)  # a hole: no data written


def write_sparse_quant(method: str, out, per_shard: int = 10):
    cfg = json.loads((FIXTURES / "llama-3.1-70b.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
        if method == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
    )
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    shards: dict[str, dict] = {}
    for name, shape in tensor_shapes(cfg).items():
        layer = int(name.split(".")[2]) // per_shard + 1 if name.startswith("model.layers.") else 0
        shard = shards.setdefault(f"model-{layer:05d}.safetensors", {})
        if name.endswith("_proj.weight"):
            base = name[: -len(".weight")]
            shard.update({f"{base}.{p}": v for p, v in _parts(method, *shape).items()})
        else:
            shard[name] = ("F16", shape)
    weight_map = {}
    for fname, header in sorted(shards.items()):
        _write(out / fname, header)
        weight_map.update({n: fname for n in header})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


@pytest.fixture(scope="module", params=["awq", "gptq"])
def sparse70(request, tmp_path_factory):
    return request.param, write_sparse_quant(request.param, tmp_path_factory.mktemp("sq") / request.param)


def _expected_layer_bytes(method: str) -> int:
    cfg = json.loads((FIXTURES / "llama-3.1-70b.json").read_text())
    shapes = {n: s for n, s in tensor_shapes(cfg).items() if n.startswith("model.layers.0.")}
    total = 0
    for name, shape in shapes.items():
        parts = _parts(method, *shape).values() if name.endswith("_proj.weight") else [("F16", shape)]
        total += sum(math.prod(s) * SIZES[d] for d, s in parts)
    return total


def test_info_describes_sparse_70b(sparse70):
    method, path = sparse70
    info = describe(str(path))
    assert info.runnable, info.reason
    assert (info.format, info.family, info.layers, info.vocab) == (method, "llama", 80, 128256)
    assert info.layer_bytes == [_expected_layer_bytes(method)] * 80
    assert info.quant["group_size"] == 128 and info.quant["bits"] == 4
    table = dict(rows(info))
    assert table["format"] == method and table["specx can run it"] == "yes"


def test_sparse_70b_plans_at_24gb(sparse70):
    method, path = sparse70
    req = PlanRequest(
        device="cuda", dtype="bf16", draft_dtype=None, ram_free=200 * GB, device_free=24 * GB, ctx=4096, budget=64
    )
    plan = plan_memory(read_checkpoint(path), None, req)
    assert plan.fits, plan.reason
    stored = _expected_layer_bytes(method)
    # every stored byte of a layer is counted (norms in the compute dtype; each tensor 256-byte aligned)
    assert all(stored <= b <= stored + 256 * 40 for b in plan.layer_bytes), (plan.layer_bytes[0], stored)
    assert sum(plan.device_bytes.values()) <= 24 * GB
    assert plan.device_bytes["staging_slots"] >= 2 * stored
    # the per-pass dequantization of the largest linear (MLP 28672 x 8192) in bf16, with its uint8 codes
    assert plan.device_bytes["activations"] >= 28672 * 8192 * (2 + 2)


def test_info_unrunnable_names_reason(tmp_path):
    path = write_sparse_quant("gptq", tmp_path / "g8")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 8
    (path / "config.json").write_text(json.dumps(cfg))
    info = describe(str(path))
    assert not info.runnable and "GPTQ with 8 bits is not supported" in info.reason
    assert dict(rows(info))["specx can run it"].startswith("no: ")


def test_specx_info_and_dry_run_cli(sparse70, tmp_path, monkeypatch):
    """Through the CLI: `specx info` prints the table, `specx run --dry-run` plans the packed 70B
    at 24 GB from headers alone (loading weights would fail the test)."""
    from typer.testing import CliRunner

    import specexec_cli.session.loading as loading
    from specexec_cli.terminal.app import app

    method, path = sparse70
    res = CliRunner().invoke(app, ["info", str(path)])
    assert res.exit_code == 0, res.output
    assert f"format            {method}" in res.stdout and "specx can run it  yes" in res.stdout

    monkeypatch.setattr(loading, "load_models", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(
        app,
        [
            "run",
            "unused.txt",
            "--target",
            str(path),
            "--device",
            "cuda",
            "--max-gpu-memory",
            "24GB",
            "--dry-run",
            "--stats-json",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    plan = json.loads(out.read_text())["plan"]
    assert plan["fits"] and plan["device_total"] <= plan["device_capacity"] == 24 * 10**9
    for comp in (
        "lm_head",
        "kv_target",
        "activations",
        "cuda_context",
        "staging_slots",
    ):  # embeddings may live on the host
        assert plan["device_bytes"][comp] > 0, comp
