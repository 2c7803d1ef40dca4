"""`specx run` through typer's CliRunner: stdout carries only text; bad input is one clean line."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from tests.conftest import make_model

runner = CliRunner()


@pytest.fixture()
def prompt(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("def f(x):\n  return")
    return path


def invoke(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def models_args(pair):
    return ["--target", pair[0], "--draft", pair[1], "--device", "cpu"]


def assert_user_error(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.output)
    err = result.stderr
    assert "Traceback" not in err and "Traceback" not in result.stdout
    assert "error" in err.lower()
    for needle in needles:
        assert needle.lower() in err.lower(), err


def test_run_streams_only_text_and_writes_stats(tiny_pair, prompt, tmp_path):
    stats = tmp_path / "s.json"
    r = invoke("run", prompt, *models_args(tiny_pair), "--max-new-tokens", 20, "--stats-json", stats, "--budget", 8)
    assert r.exit_code == 0, r.output
    rec = json.loads(stats.read_text())
    for key in (
        "method",
        "budget",
        "max_depth",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "prompt_tokens",
        "new_tokens",
        "token_ids",
        "target_passes",
        "tokens_per_pass",
        "wall_seconds",
        "prefill_seconds",
        "draft_seconds",
        "target_seconds",
        "tokens_per_second",
        "accept_histogram",
    ):
        assert key in rec, key
    assert rec["budget"] == 8 and rec["new_tokens"] == len(rec["token_ids"]) <= 20
    assert sum(int(k) * v for k, v in rec["accept_histogram"].items()) == rec["new_tokens"] - 1
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(tiny_pair[0]).decode(rec["token_ids"], skip_special_tokens=True)
    assert r.stdout.rstrip("\n") == text.rstrip("\n")
    assert "tok/s" in r.stderr  # the plain summary line (stderr is not a TTY here)


def test_run_reads_stdin_and_method_ar(tiny_pair, tmp_path):
    stats = tmp_path / "s.json"
    r = invoke(
        "run",
        "-",
        "--target",
        tiny_pair[0],
        "--method",
        "ar",
        "--max-new-tokens",
        5,
        "--stats-json",
        stats,
        input="class a:\n",
    )
    assert r.exit_code == 0, r.output
    rec = json.loads(stats.read_text())
    assert rec["method"] == "ar" and rec["tokens_per_pass"] in (0, 1.0)


def test_missing_prompt_file(tiny_pair, tmp_path):
    assert_user_error(invoke("run", tmp_path / "nope.txt", *models_args(tiny_pair)), "not found")


def test_empty_prompt(tiny_pair, tmp_path):
    (tmp_path / "e.txt").write_text("  \n")
    assert_user_error(invoke("run", tmp_path / "e.txt", *models_args(tiny_pair)), "empty")


def test_non_utf8_prompt(tiny_pair, tmp_path):
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe\x00bad")
    assert_user_error(invoke("run", tmp_path / "b.txt", *models_args(tiny_pair)), "UTF-8")


def test_missing_model_dir(prompt, tmp_path):
    r = invoke("run", prompt, "--target", tmp_path / "none", "--draft", tmp_path / "none2")
    assert_user_error(r, "--target")


def test_incomplete_model_dir(tiny_pair, prompt, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_pair[0], broken)
    (broken / "model.safetensors").unlink()
    assert_user_error(invoke("run", prompt, "--target", broken, "--draft", tiny_pair[1]), "no weights")


def test_pickle_checkpoint_refused_unless_allowed(tiny_pair, prompt, tmp_path):
    import torch
    from safetensors.torch import load_file

    pkl = tmp_path / "pkl"
    pkl.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_pair[0] / name, pkl)
    torch.save(load_file(tiny_pair[0] / "model.safetensors"), pkl / "pytorch_model.bin")
    assert_user_error(invoke("run", prompt, "--target", pkl, "--method", "ar"), "--allow-pickle")
    r = invoke("run", prompt, "--target", pkl, "--method", "ar", "--allow-pickle", "--max-new-tokens", 3)
    assert r.exit_code == 0, r.output


def test_vocab_mismatch(tiny_pair, prompt, tmp_path):
    other = make_model(tmp_path / "other", seed=3)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert_user_error(invoke("run", prompt, "--target", tiny_pair[0], "--draft", other), "tokenizers differ")


def test_prompt_overflows_context(tmp_path):
    small = make_model(tmp_path / "small", seed=4, max_pos=32)
    (tmp_path / "long.txt").write_text("x = 1\n" * 20)
    r = invoke("run", tmp_path / "long.txt", "--target", small, "--draft", small)
    assert_user_error(r, "context")


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--budget", "0"], "--budget"),
        (["--budget", "lots"], "--budget"),
        (["--temperature", "-0.5"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--method", "magic"], "--method"),
        (["--dtype", "int3"], "--dtype"),
        (["--offload", "cloud"], "--offload"),
    ],
)
def test_bad_flags(tiny_pair, prompt, flags, needle):
    assert_user_error(invoke("run", prompt, *models_args(tiny_pair), *flags), needle)


def specx_command() -> list[str]:
    """The installed `specx` console script (pyproject's entry point) when present, else its target."""
    import shutil
    import sys

    exe = shutil.which("specx")
    if exe:
        return [exe]
    return [
        sys.executable,
        "-c",
        "import sys; from specexec_cli.terminal.app import main; sys.argv[0] = 'specx'; sys.exit(main())",
    ]


@pytest.mark.parametrize("debug", [False, True])
def test_debug_env_reraises(tmp_path, debug):
    """Through the real entry point in a subprocess: one clean line and exit 2 without SPECX_DEBUG,
    the full traceback with SPECX_DEBUG=1."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "SPECX_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if debug:
        env["SPECX_DEBUG"] = "1"
    r = subprocess.run(
        [*specx_command(), "run", str(tmp_path / "nope.txt"), "--method", "ar"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode != 0 and r.stdout == ""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    if debug:
        assert "Traceback (most recent call last)" in r.stderr and "nope.txt" in r.stderr, r.stderr
    else:
        assert r.returncode == 2, r.stderr
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "nope.txt" in lines[0] and "not found" in lines[0].lower(), lines
