"""Regenerate the 70B and mixture-of-experts plan tables of docs/memory-plan.md and docs/self-draft.md.

Contract: plans Llama-3.1-70B (target) and Llama-3.2-1B (draft) with `specx run --dry-run` on
sparse checkpoints at their real sizes (tests/sparse_ckpt.py: real headers, no weight bytes), for
the machines the docs describe (`--device cuda --max-gpu-memory CAP --max-ram 64GB`, ctx 8192,
`--budget auto`), and replaces the `<!-- bench:plan-pair -->` block (a bf16 draft) and the
`<!-- bench:plan-selfdraft -->` block (`--draft self`) on the pages bench/manifest.py lists for them
(docs/memory-plan.md, docs/self-draft.md) with tables of the plans' own figures (`--stats-json`'s
"plan"; a refused plan shows its one-line error). `pair_block()` and `selfdraft_block()` are the two
bodies (planned once per process). `moe_block()` (tools/plan_moe.py) is the `<!-- bench:plan-moe -->`
body: the mixture-of-experts plans and the quoted runs' figures beside them. `--check` writes nothing
and exits 1 naming the pages whose tables differ from the plan code.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
import manifest  # noqa: E402  (bench/manifest.py)
from docblock import md_table, replace_block  # noqa: E402  (bench/docblock.py)

from tools.plan_moe import moe_block  # noqa: E402  (the mixture-of-experts tables)

BLOCKS = {"pair": "plan-pair", "selfdraft": "plan-selfdraft"}  # tables() key -> manifest block
MOE_BLOCK = "plan-moe"  # moe_block()'s manifest block
PAIR = [("nf4", 24), ("nf4", 16), ("nf4", 12), ("bf16", 24)]  # (target dtype, card GB)
SELF = [("nf4", 48), ("nf4", 44), ("nf4", 40), ("nf4", 24), ("nf4", 16), ("nf4", 12), ("bf16", 80), ("bf16", 40)]
GB = 1e9


def plan(target: Path, draft: str, dtype: str, card: int, tmp: Path) -> tuple[dict | None, str]:
    """The dry-run plan of one configuration, or (None, its one-line refusal)."""
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    out = tmp / f"{dtype}-{card}-{Path(draft).name}.json"
    args = [
        "run",
        "prompt.txt",
        "--target",
        str(target),
        "--draft",
        draft,
        "--dtype",
        dtype,
        "--device",
        "cuda",
        "--max-gpu-memory",
        f"{card}GB",
        "--max-ram",
        "64GB",
        "--ctx",
        "8192",
        "--dry-run",
        "--stats-json",
        str(out),
    ]
    if draft != "self":
        args += ["--draft-dtype", "bf16"]
    # an empty config dir: no profile this machine wrote (its measured rates) reaches the published tables
    (tmp / "xdg").mkdir(exist_ok=True)
    r = CliRunner().invoke(app, args, env={"COLUMNS": "200", "XDG_CONFIG_HOME": str(tmp / "xdg")})
    if r.exit_code != 0:
        return None, next(
            (ln.removeprefix("error: ") for ln in r.output.splitlines() if ln.startswith("error: ")), r.output
        )
    return json.loads(out.read_text())["plan"], ""


def gb(n: float) -> str:
    return "0" if n == 0 else f"{n / GB:.1f}"


PAIR_HEAD = ["target", "card", "budget", "prefill tokens/pass", "lm_head", "quant+pinned", "draft", "KV", "activations"]
PAIR_HEAD += ["resident (layers)", "slots", "CUDA margin", "total", "RAM / disk layers", "disk per pass"]


def pair_table(plans: list[tuple[str, int, dict | None, str]]) -> str:
    rows = []
    for dtype, card, p, refusal in plans:
        if p is None:
            rows.append([dtype, f"{card} GB", f"refused: {refusal}"] + [""] * 12)
            continue
        b, s = p["device_bytes"], p["streamed_layers"]
        rows.append(
            [dtype, f"{card} GB", p["budget"], p["pass_tokens"], gb(b["lm_head"])]
            + [gb(b["quant_states"] + b["pinned_params"]), gb(b["draft"]), gb(b["kv_target"] + b["kv_draft"])]
            + [gb(b["activations"]), f"{gb(b['resident_layers'])} ({p['resident_layers']})", gb(b["staging_slots"])]
            + [gb(b["cuda_context"]), gb(p["device_total"]), f"{s['ram']} / {s['disk']}"]
            + [gb(p["disk_bytes_per_pass"])]
        )
    return md_table(PAIR_HEAD, rows)


def self_row(p: dict) -> str:
    """What one fitting --draft self plan does, in words, from its figures."""
    streamed = p["streamed_layers"]["ram"] + p["streamed_layers"]["disk"]
    if p["substitute_bits"] is None:
        return "every layer resident: no substitutes, decodes without a draft"
    skipped, bits = len(p["skipped_layers"]), p["substitute_bits"]
    if bits == 0:  # build.LAYER_SKIP: every layer resident, the draft is the target with layers left out
        return skip_row(p, skipped)
    kind = "NF4" if bits == 4 else "HQQ"
    text = (
        f"{bits}-bit {kind} substitutes of {streamed - skipped} of the {streamed} streamed layers "
        f"({gb(p['device_bytes']['draft'])} GB), {p['resident_layers']} resident"
    )
    if skipped:
        lo, hi = min(p["skipped_layers"]), max(p["skipped_layers"])
        where = f"layers {lo}-{hi}" if hi - lo + 1 == skipped else "the layers it lists"
        text += (
            f"; the draft leaves out {skipped} layers, the least influential (measured at the first load; "
            f"this dry run, before it, shows the middle block: {where})"
        )
    choice = next((c for c in p.get("candidates", []) if c.get("bits") == bits), None)
    if choice:
        text += f"; modelled {choice['tokens_per_pass']:.1f} tokens per pass"
    return text


def skip_row(p: dict, skipped: int) -> str:
    """The layer-skip self-draft of a resident target, in words."""
    lo, hi = min(p["skipped_layers"]), max(p["skipped_layers"])
    where = f"layers {lo}-{hi}" if hi - lo + 1 == skipped else "the layers it lists"
    text = (
        f"every layer resident ({p['resident_layers']}): the draft is the target itself with {skipped} layers "
        f"left out, the least influential (measured at the first load; this dry run, before it, shows the "
        f"middle block: {where})"
    )
    choice = next((c for c in p.get("candidates", []) if c.get("bits") == 0), None)
    return text + (f"; modelled {choice['tokens_per_pass']:.1f} tokens per pass" if choice else "")


def self_table(plans: list[tuple[str, int, dict | None, str]]) -> str:
    rows = [
        [dtype, f"{card} GB", "-", "-", f'refused: "{refusal}"']
        if p is None
        else [dtype, f"{card} GB", p["budget"], f"{gb(p['device_total'])} GB", self_row(p)]
        for dtype, card, p, refusal in plans
    ]
    return md_table(["target", "card", "budget", "device total", "plan"], rows)


@functools.lru_cache(maxsize=1)
def tables() -> dict[str, str]:
    from tests.sparse_ckpt import write_sparse

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        target, draft = write_sparse("llama-3.1-70b", tmp / "target"), write_sparse("llama-3.2-1b", tmp / "draft")
        pair = [(dt, card, *plan(target, str(draft), dt, card, tmp)) for dt, card in PAIR]
        own = [(dt, card, *plan(target, "self", dt, card, tmp)) for dt, card in SELF]
    return {"pair": pair_table(pair), "selfdraft": self_table(own)}


def pair_block() -> str:
    """The body of `<!-- bench:plan-pair -->`: a bf16 draft beside the 70B target."""
    return tables()["pair"]


def selfdraft_block() -> str:
    """The body of `<!-- bench:plan-selfdraft -->`: the 70B target with `--draft self`."""
    return tables()["selfdraft"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a table differs from the plan")
    args = ap.parse_args(argv)
    stale = []
    bodies = {BLOCKS[key]: table for key, table in tables().items()} | {MOE_BLOCK: moe_block()}
    for name, table in bodies.items():
        for page in manifest.BLOCKS[name].pages:
            text = (ROOT / page).read_text()
            new = replace_block(text, name, table)
            if new != text:
                stale.append(page)
                if not args.check:
                    (ROOT / page).write_text(new)
    if args.check:
        print(
            "plan tables are up to date"
            if not stale
            else f"out of date: {', '.join(stale)}; run python tools/plan_tables.py"
        )
        return int(bool(stale))
    print(f"updated {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
