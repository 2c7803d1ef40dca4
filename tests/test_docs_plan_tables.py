"""The 70B plan tables of docs/memory-plan.md and docs/self-draft.md are what the plan code computes
(tools/plan_tables.py: `--dry-run` on sparse 70B/1B checkpoints). The check plans twelve
configurations (slow); the fast tests prove the tables follow a plan's figures and that a missing
block is an error."""

from __future__ import annotations

import pytest

from tests.conftest import load_script

GB = 10**9


@pytest.fixture(scope="module")
def tool():
    return load_script("tools/plan_tables.py")


@pytest.mark.slow
def test_the_plan_tables_match_the_plan_code(tool, capsys):
    assert tool.main(["--check"]) == 0, capsys.readouterr().out


def fake_plan(**over) -> dict:
    bytes_ = {
        "lm_head": 2.1 * GB,
        "quant_states": 1.0 * GB,
        "pinned_params": 0.1 * GB,
        "draft": 2.5 * GB,
        "kv_target": 3.0 * GB,
        "kv_draft": 0.4 * GB,
        "activations": 3.6 * GB,
        "resident_layers": 9 * GB,
        "staging_slots": 0.9 * GB,
        "cuda_context": 1.4 * GB,
    }
    plan = {
        "device_bytes": bytes_,
        "streamed_layers": {"ram": 59, "disk": 0},
        "budget": 1024,
        "pass_tokens": 8192,
        "resident_layers": 21,
        "device_total": 23.9 * GB,
        "disk_bytes_per_pass": 0,
        "substitute_bits": 2,
        "skipped_layers": list(range(23, 56)),
        "candidates": [{"bits": 2, "tokens_per_pass": 3.94}],
    }
    plan.update(over)
    return plan


def test_the_pair_table_shows_the_plan_figures(tool):
    row = tool.pair_table([("nf4", 24, fake_plan(), "")]).splitlines()[2]
    assert (
        row == "| nf4 | 24 GB | 1024 | 8192 | 2.1 | 1.1 | 2.5 | 3.4 | 3.6 | 9.0 (21) | 0.9 | 1.4 | 23.9 | 59 / 0 | 0 |"
    )
    assert tool.pair_table([("nf4", 24, fake_plan(budget=512), "")]).splitlines()[2] != row
    refused = tool.pair_table([("nf4", 8, None, "needs 9 GB")]).splitlines()[2]
    assert refused.startswith("| nf4 | 8 GB | refused: needs 9 GB |") and refused.count("|") == 16


def test_the_selfdraft_table_says_what_the_plan_does(tool):
    row = tool.self_row(fake_plan(streamed_layers={"ram": 80, "disk": 0}, resident_layers=0))
    assert row.startswith("2-bit HQQ substitutes of 47 of the 80 streamed layers (2.5 GB), 0 resident")
    assert "leaves out 33 layers" in row and "middle block: layers 23-55" in row and "modelled 3.9 tokens" in row
    assert tool.self_row(fake_plan(substitute_bits=None)).startswith("every layer resident")
    assert 'refused: "no room"' in tool.self_table([("nf4", 12, None, "no room")])


def test_the_blocks_are_the_manifests(tool):
    """Each table goes to the pages bench/manifest.py lists for its block, which are the plan's own."""
    blocks = {key: tool.manifest.BLOCKS[name] for key, name in tool.BLOCKS.items()}
    assert blocks["pair"].pages == ("docs/memory-plan.md",) and blocks["selfdraft"].pages == ("docs/self-draft.md",)
    assert {b.render for b in blocks.values()} == {
        "tools/plan_tables.py:pair_block",
        "tools/plan_tables.py:selfdraft_block",
    }
    assert not any(b.pure for b in blocks.values())
