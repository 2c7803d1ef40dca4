"""`specx run --dry-run` of a mixture-of-experts target: the expert placement and its modelled tok/s
(specexec_cli/terminal/candidates.py's experts table), on a sparse Qwen3-30B-A3B with real headers."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from tests.sparse_ckpt import write_sparse
from tests.sparse_moe import write_sparse_moe


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_cli")
    return write_sparse_moe("qwen3-30b-a3b", root / "t"), write_sparse("qwen2.5-0.5b", root / "d")


def dry_run(tmp_path, target, *extra):
    out = tmp_path / "plan.json"
    args = ["run", "prompt-unused.txt", "--target", target, "--device", "cuda", "--max-gpu-memory", "24GB"]
    args += ["--max-ram", "64GB", "--dry-run", "--stats-json", out, *extra]
    (tmp_path / "xdg").mkdir(exist_ok=True)  # no profile of this machine
    r = CliRunner().invoke(
        app, [str(a) for a in args], env={"COLUMNS": "200", "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    )
    assert r.exit_code == 0, r.output
    return " ".join(r.output.split()), json.loads(out.read_text())["plan"]  # captions wrap: one line


def test_dry_run_shows_the_expert_placement(moe, tmp_path):
    out, plan = dry_run(tmp_path, moe[0], "--method", "ar")
    ex = plan["experts"]
    assert ex["mode"] == "split"
    assert "experts: attention+shared on the card, routed experts apart" in out
    assert f"{ex['gpu_experts']} of {128 * 48}" in out
    assert f"plain decoding {ex['tokens_per_second']:.2f} tok/s modelled" in out
    assert "not yet run" not in out and "prior" in out
    assert "nothing streams whole layers" in out  # the note: the loader runs the split
    # the plan's own totals are the split's (what the loader allocates), not the whole-layer placement's
    assert plan["device_bytes"] == ex["device_bytes"] and plan["host_bytes"]["experts_ram"] > 0
    assert plan["streamed_layers"] == {"ram": 0, "disk": 0} and "layers: 48 resident, 0 from RAM" in out


def test_dry_run_with_a_draft_prices_the_verify_pass_by_experts(moe, tmp_path):
    out, plan = dry_run(tmp_path, moe[0], "--draft", moe[1], "--draft-dtype", "bf16", "--budget", "auto")
    choice = plan["choice"]
    assert choice["terms"]["experts"] > 0
    assert "distinct experts routed, on" in out
    # the given draft's tree stays small: its verify pass is priced by the distinct experts it routes to
    # (the self-draft widths' acceptance priors come from the trained pair and may favour larger trees)
    given = next(c for c in plan["candidates"] if c["draft"] not in ("self", "none"))
    assert given["budget"] <= 16 and given["terms"]["experts"] > 0
