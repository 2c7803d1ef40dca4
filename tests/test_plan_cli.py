"""`--dry-run` and the before-loading refusal, through typer's CliRunner on sparse 70B checkpoints."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from tests.sparse_ckpt import write_sparse

runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse_cli")
    return write_sparse("llama-3.1-70b", root / "t"), write_sparse("llama-3.2-1b", root / "d")


@pytest.fixture()
def no_loading(monkeypatch):
    """Any attempt to load weights fails the test: the plan must decide first."""
    import specexec_cli.session.loading as loading

    def boom(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(loading, "load_models", boom)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("cmd", ["run", "chat"])
def test_dry_run_plans_a_24gb_card_without_a_gpu(pair, tmp_path, no_loading, cmd):
    out = tmp_path / "plan.json"
    args = [cmd] + (["prompt-unused.txt"] if cmd == "run" else [])
    res = invoke(
        *args,
        "--target",
        pair[0],
        "--draft",
        pair[1],
        "--dtype",
        "nf4",
        "--device",
        "cuda",
        "--max-gpu-memory",
        "24GB",
        "--dry-run",
        "--stats-json",
        out,
    )
    assert res.exit_code == 0, res.output
    plan = json.loads(out.read_text())["plan"]
    assert plan["fits"] and plan["device_total"] <= plan["device_capacity"] == 24 * 10**9
    for comp in ("lm_head", "quant_states", "draft", "kv_target", "kv_draft", "activations", "cuda_context"):
        assert plan["device_bytes"][comp] > 0 and comp in res.stdout
    assert plan["resident_layers"] + plan["streamed_layers"]["ram"] + plan["streamed_layers"]["disk"] == 80


def test_unfittable_run_is_refused_before_loading(pair, tmp_path, no_loading):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    res = invoke(
        "run",
        prompt,
        "--target",
        pair[0],
        "--draft",
        pair[1],
        "--dtype",
        "bf16",
        "--device",
        "cuda",
        "--offload",
        "none",
        "--max-gpu-memory",
        "24GB",
        "--no-live",
    )
    assert res.exit_code == 2, res.output
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in res.output
    assert "needs" in err and "has 24.0 GB" in err and "fix:" in err


def test_dry_run_that_cannot_fit_exits_nonzero(pair, tmp_path, no_loading):
    out = tmp_path / "plan.json"
    res = invoke(
        "run",
        "x.txt",
        "--target",
        pair[0],
        "--draft",
        pair[1],
        "--dtype",
        "nf4",
        "--device",
        "cuda",
        "--max-gpu-memory",
        "6GB",
        "--dry-run",
        "--stats-json",
        out,
    )
    assert res.exit_code == 2
    assert json.loads(out.read_text())["plan"]["fits"] is False
    assert "needs" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_dry_run_plans_for_a_bigger_machine_and_a_real_run_refuses_it(pair, tmp_path, no_loading):
    """Explicit caps describe the machine to plan for (a purchase decision): the dry run plans for
    them even though this host has less, says so in one line and exits 0; a real run refuses."""
    out = tmp_path / "plan.json"
    caps = [
        "--target",
        pair[0],
        "--draft",
        pair[1],
        "--dtype",
        "nf4",
        "--device",
        "cuda",
        "--max-gpu-memory",
        "24GB",
        "--max-ram",
        "2TB",
    ]
    res = invoke("run", "unused.txt", *caps, "--dry-run", "--stats-json", out)
    assert res.exit_code == 0, res.output
    plan = json.loads(out.read_text())["plan"]
    assert plan["fits"] and "--max-ram 2.0 TB but this host has" in plan["elsewhere"]
    assert "planned for the machine the caps describe" in " ".join(res.stdout.split())
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    res = invoke("run", prompt, *caps, "--no-live")
    err = res.stderr.strip()
    assert res.exit_code == 2 and len(err.splitlines()) == 1 and "another machine" in err and "fix:" in err


def test_a_prompt_within_ctx_streams_the_weights_once(tiny_pair, tmp_path):
    """A 400-token prompt through a disk-streamed target on CPU: one prefill pass (prefill_streams)
    where 256-token chunks took two, and the text equals the chunked baseline's."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("def f(x):\n    return x\n" * 17)  # 408 characters (char-level tokens)
    out = tmp_path / "s.json"
    res = invoke(
        "run",
        prompt,
        "--target",
        tiny_pair[0],
        "--draft",
        tiny_pair[1],
        "--device",
        "cpu",
        "--offload",
        "disk",
        "--ctx",
        "500",
        "--max-new-tokens",
        "8",
        "--no-live",
        "--no-chat-template",
        "--temperature",
        "0",
        "--stats-json",
        out,
    )
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    assert rec["prompt_tokens"] > 256 and rec["prefill_streams"] == 1
