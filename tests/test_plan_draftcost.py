"""The draft cost model on the 70B nf4 plans at 24 GB (sparse real-sized headers), through `--dry-run`.

Every candidate's five figures are re-derived here by plain arithmetic from the model's stated formula
(offload/planning/draftcost.py docstring) and its inputs: the plan's bytes, the Llama-3.1-70B / 3.2-1B shapes
from their public configs, the bandwidths the plan reports, and the measured tokens/pass table. The
choice must be the candidate with the most modelled tokens/s."""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest
from typer.testing import CliRunner

from offload.planning.acceptance import TOKENS_PER_PASS
from offload.planning.selfplan import SKIP_FACTOR
from specexec_cli.terminal.app import app
from tests.sparse_ckpt import write_sparse

H, KV_HEADS, HD, INTER, LAYERS, VOCAB = 8192, 8, 128, 28672, 80, 128256  # Llama-3.1-70B
D_H, D_HD, D_INTER, D_LAYERS = 2048, 64, 8192, 16  # Llama-3.2-1B (tied head)
FIVE = ("tokens_per_pass", "pass_seconds", "draft_seconds", "tokens_per_second")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse_cost")
    return write_sparse("llama-3.1-70b", root / "t"), write_sparse("llama-3.2-1b", root / "d")


@pytest.fixture(scope="module")
def runs(pair, tmp_path_factory):
    """The two dry runs of the issue: --draft self and a 1B --draft, nf4 70B on a 24 GB card (--gpu 4090) in a
    machine with 64 GB of RAM (--max-ram 48GB: the plan does not depend on what this host has free)."""
    out = {}
    for name, draft in (("self", "self"), ("small", str(pair[1]))):
        path = tmp_path_factory.mktemp(name) / "plan.json"
        res = CliRunner().invoke(
            app,
            [
                "run",
                "-p",
                "x",
                "--target",
                str(pair[0]),
                "--draft",
                draft,
                "--dtype",
                "nf4",
                "--gpu",
                "4090",
                "--max-ram",
                "48GB",
                "--temperature",
                "0",
                "--dry-run",
                "--stats-json",
                str(path),
            ],
        )
        assert res.exit_code == 0, res.output
        out[name] = (json.loads(path.read_text())["plan"], res.stdout)
    return out


def measured_tpp(kind, budget: int) -> float:
    row = sorted(TOKENS_PER_PASS[kind]["greedy"].items())
    b = min(max(budget, row[0][0]), row[-1][0])
    for (x0, y0), (x1, y1) in itertools.pairwise(row):
        if b <= x1:
            return y0 + (y1 - y0) * math.log(b / x0) / math.log(x1 / x0)


def skip(fraction: float) -> float:
    pts = sorted(SKIP_FACTOR.items())
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if fraction <= x1:
            return y0 + (y1 - y0) * (fraction - x0) / (x1 - x0)


F16, MEM, LINK, DISK = 165.2e12, 1008e9, 0.75 * 32e9, 3e9  # 4090: published bf16 tensor (FP32 acc.), memory, PCIe 4
FORWARD_FLOOR, STEP_FLOOR, BEAMS = 0.01, 0.006, 32  # passcost.PRIORS["cuda"] floors; --max-beams
LINEARS = 2 * H * H + 2 * H * KV_HEADS * HD + 3 * H * INTER  # one decoder layer's linear weights


def model_ctx(plan: dict) -> int:
    """passcost.model_ctx: half the planned context, at most 1024 tokens (a chat turn's)."""
    return min(plan["ctx"] // 2, 1024)


def model_pass(plan: dict, n: int, compute_only: bool = False) -> float:
    """passcost.target_pass by hand: per layer max(transfer, GEMM-or-read + nf4 dequant + attention), summed,
    + head + floor; the 70B's layers all have the same size (layer_bytes_total / 80). `compute_only`: the
    pass's compute terms alone (what a draft cannot hide)."""
    size, ctx = plan["layer_bytes_total"] / LAYERS, model_ctx(plan)
    compute = (
        max(2 * LINEARS * n / F16, size / MEM)
        + (LINEARS * 2 * 2 / MEM if n > 4 else 0)
        + 4 * n * (ctx + n) * H // HD * HD / F16
        + 2 * (ctx + n) * KV_HEADS * HD * 2 / MEM
    )
    streamed = plan["streamed_layers"]
    layers = plan["resident_layers"] + streamed["ram"] + streamed["disk"]
    total = (
        layers * compute
        if compute_only
        else (
            plan["resident_layers"] * compute
            + streamed["ram"] * max(size / LINK, compute)
            + streamed["disk"] * max(size / DISK, compute)
        )
    )
    return FORWARD_FLOOR + max(2 * n * H * VOCAB / F16, H * VOCAB * 2 / MEM) + total


def rederive(plan: dict, cand: dict, traffic: int, flops: float, tpp: float) -> dict:
    """tokens/s = tpp / (pass + draft - hidden), each term from the model's formula with the plan's bytes."""
    dev, budget = plan["device_bytes"], cand["budget"]
    # forwards: the pending tokens, ceil(budget / beams) for the breadth, the accepted depth (tpp)
    rows = max(1, min(BEAMS, round(budget / 3)))  # draftcost.draft_rows: the frontier one forward runs
    draft_s = (1 + math.ceil(budget / BEAMS) + math.ceil(tpp)) * max(traffic / MEM, flops * rows / F16, STEP_FLOOR)
    pass_s = model_pass(plan, budget + 1)
    hidden = min(
        draft_s,
        dev["staging_slots"] / (LINK if plan["ram_bytes_per_pass"] else DISK),
        max(0.0, pass_s - model_pass(plan, budget + 1, compute_only=True)),
    )  # stream time only
    return dict(
        tokens_per_pass=tpp,
        pass_seconds=pass_s,
        draft_seconds=draft_s,
        tokens_per_second=tpp / (pass_s + draft_s - hidden),
    )


def check(cand: dict, want: dict) -> None:
    for k in FIVE:
        assert cand[k] == pytest.approx(want[k], rel=1e-3, abs=1e-4), k


def drafts(plan: dict) -> list[dict]:
    return [c for c in plan["candidates"] if c["draft"] != "none"]


def test_both_dry_runs_list_candidates_with_five_figures_and_choose_the_fastest(runs):
    for _name, (plan, stdout) in runs.items():
        assert plan["fits"] and plan["device_capacity"] == 24 << 30
        m = plan["machine"]
        assert m["memory_bps"] == 1008e9 and "published" in m["source"] and m["flops16"] == F16
        assert "published" in m["sources"]["flops16"] and m["sources"]["forward_floor_s"] == "prior"
        cands = drafts(plan)
        assert {(c["draft"] == "self", c["bits"]) for c in cands} >= {(True, 3), (True, 2)}
        for c in plan["candidates"]:
            assert c["draft"] and all(isinstance(c[k], (int, float)) for k in FIVE) and c["pass_seconds"] > 0.01
            assert c["sources"] == {"pass": "modelled", "draft": "modelled"}  # --gpu: no profile applies
        assert plan["choice"] == max((c for c in cands if c["fits"]), key=lambda c: c["tokens_per_second"])
        assert plan["candidates"][-1]["draft"] == "none" and plan["candidates"][-1]["tokens_per_pass"] == 1
        assert "candidates (m = measured" in stdout and "what bounds the pass" in stdout
    small = drafts(runs["small"][0])
    assert small[0]["bits"] is None and small[0]["draft"].endswith("d") and len(small) == 3
    assert small[1:] == drafts(runs["self"][0])  # the self-draft's widths, planned on their own


def test_the_self_drafts_figures_rederived(runs):
    plan = runs["self"][0]
    assert plan["substitute_bits"] == plan["choice"]["bits"]
    run, resident = LAYERS - len(plan["skipped_layers"]), plan["resident_layers"]
    dev = plan["device_bytes"]
    weight = dev["resident_layers"] + dev["draft"] + VOCAB * H * 2  # resident nf4 layers + substitutes + bf16 head
    kv = 2 * run * KV_HEADS * HD * model_ctx(plan) * 2  # the shared KV of every layer it runs
    # HQQ substitutes: the compiled path (the CUDA default) writes the bf16 weight once and the matmul reads it: 2
    # elements a weight; the eager reference ($SPECX_LOWBIT_KERNEL=eager) 6. bnb (the resident nf4 layers): 2.
    hqq = 6 if os.environ.get("SPECX_LOWBIT_KERNEL", "").lower() == "eager" else 2
    dequant = LINEARS * 2 * ((run - resident) * hqq + resident * 2)
    bits = plan["choice"]["bits"]
    tpp = measured_tpp(bits, plan["choice"]["budget"]) * skip(len(plan["skipped_layers"]) / LAYERS)
    flops = 2 * (LINEARS * run + H * VOCAB)
    check(plan["choice"], rederive(plan, plan["choice"], weight + kv + dequant, flops, tpp))
    assert plan["choice"]["dequant_bytes"] == dequant and plan["choice"]["kv_bytes"] == kv


def test_the_small_drafts_figures_rederived(runs):
    plan = runs["small"][0]
    params = VOCAB * D_H + D_H + D_LAYERS * (2 * D_H + 2 * D_H * D_H + 2 * D_H * 8 * D_HD + 3 * D_H * D_INTER)
    weight = params * 2 + 2 * (D_HD // 2) * 4  # bf16, tied head read once; rotary buffers
    kv = 2 * D_LAYERS * 8 * D_HD * model_ctx(plan) * 2
    cand = plan["candidates"][0]
    check(cand, rederive(plan, cand, weight + kv, 2 * weight / 2, measured_tpp("small", cand["budget"])))
    assert cand["weight_bytes"] == weight and cand["dequant_bytes"] == 0


def test_plain_decoding_is_one_token_per_one_token_pass(runs):
    plan = runs["self"][0]
    plain = plan["candidates"][-1]
    assert plain["draft_seconds"] == 0 and plain["budget"] == 0
    assert plain["pass_seconds"] == pytest.approx(model_pass(plan, 1), rel=1e-3)
    assert plain["tokens_per_second"] == pytest.approx(1 / plain["pass_seconds"], rel=1e-3)


def test_the_pass_grows_with_the_tree_at_least_by_its_gemm_flops(runs):
    """70B nf4 on a 4090 (no profile): every budget's modelled pass is at least the GEMM FLOPs of its
    n = budget + 1 tokens through all 80 layers and the head at the card's published rate, and it is never
    shorter for a bigger tree (where a streamed layer's transfer is longer than its compute, the compute
    runs under it: the next test shows the growth where compute bounds the pass)."""
    for plan, _ in runs.values():
        rows = plan["choice"]["by_budget"]
        assert [r["budget"] for r in rows] == [b for b in (4, 8, 16, 64, 256, 1024) if b < rows[-1]["budget"]] + [
            rows[-1]["budget"]
        ] and len(rows) >= 3  # the dry run's budgets up to what the memory plan sized
        for r in rows:
            n = r["budget"] + 1
            assert r["pass_seconds"] >= (LAYERS * 2 * LINEARS * n + 2 * n * H * VOCAB) / F16
        assert all(b["pass_seconds"] >= a["pass_seconds"] for a, b in itertools.pairwise(rows))


def test_a_compute_bound_pass_grows_by_the_gemm_flops_at_the_cards_rate():
    """passcost.target_pass on the 70B's shapes, every layer resident (no transfer to hide under) on the
    published 4090: from 257 to 1025 tree tokens the pass grows by at least 80 layers' extra GEMM FLOPs
    (2 x linear weights x 768 tokens) at 165.2 TFLOP/s."""
    from types import SimpleNamespace

    from offload.planning.membytes import Arch
    from offload.planning.passcost import device_for, target_pass

    a = Arch(H, INTER, LAYERS, H // HD, KV_HEADS, HD, VOCAB, False, 131072)
    plan = SimpleNamespace(layer_bytes=[LINEARS // 2] * LAYERS, ram_layers=[], disk_layers=[])
    dev = device_for("cuda", {}, memory_bps=MEM, flops16=F16)
    small, big = (target_pass(a, plan, dev, n, 4096, 2, "nf4-dequant") for n in (257, 1025))
    assert big.seconds - small.seconds >= LAYERS * 2 * LINEARS * 768 / F16
    assert small.bound == big.bound == "compute" and big.stream == 0


def test_budget_auto_models_at_least_every_budget_it_shows(runs):
    """--budget auto (the default): the chosen budget's modelled tokens/s is the most of every budget the
    dry run shows, and it is the plan's budget."""
    for plan, stdout in runs.values():
        rows, choice = plan["choice"]["by_budget"], plan["choice"]
        assert all(choice["tokens_per_second"] >= r["tokens_per_second"] for r in rows)
        assert choice["budget"] == max(rows, key=lambda r: r["tokens_per_second"])["budget"] == plan["budget"]
        assert "tokens/s by budget" in stdout


def test_unknown_card_is_one_line_naming_the_known_ones(pair):
    res = CliRunner().invoke(app, ["run", "-p", "x", "--target", str(pair[0]), "--gpu", "5090", "--dry-run"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "4090" in err and "h100" in err and "--max-gpu-memory" in err


def test_auto_without_a_fitting_self_draft_decodes_without_one(capsys):
    """--draft auto when the self-draft plan is refused (a pre-quantized target, a card too small): one
    notice with the reason, the draft dropped, and the plan made again for no draft."""
    from types import SimpleNamespace

    from specexec_cli.session.loading import LoadOptions
    from specexec_cli.session.planning import AUTO, resolve_auto

    refused = SimpleNamespace(
        fits=False,
        reason="--draft self: a pre-quantized checkpoint has no 16-bit weights",
        substitute_bits=None,
        candidates=[],
        choice=None,
    )
    replanned = []
    opts, plan = resolve_auto(
        LoadOptions(target="t", draft=AUTO),
        refused,
        lambda o: replanned.append(o) or SimpleNamespace(fits=True, substitute_bits=None),
    )
    assert opts.draft is None and replanned == [opts] and plan.fits
    err = capsys.readouterr().err.strip()
    assert err == (
        "--draft auto: no self-draft fits (--draft self: a pre-quantized checkpoint has no 16-bit "
        "weights), so decoding runs without a draft (pass --draft DIR for a small one)"
    )


def test_no_draft_flag_plans_the_auto_choice(pair, runs, tmp_path):
    """No --draft on the streamed 70B: the same candidates as --draft self, and one stderr line naming the choice."""
    path = tmp_path / "plan.json"
    res = CliRunner().invoke(
        app,
        [
            "run",
            "-p",
            "x",
            "--target",
            str(pair[0]),
            "--dtype",
            "nf4",
            "--gpu",
            "4090",
            "--max-ram",
            "48GB",
            "--temperature",
            "0",
            "--dry-run",
            "--stats-json",
            str(path),
        ],
    )
    assert res.exit_code == 0, res.output
    plan = json.loads(path.read_text())["plan"]
    assert plan["candidates"] == runs["self"][0]["candidates"] and plan["choice"] == runs["self"][0]["choice"]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("--draft auto:")]
    assert lines == [
        f"--draft auto: the self-draft at {plan['choice']['bits']} bits (modelled "
        f"{plan['choice']['tokens_per_second']:.2f} tokens/s, the best of 2 candidates; --dry-run lists them)"
    ]
    assert plan["choice"]["tokens_per_second"] > plan["candidates"][-1]["tokens_per_second"]  # beats plain
