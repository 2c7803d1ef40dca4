"""Which layers a partial self-draft leaves out (offload/selfdraft/influence.py, loading.skipped_layers).

What must hold: block influence is 1 - cos between a layer's input and output residual stream,
equal to what HF's own hidden states give; a layer that does nothing (o_proj and down_proj zeroed)
scores ~0 and is the first one left out; the first and last layers never are; the measurement runs
once per checkpoint (stored, keyed by the weight files: a changed checkpoint or a corrupt file is
measured again); without a measurement the order is the middle block; the plan uses a stored
measurement for its note and layers; and the draft stays lossless at T = 0 whatever it leaves out.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload.selfdraft.build import PassThrough, skip_block
from offload.selfdraft.influence import (
    CALIBRATION,
    MAX_TOKENS,
    layer_influence,
    pick_skipped,
    skip_order,
    stored_influence,
)
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.methods import generate
from specexec_cli.session.loading import LoadOptions, load_models
from tests.conftest import make_model

IDLE = 3  # the layer made to do nothing


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("influence") / "t", seed=23, layers=6, hidden=64)
    weights = load_file(path / "model.safetensors")
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):  # the layer adds nothing to the stream
        weights[f"model.layers.{IDLE}.{name}"].zero_()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))


def load(target, draft="self", **kw):
    return load_models(LoadOptions(str(target), draft, dtype="fp32", device="cpu", offload="disk", max_ram=0, **kw))


def decode(models, method="specexec"):
    cfg = GenerationConfig(method=method, shape=TreeShape(16, 16), max_new_tokens=20)
    ids = models.tokenizer("def add(a, b):\n    return")["input_ids"]
    return [t for ev in generate(models, DecodeState(), ids, cfg) for t in ev.tokens]


def test_without_a_measurement_the_order_is_the_middle_block():
    for n in range(3, 33):
        order = skip_order(n)
        assert sorted(order) == list(range(1, n - 1)), "first and last layers are never left out"
        assert all(sorted(order[:k]) == skip_block(n, k) for k in range(n - 1))
    assert skip_order(6, [0.0, 0.5, 0.2, 0.01, 0.3, 0.0]) == [3, 2, 4, 1]  # by influence, never 0 or 5
    assert pick_skipped([3, 2, 4, 1], streamed=[1, 2, 4, 5], n=2) == [2, 4]  # resident layer 3 saves nothing


def test_influence_is_one_minus_cosine_of_hfs_hidden_states(target):
    from transformers import AutoModelForCausalLM

    models = load(target, None)
    ids = models.tokenizer(CALIBRATION, return_tensors="pt")["input_ids"][:, :MAX_TOKENS]
    got = layer_influence(models.target, ids)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states  # (layers + 1) x (1, T, hidden); the last is normed
    for i in range(len(got) - 1):
        want = (1 - torch.nn.functional.cosine_similarity(hs[i][0, 1:], hs[i + 1][0, 1:], dim=-1)).mean()
        assert got[i] == pytest.approx(float(want), abs=1e-5)
    assert got[IDLE] < 1e-6 < min(v for i, v in enumerate(got) if i != IDLE)


def test_the_idle_layer_is_left_out_measured_once_and_lossless(target, capsys):
    ar = decode(load(target, None), "ar")
    models = load(target, draft_skip=1)
    assert "measure each layer's influence" in capsys.readouterr().err
    assert models.draft.skipped == [IDLE] and isinstance(models.draft.layers[IDLE], PassThrough)
    assert decode(models) == ar
    again = load(target, draft_skip=2)  # stored: no second measuring pass
    assert "influence" not in capsys.readouterr().err and again.target.stats.passes == 0
    assert IDLE in again.draft.skipped and len(again.draft.skipped) == 2
    assert decode(again) == ar
    middle = load(target, draft_skip=1, draft_skip_rule="middle")
    assert middle.draft.skipped == skip_block(6, 1) and decode(middle) == ar


def test_a_changed_checkpoint_or_a_corrupt_file_is_measured_again(target, tmp_path):
    load(target, draft_skip=1)
    stored = stored_influence(target, 6)
    assert stored is not None and min(range(1, 5), key=stored.__getitem__) == IDLE
    (path,) = (tmp_path / "cache").glob("*-influence-*.json")
    path.write_text("{not json")
    assert stored_influence(target, 6) is None
    path.write_text(json.dumps({"influence": [0.1] * 5}))  # wrong layer count
    assert stored_influence(target, 6) is None
    load(target, draft_skip=1)
    assert stored_influence(target, 6) is not None
    st = os.stat(target / "model.safetensors")
    os.utime(target / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the weights changed
    assert stored_influence(target, 6) is None


def test_the_plan_follows_a_stored_measurement(target):
    from specexec_cli.session.planning import make_plan

    opts = LoadOptions(str(target), "self", dtype="fp32", device="cpu", offload="disk", max_ram=0)
    plan = make_plan(opts, TreeShape(16, 16), False, 0.0)
    assert plan.fits and not plan.skipped_layers  # every substitute fits here: nothing left out
    plan.skipped_layers = [1]  # as if the card had room for all but one
    models = load_models(replace(opts, plan=plan))
    assert models.draft.skipped == plan.skipped_layers == [IDLE], "the loader measures and updates the plan"

    from offload.planning.selfplan import skip_note, skip_order_for
    from tests.sparse_ckpt import read_checkpoint

    order, measured = skip_order_for(read_checkpoint(target), 6)
    assert measured and order[0] == IDLE
    assert skip_note(read_checkpoint(target), plan) == f"layers {IDLE}, the least influential as measured"
