"""Device out-of-memory mid-pass, simulated on CPU: a decoder layer's forward raises
torch.OutOfMemoryError after some calls. `run` prints the text so far, then one line naming the
plan and the fix (lower --budget or --ctx), exit 3, no traceback; in chat the turn keeps what
was generated and the conversation goes on.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.llama import modeling_llama
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from tests.conftest import make_model

runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("oom")
    return make_model(root / "t", seed=1, layers=2), make_model(root / "d", seed=2, layers=2)


@pytest.fixture()
def oom_after(monkeypatch):
    """oom_after(n): the n-th decoder-layer forward from now (target or draft) raises OOM, once."""
    calls = {"left": None}
    original = modeling_llama.LlamaDecoderLayer.forward

    def forward(self, *args, **kwargs):
        if calls["left"] is not None:
            calls["left"] -= 1
            if calls["left"] == 0:
                calls["left"] = None
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", forward)

    def arm(n: int):
        calls["left"] = n

    return arm


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_run_oom_is_one_line_with_plan_and_fix(pair, tmp_path, oom_after, offload):
    prompt = tmp_path / "p.txt"
    prompt.write_text("def f(x):")
    stats = tmp_path / "s.json"
    oom_after(40)
    r = runner.invoke(
        app,
        [
            "run",
            str(prompt),
            "--target",
            str(pair[0]),
            "--draft",
            str(pair[1]),
            "--device",
            "cpu",
            "--no-live",
            "--max-new-tokens",
            "200",
            "--budget",
            "8",
            "--offload",
            offload,
            "--stats-json",
            str(stats),
        ],
    )
    assert r.exit_code == 3, (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, r.stderr
    assert "out of device memory" in lines[0] and "--budget" in lines[0] and "--ctx" in lines[0]
    if offload == "disk":
        assert "plan:" in lines[0]  # the offload placement that was running
    rec = json.loads(stats.read_text())
    assert 0 < rec["new_tokens"] < 200 and r.stdout.strip()  # the text so far was printed and kept


def test_chat_oom_keeps_turn_and_goes_on(pair, tmp_path, oom_after):
    log, saved = tmp_path / "t.jsonl", tmp_path / "c.json"
    args = [
        "chat",
        "--target",
        str(pair[0]),
        "--draft",
        str(pair[1]),
        "--device",
        "cpu",
        "--no-live",
        "--max-new-tokens",
        "60",
        "--budget",
        "8",
        "--offload",
        "none",
        "--stats-json",
        str(log),
    ]
    oom_after(60)
    r = runner.invoke(app, args, input=f"first\nsecond\n/save {saved}\n")
    assert r.exit_code == 0, (r.output, r.exception)
    assert "Traceback" not in r.output and "out of device memory" in r.stderr and "partial reply is kept" in r.stderr
    turns = [json.loads(x) for x in log.read_text().splitlines()]
    assert next(t["finish_reason"] for t in turns) == "oom" and len(turns) == 2
    assert turns[0]["new_tokens"] > 0 and turns[1]["finish_reason"] != "oom"
    roles = [m["role"] for m in json.loads(saved.read_text())["messages"]]
    assert roles == ["user", "assistant", "user", "assistant"]
