"""Regenerate the 70B memory-plan tables of docs/memory-plan.md and docs/self-draft.md from the plan.

Contract: plans Llama-3.1-70B (target) and Llama-3.2-1B (draft) with `specx run --dry-run` on
sparse checkpoints at their real sizes (tests/sparse_ckpt.py: real headers, no weight bytes), for
the machines the docs describe (`--device cuda --max-gpu-memory CAP --max-ram 64GB`, ctx 8192,
`--budget auto`), and replaces the `<!-- plan:pair -->` block of docs/memory-plan.md (a bf16
draft) and the `<!-- plan:selfdraft -->` block of docs/self-draft.md (`--draft self`) with tables
of the plans' own figures (`--stats-json`'s "plan"; a refused plan shows its one-line error).
`--check` writes nothing and exits 1 naming the pages whose tables differ from the plan code.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PAGES = {"pair": "docs/memory-plan.md", "selfdraft": "docs/self-draft.md"}
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


def pair_table(plans: list[tuple[str, int, dict | None, str]]) -> str:
    lines = [
        "| target | card | budget | prefill tokens/pass | lm_head | quant+pinned | draft | KV | activations | "
        "resident (layers) | slots | CUDA margin | total | RAM / disk layers | disk per pass |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, card, p, refusal in plans:
        if p is None:
            lines.append(f"| {dtype} | {card} GB | refused: {refusal} |" + " |" * 12)
            continue
        b, s = p["device_bytes"], p["streamed_layers"]
        lines.append(
            f"| {dtype} | {card} GB | {p['budget']} | {p['pass_tokens']} | {gb(b['lm_head'])} | "
            f"{gb(b['quant_states'] + b['pinned_params'])} | {gb(b['draft'])} | {gb(b['kv_target'] + b['kv_draft'])} | "
            f"{gb(b['activations'])} | {gb(b['resident_layers'])} ({p['resident_layers']}) | {gb(b['staging_slots'])} | "
            f"{gb(b['cuda_context'])} | {gb(p['device_total'])} | {s['ram']} / {s['disk']} | {gb(p['disk_bytes_per_pass'])} |"
        )
    return "\n".join(lines)


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
    lines = ["| target | card | budget | device total | plan |", "|---|---|---|---|---|"]
    for dtype, card, p, refusal in plans:
        if p is None:
            lines.append(f'| {dtype} | {card} GB | - | - | refused: "{refusal}" |')
        else:
            lines.append(f"| {dtype} | {card} GB | {p['budget']} | {gb(p['device_total'])} GB | {self_row(p)} |")
    return "\n".join(lines)


def tables() -> dict[str, str]:
    from tests.sparse_ckpt import write_sparse

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        target, draft = write_sparse("llama-3.1-70b", tmp / "target"), write_sparse("llama-3.2-1b", tmp / "draft")
        pair = [(dt, card, *plan(target, str(draft), dt, card, tmp)) for dt, card in PAIR]
        own = [(dt, card, *plan(target, "self", dt, card, tmp)) for dt, card in SELF]
    return {"pair": pair_table(pair), "selfdraft": self_table(own)}


def render(text: str, name: str, table: str) -> str:
    begin, end = f"<!-- plan:{name} -->", f"<!-- /plan:{name} -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"needs one {begin} … {end} block")
    return re.sub(f"{re.escape(begin)}.*?{re.escape(end)}", lambda _: f"{begin}\n{table}\n{end}", text, flags=re.S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a table differs from the plan")
    args = ap.parse_args(argv)
    stale = []
    for name, table in tables().items():
        path = ROOT / PAGES[name]
        text = path.read_text()
        new = render(text, name, table)
        if new != text:
            stale.append(PAGES[name])
            if not args.check:
                path.write_text(new)
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
