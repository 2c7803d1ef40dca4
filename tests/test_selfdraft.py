"""`--draft self`: the target's 4-bit substitutes as its draft (offload/selfdraft/build.py).

What must hold: lossless at T = 0 through `specx run` (ids equal `--method ar`'s) with the target
in RAM or on disk, fp32 or bf16; the embeddings, norm, lm_head, rotary buffers and resident layers
are the target's own objects (no second copy: the draft's own device bytes are its substitutes
only); nothing to substitute (all resident) drafts with the layer-skip draft instead
(tests/test_selfdraft_skip.py); 4-bit substitutes
of a 4-bit target are refused in one line (tests/test_selfdraft_lowbit.py: its 3/2-bit ones);
the substitutes' cache is built once, reused, rebuilt when the target's files change, and a
corrupt cache is rebuilt with a notice, never used.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

import offload.quant.quant_cache as qc
from offload import OffloadedCausalLM
from offload.errors import OffloadNotice
from offload.quant.nf4 import packing_for
from offload.selfdraft.build import build_self_draft
from specexec_cli.terminal.app import app
from tests.conftest import make_model

runner = CliRunner()


def shares_with(draft, target) -> bool:
    """(test helper) True when every module the draft should borrow is the target's own object."""
    same = [
        draft.embed_tokens is target.embed_tokens,
        draft.norm is target.norm,
        draft.lm_head is target.lm_head
        or getattr(draft.lm_head, "packed", None) is getattr(target.lm_head, "packed", 0),
        draft.rotary_emb is target.rotary_emb,
    ]
    same += [draft.layers[i] is target.layers[i] for i in target.plan.resident]
    return all(same)


PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("selfdraft") / "t", seed=21, layers=4, hidden=64)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def run(tmp_path, target, *extra, temperature="0"):
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
            temperature,
            "--seed",
            "7",
            "--max-new-tokens",
            "24",
            "--budget",
            "16",
            "--stats-json",
            str(stats),
            *extra,
        ],
    )
    assert res.exit_code == 0, res.output
    return json.loads(stats.read_text()), res


def untied_prefix(target, ar: dict, dtype: str) -> int:
    """Generated positions before the first where the target's top two logits (teacher-forced over
    ar's ids) lie within 2 units in the last place of `dtype`. There a pass over a batch of another
    shape may round either way (this random model's logits are flat: bf16 ties happen), so greedy
    ids of two lossless decoders can only be required equal up to it; fp32 has no such ties here."""
    from specexec_cli.session.loading import LoadOptions, load_models

    m = load_models(LoadOptions(str(target), None, dtype=dtype, device="cpu", offload="none"))
    ids = torch.tensor(m.tokenizer(PROMPT)["input_ids"] + ar["token_ids"])
    with torch.inference_mode():
        logits = m.target(input_ids=ids[None]).logits[0, ar["prompt_tokens"] - 1 : -1].float()
    top = logits.topk(2, dim=-1).values
    ulp = torch.finfo(m.target.dtype).eps * top[:, 0].abs().clamp(min=1.0)
    ties = ((top[:, 0] - top[:, 1]) <= 2 * ulp).nonzero()
    return int(ties[0, 0]) if ties.numel() else len(ar["token_ids"])


@pytest.mark.parametrize("offload", ["ram", "disk"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_self_draft_is_lossless_at_t0(tmp_path, target, offload, dtype):
    ar, _ = run(tmp_path, target, "--method", "ar", "--offload", offload, "--dtype", dtype)
    sd, _ = run(
        tmp_path,
        target,
        "--draft",
        "self",
        "--offload",
        offload,
        "--dtype",
        dtype,
        "--max-ram",
        "0" if offload == "disk" else "1GB",
    )
    n = untied_prefix(target, ar, dtype)
    assert n >= 8 and (dtype != "fp32" or n == len(ar["token_ids"]))
    assert sd["token_ids"][:n] == ar["token_ids"][:n]
    assert sd["tokens_per_pass"] > 1.0


def test_sampled_ids_equal_ar_with_the_same_seed(tmp_path, target):
    """T > 0: the target's draws are coupled to per-position noise (sampling.py), so every lossless
    draft yields exactly the ids `--method ar` samples with the same seed."""
    ar, _ = run(tmp_path, target, "--method", "ar", "--offload", "disk", temperature="0.8")
    sd, _ = run(tmp_path, target, "--draft", "self", "--offload", "disk", "--max-ram", "0", temperature="0.8")
    greedy, _ = run(tmp_path, target, "--method", "ar", "--offload", "disk")
    assert sd["token_ids"] == ar["token_ids"] != greedy["token_ids"]  # really sampled, and equal


def test_everything_resident_drafts_by_leaving_layers_out(tmp_path, target):
    ar, _ = run(tmp_path, target, "--method", "ar", "--offload", "none")
    sd, res = run(tmp_path, target, "--draft", "self", "--offload", "none")
    assert sd["token_ids"] == ar["token_ids"] and sd["method"] == "specexec"
    assert "nothing to substitute" not in res.stderr


def test_4bit_substitutes_of_a_4bit_target_are_refused_in_one_line(tmp_path, target):
    prompt = tmp_path / "p.txt"
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
            "--draft",
            "self",
            "--draft-bits",
            "4",
            "--dtype",
            "nf4",
            "--offload",
            "disk",
        ],
    )
    err = res.stderr.strip()
    assert res.exit_code != 0 and len(err.splitlines()) == 1 and "already 4-bit" in err and "fix:" in err


def test_shared_modules_are_the_targets_own(target):
    t = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="ram", max_device_memory=1)
    d = build_self_draft(t)
    try:
        assert shares_with(d, t) and d.substituted == list(range(4))
        assert d.embed_tokens.weight.data_ptr() == t.embed_tokens.weight.data_ptr()
        # the draft's own device bytes: the substitutes only (no embeddings, no lm_head copy)
        assert 0 < d.pool.allocated < sum(t.plan.layer_bytes) / 2
        assert set(d.pool.by_component) <= {"resident_layers", "pinned_params", "quant_states"}
    finally:
        d.close()
        t.close()


def test_substitute_cache_is_reused_rebuilt_on_change_and_on_corruption(target, tmp_path, monkeypatch):
    src = tmp_path / "t"
    src.mkdir()
    for f in target.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    built = []
    real = qc.write_quantized
    monkeypatch.setattr(qc, "write_quantized", lambda *a, **k: (built.append(1), real(*a, **k))[1])

    def load():
        t = OffloadedCausalLM.from_pretrained(src, dtype=torch.float32, offload="disk")
        d = build_self_draft(t)
        d.close()
        t.close()

    load()
    load()
    assert len(built) == 1  # second load: the cache is reused
    shard = next(src.glob("*.safetensors"))
    os.utime(shard, (shard.stat().st_atime, shard.stat().st_mtime + 10))
    load()
    assert len(built) == 2  # the target's files changed: rebuilt
    cache = qc.cache_dir(src, packing_for(torch.device("cpu")))
    layer_shard = sorted(p for p in cache.glob("*.safetensors"))[0]
    size = layer_shard.stat().st_size
    layer_shard.write_bytes(b"\xff" * size)  # same size, garbage header
    with pytest.warns(OffloadNotice, match="corrupt"):
        load()
    assert len(built) == 3


def test_profile_measures_the_self_draft_and_runs_start_from_it(tmp_path, target):
    """`specx profile --draft self` times the self-draft's tree growth and measures its node
    calibration prior; a later `--draft self` run of the same target picks that prior up."""
    from specexec_cli.session.calprobe import pair_prior

    out = tmp_path / "prof.json"
    res = runner.invoke(
        app,
        [
            "profile",
            "--target",
            str(target),
            "--draft",
            "self",
            "--device",
            "cpu",
            "--offload",
            "disk",
            "--max-ram",
            "0",
            "--max-tokens",
            "8",
            "--disk-mb",
            "1",
            "--calibration-tokens",
            "4",
            "--out",
            str(out),
            "--no-live",
        ],
    )
    assert res.exit_code == 0, res.output
    prof = json.loads(out.read_text())
    assert prof["models"]["draft"] == "self" and prof["models"]["draft_step_seconds"] > 0
    assert prof["node_calibration"] and pair_prior(prof, str(target), "self") is prof["node_calibration"]
    sd, _ = run(
        tmp_path,
        target,
        "--draft",
        "self",
        "--offload",
        "disk",
        "--max-ram",
        "0",
        "--profile",
        str(out),
        "--budget",
        "auto",
    )
    ar, _ = run(tmp_path, target, "--method", "ar", "--offload", "disk")
    assert sd["token_ids"] == ar["token_ids"]
