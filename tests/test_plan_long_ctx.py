"""A 32k-token context for a 70B on a 24 GB card: the dry run fits with every term counted.

Sparse checkpoints at real sizes (tests/sparse_ckpt.py: Llama-3.1-70B target, Llama-3.2-1B draft), nf4,
`--gpu 4090 --ctx 32768 --max-ram 48GB --dry-run`. The plan fits; its activations are at least the
largest of the target's verify pass, the target's prefill chunk over the whole context and the draft's
passes, each with its attention terms (offload/arch/attention.mask_bytes: on CUDA the prepared additive
mask at the padded width and the per-group outputs of a chunk, the folded mask of a small tree), and
the prefill chunk the plan picked is the one memplan runs with (pass_tokens).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from offload.arch.attention import mask_bytes
from offload.planning.membytes import arch_of, pass_bytes
from specexec_cli.terminal.app import app
from tests.sparse_ckpt import write_sparse


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse_long")
    return write_sparse("llama-3.1-70b", root / "t"), write_sparse("llama-3.2-1b", root / "d")


def test_70b_nf4_at_32k_on_a_4090_fits_with_the_attention_terms(pair, tmp_path):
    path = tmp_path / "plan.json"
    res = CliRunner().invoke(
        app,
        [
            "run",
            "-p",
            "x",
            "--target",
            str(pair[0]),
            "--draft",
            str(pair[1]),
            "--dtype",
            "nf4",
            "--gpu",
            "4090",
            "--max-ram",
            "48GB",
            "--ctx",
            "32768",
            "--temperature",
            "0",
            "--dry-run",
            "--stats-json",
            str(path),
        ],
    )
    assert res.exit_code == 0, res.output
    plan = json.loads(path.read_text())["plan"]
    assert plan["fits"] and plan["ctx"] == 32768 and plan["device_total"] <= plan["device_capacity"]
    ta = arch_of(json.loads((pair[0] / "config.json").read_text()))
    chunk, budget = plan["pass_tokens"], plan["budget"]
    assert 256 <= chunk <= 32768
    groups = ta.heads // ta.kv_heads
    attn = mask_bytes("cuda", chunk, 32768, groups, ta.kv_heads, ta.head_dim, 2, 1)
    assert attn >= chunk * 32768 * 2  # the chunk's additive mask is counted
    prefill = pass_bytes(ta, chunk, 32768, 2, "sdpa", 1, ta.intermediate * ta.hidden * 2, True, device="cuda")
    verify = pass_bytes(
        ta, budget + 1, plan["kv_rows"][0], 2, "sdpa", budget + 1, ta.intermediate * ta.hidden * 2, device="cuda"
    )
    assert plan["device_bytes"]["activations"] >= max(prefill, verify)


def test_ctx_beyond_the_window_is_refused_before_planning(pair):
    res = CliRunner().invoke(
        app,
        [
            "run",
            "-p",
            "x",
            "--target",
            str(pair[0]),
            "--draft",
            str(pair[1]),
            "--dtype",
            "nf4",
            "--gpu",
            "4090",
            "--ctx",
            "200000",
            "--dry-run",
        ],
    )
    assert res.exit_code == 2
    assert res.output.strip().splitlines()[-1] == (
        "error: --ctx 200000 is beyond the --target model's window of 131072 "
        "positions (max_position_embeddings in its config.json); fix: "
        "--ctx 131072 or less"
    )
