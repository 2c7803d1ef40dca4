"""`--draft self --draft-bits 3|2`: HQQ substitutes (offload/quant/lowbit.py) and the plan's choice of bits.

What must hold: lossless at T = 0 through `specx run` (ids equal `--method ar`'s) for 3 and 2 bits
and for an nf4 target (whose 4-bit substitutes would be itself, so the plan picks 3 or 2 bits);
a dequantized substitute is close to its weight, closer with more bits; the device bytes the
loader allocates for the substitutes are the bytes the memory plan counts; the HQQ cache is
reused, extended to new layers, rebuilt when the target changes and when a shard is corrupt (with
a notice); bad flags and a missing HQQ are one-line errors naming the fix.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

import offload.quant.lowbit as lowbit
from offload import OffloadedCausalLM
from offload.errors import OffloadError, OffloadNotice
from offload.planning.memplan import PlanRequest, plan_memory
from offload.selfdraft.build import build_self_draft
from specexec_cli.terminal.app import app
from tests.conftest import make_model
from tests.sparse_ckpt import read_checkpoint
from tests.test_selfdraft import shares_with

pytest.importorskip("hqq", reason="the lowbit extra (HQQ) is not installed")
runner = CliRunner()
PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("lowbit") / "t", seed=23, layers=4, hidden=64)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def run(tmp_path, target, *extra, code=0):
    prompt, stats = tmp_path / "p.txt", tmp_path / f"s{len(list(tmp_path.iterdir()))}.json"
    prompt.write_text(PROMPT)
    res = runner.invoke(
        app,
        [
            "run",
            str(prompt),
            "--target",
            str(target),
            "--device",
            "cpu",
            "--no-live",
            "--no-chat-template",
            "--temperature",
            "0",
            "--max-new-tokens",
            "24",
            "--budget",
            "16",
            "--offload",
            "disk",
            "--max-ram",
            "0",
            "--stats-json",
            str(stats),
            *extra,
        ],
    )
    assert res.exit_code == code, res.output
    return (json.loads(stats.read_text()) if code == 0 else None), res


@pytest.mark.parametrize("bits", ["3", "2"])
def test_hqq_self_draft_is_lossless_at_t0(tmp_path, target, bits):
    ar, _ = run(tmp_path, target, "--method", "ar")
    sd, _ = run(tmp_path, target, "--draft", "self", "--draft-bits", bits)
    assert sd["token_ids"] == ar["token_ids"]
    assert sd["target_passes"] < len(ar["token_ids"])  # the substitutes' proposals were accepted


def test_nf4_target_gets_low_bit_substitutes(tmp_path, target):
    ar, _ = run(tmp_path, target, "--method", "ar", "--dtype", "nf4")
    sd, _res = run(tmp_path, target, "--draft", "self", "--dtype", "nf4")
    assert sd["token_ids"] == ar["token_ids"]
    _, refused = run(tmp_path, target, "--draft", "self", "--dtype", "nf4", "--draft-bits", "4", code=2)
    err = refused.stderr.strip()
    assert len(err.splitlines()) == 1 and "already 4-bit" in err and "--draft-bits 3 or 2" in err


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_dequantized_weight_is_close_and_sized_as_planned(bits):
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(bits)) * 0.05
    q = lowbit.quantize_weight(w, bits)
    lin = lowbit.LowbitLinear(q["W_q"], q["scale"], q["zero"], None, tuple(w.shape), bits)
    err = ((lin.weight_now() - w).norm() / w.norm()).item()
    assert err < {4: 0.12, 3: 0.25, 2: 0.5}[bits]
    assert sum(t.numel() * t.element_size() for t in q.values()) == lowbit.lowbit_weight_bytes(w.shape, bits, 4)
    x = torch.randn(3, 256)
    assert torch.allclose(lin(x), x @ lin.weight_now().T, atol=1e-5)


def test_errors_shrink_with_more_bits():
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    errs = [
        (
            lowbit.LowbitLinear(
                *(lambda q: (q["W_q"], q["scale"], q["zero"]))(lowbit.quantize_weight(w, b)), None, tuple(w.shape), b
            ).weight_now()
            - w
        )
        .norm()
        .item()
        for b in (2, 3, 4)
    ]
    assert errs[0] > errs[1] > errs[2]


@pytest.mark.parametrize("bits", [3, 2])
def test_loader_allocates_what_the_plan_counts(target, bits):
    t = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk", max_host_memory=0)
    d = build_self_draft(t, bits=bits)
    try:
        assert shares_with(d, t) and d.substituted == [0, 1, 2, 3] and d.substitute_bits == bits
        req = PlanRequest(
            device="cpu",
            dtype="fp32",
            draft_dtype="fp32",
            ram_free=8 << 30,
            offload="disk",
            max_ram=0,
            self_draft=True,
            draft_bits=bits,
            ctx=256,
            budget=16,
        )
        plan = plan_memory(read_checkpoint(target), None, req)
        assert plan.substitute_bits == bits and plan.device_bytes["draft"] == d.pool.allocated
        assert any(f"{bits}-bit substitutes" in n for n in plan.notes)
    finally:
        d.close()
        t.close()


def test_hqq_cache_is_reused_extended_rebuilt_on_change_and_on_corruption(target, tmp_path, monkeypatch):
    src = tmp_path / "t"
    src.mkdir()
    for f in target.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    built = []
    real = lowbit._write_shard
    monkeypatch.setattr(lowbit, "_write_shard", lambda *a: (built.append(a[1]), real(*a))[1])
    lowbit.ensure_lowbit_layers(src, [0, 1], 3)
    out = lowbit.ensure_lowbit_layers(src, [0, 1, 2], 3)
    assert built == [0, 1, 2]  # reused, and only the new layer quantized
    shard = next(src.glob("*.safetensors"))
    os.utime(shard, (shard.stat().st_atime, shard.stat().st_mtime + 10))
    new = lowbit.ensure_lowbit_layers(src, [0], 3)
    assert new != out and not out.exists() and built == [0, 1, 2, 0]  # changed target: new cache, old removed
    layer = lowbit.shard_path(new, 0)
    layer.write_bytes(b"\xff" * layer.stat().st_size)
    with pytest.warns(OffloadNotice, match="corrupt"):
        lowbit.ensure_lowbit_layers(src, [0], 3)
    assert built == [0, 1, 2, 0, 0]


def test_bad_flags_and_missing_hqq_are_one_line_errors(tmp_path, target, monkeypatch):
    _, res = run(tmp_path, target, "--method", "ar", "--draft-bits", "3", code=2)
    assert "--draft-bits applies to --draft self" in res.stderr
    _, res = run(tmp_path, target, "--draft", "self", "--draft-bits", "5", code=2)
    assert "--draft-bits must be auto, 4, 3 or 2" in res.stderr
    monkeypatch.setitem(__import__("sys").modules, "hqq.core.quantize", None)  # import fails
    lowbit.hqq_quantizer.cache_clear()
    with pytest.raises(OffloadError, match=r"pip install 'hqq>=0\.2\.8,<0\.3'"):
        lowbit.hqq_quantizer()


def test_a_prequantized_checkpoint_is_refused_in_one_line(tmp_path, target):
    from offload.quant.quant_cache import write_quantized

    write_quantized(target, tmp_path / "q")
    _, res = run(tmp_path, tmp_path / "q", "--draft", "self", code=2)
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "pre-quantized" in err and "fix:" in err


def test_nf4_target_plan_counts_the_substitutes_it_loads(target):
    """An nf4 target computes in fp32 on CPU, so its substitutes' scales do too: planned == loaded."""
    from dataclasses import replace

    from specexec_cli.core.draft import TreeShape
    from specexec_cli.session.loading import LoadOptions, load_models
    from specexec_cli.session.planning import make_plan

    opts = LoadOptions(str(target), "self", dtype="nf4", device="cpu", offload="disk", max_ram=0, ctx=256, draft_bits=3)
    plan = make_plan(opts, TreeShape(16, 8), budget_auto=False)
    models = load_models(replace(opts, plan=plan))
    try:
        counted = models.draft.pool.by_component
        assert plan.substitute_bits == 3 and plan.device_bytes["draft"] == counted["draft"] > 0
        assert plan.device_bytes.get("dequantized_draft", 0) == counted.get("dequantized_draft", 0)
    finally:
        models.draft.close()
        models.target.close()
