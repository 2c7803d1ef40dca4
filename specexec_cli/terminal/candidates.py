"""The dry run's tables: the memory plan, then the candidate drafts and their tokens/s by budget.

Contract: `print_plan(plan)` prints MemoryPlan.to_json() on stdout: the memory plan, a mixture-of-experts
target's expert placement, then `candidates_table(plan)` (offload/planning/draftcost.py, passcost.py):
the candidates and plain decoding, what bounds the chosen pass and its tokens/s by budget, in 80
columns; figures a matching `specx profile` measured are marked `m`, every other one is modelled."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape


def candidates_table(plan: dict):
    """The candidate drafts and plain decoding, the choice marked; then the chosen pass's terms and budgets."""
    from rich.console import Group
    from rich.table import Table

    choice = plan.get("choice") or {}
    table = Table(title="candidates (m = measured by specx profile, else modelled)", header_style="bold cyan")
    for col in ("draft", "bits", "tok/pass", "pass s", "draft s", "hidden", "tok/s", ""):
        table.add_column(col, justify="left" if col in ("draft", "") else "right", overflow="fold")
    plain = next((c for c in plan["candidates"] if c["draft"] == "none"), None)
    plain_faster = (
        plain is not None and plain["fits"] and plain["tokens_per_second"] > choice.get("tokens_per_second", 0)
    )
    for c in plan["candidates"]:
        chosen = c["draft"] == choice.get("draft") and c["bits"] == choice.get("bits")
        # --draft auto decodes plainly when plain decoding models faster than the best draft
        if chosen:
            label = "best draft" if plain_faster else "chosen"
        else:
            label = "faster" if c is plain and plain_faster else ""
        src = c.get("sources") or {}
        mark = {k: "m" if src.get(k) == "measured" else "" for k in ("pass", "draft")}
        table.add_row(
            _short_draft(c["draft"]),
            "-" if c["bits"] is None else str(c["bits"]),
            f"{c['tokens_per_pass']:.2f}",
            f"{c['pass_seconds']:.3f}{mark['pass']}",
            f"{c['draft_seconds']:.3f}{mark['draft']}",
            f"{c.get('hidden_seconds', 0):.3f}",
            f"{c['tokens_per_second']:.2f}" if c["fits"] else "-",
            f"[green]{label}[/green]" if label else ("" if c["fits"] else "no fit"),
        )
    parts = [table, _terms_table(plan, choice)] if choice.get("terms") else [table]
    if len(choice.get("by_budget") or []) > 1:
        parts.append(_budgets_table(choice))
    return Group(*parts)


def _short_draft(draft: str) -> str:
    """A --draft directory by its last two path parts (the full path is in --stats-json)."""
    from pathlib import PurePath

    parts = PurePath(str(draft)).parts
    return escape(str(PurePath(*parts[-2:])) if len(parts) > 2 else str(draft))


def _terms_table(plan: dict, choice: dict):
    """The chosen candidate's modelled target pass, term by term, and where each rate comes from."""
    from rich.table import Table

    m, t = plan.get("machine") or {}, choice["terms"]
    src = m.get("sources") or {}
    table = Table(
        title=f"what bounds the pass ({t['tokens']} tokens; modelled, seconds; {t['bound']}-bound)",
        header_style="bold cyan",
    )
    for col in ("term", "seconds", "rate", "source"):
        table.add_column(col, justify="right" if col in ("seconds", "rate") else "left", overflow="fold")
    sixteen = t.get("flops", 0) == m.get("flops16")  # the compute dtype's rate: 16-bit or fp32
    flops = t.get("flops") or m.get("flops32" if plan.get("device") == "cpu" else "flops16", 0)
    # a mixture-of-experts target: the distinct routed experts' term
    experts = [("experts", t["experts"], "", f"distinct experts routed, on {t['routed']}")] if t.get("routed") else []
    link = f"{m.get('link_bps', 0) / 1e9:.0f}/{m.get('disk_bps', 0) / 1e9:.1f} GB/s"
    memory = f"{m.get('memory_bps', 0) / 1e9:.0f} GB/s"
    rows = (
        ("stream", t["stream"], link, src.get("link_bps", "prior")),
        ("GEMM", t["gemm"], f"{flops / 1e12:.3g} TFLOP/s", src.get("flops16" if sixteen else "flops32", "prior")),
        ("dequant", t["dequant"], memory, src.get("dequant", src.get("memory_bps", "prior"))),
        ("attention", t["attention"], "", "at half the planned context"),
        *experts,
        ("head", t["head"], "", ""),
        ("floor", t["floor"], "", src.get(t.get("floor_term", "forward_floor_s"), "prior")),
        ("pass", t["seconds"], "", "layers overlap: sum of max(stream, compute)"),
    )
    for name, secs, rate, where in rows:
        table.add_row(name, f"{secs:.4f}", rate, escape(str(where)))
    return table


def _budgets_table(choice: dict):
    """The chosen draft's modelled tokens/s at a few budgets (the one --budget auto takes is marked)."""
    from rich.table import Table

    table = Table(title="tokens/s by budget (chosen draft)", header_style="bold cyan")
    for col in ("budget", "tok/pass", "pass s", "draft s", "tok/s", ""):
        table.add_column(col, justify="right")
    for r in choice["by_budget"]:
        table.add_row(
            str(int(r["budget"])),
            f"{r['tokens_per_pass']:.2f}",
            f"{r['pass_seconds']:.3f}",
            f"{r['draft_seconds']:.3f}",
            f"{r['tokens_per_second']:.2f}",
            "[green]used[/green]" if r["budget"] == choice.get("budget") else "",
        )
    return table


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def print_plan(plan: dict) -> None:
    """The --dry-run plan (MemoryPlan.to_json()) on stdout: component, where it lives, bytes."""
    from rich.table import Table

    dev = "cuda" if plan.get("device") == "cuda" else "cpu"
    table = Table(title="specx memory plan", header_style="bold cyan")
    for col, justify in (("component", "left"), ("where", "left"), ("bytes", "right"), ("GB", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    for side, where in (("device", dev), ("host", "ram")):
        for name, n in plan[f"{side}_bytes"].items():
            table.add_row(name, where, f"{n:,}", _gb(n))
        total, capacity = plan[f"{side}_total"], plan[f"{side}_capacity"]
        table.add_row(
            f"[bold]{side} total[/bold]", where, f"{total:,}", f"{_gb(total)} of {_gb(capacity)}", end_section=True
        )
    table.add_row("layers read per pass", "disk", f"{plan['disk_bytes_per_pass']:,}", _gb(plan["disk_bytes_per_pass"]))
    streamed = plan["streamed_layers"]
    table.caption = (
        f"layers: {plan['resident_layers']} resident, {streamed['ram']} from RAM, {streamed['disk']} "
        f"from disk · embeddings {'packed' if plan['embeddings'] == 'packed' else 'on ' + plan['embeddings']} · ctx {plan['ctx']} · budget {plan['budget']} · "
        f"prefill {plan['pass_tokens']} tokens/pass · "
        + ("[green]fits[/green]" if plan["fits"] else "[bold red]does not fit[/bold red]")
    )
    console = Console(highlight=False)
    console.print(table)
    for note in plan.get("notes") or []:
        console.print(f"[dim]note: {escape(note)}[/dim]")
    if plan.get("experts"):
        console.print(experts_table(plan["experts"]))
    if plan.get("candidates"):
        console.print(candidates_table(plan))


def experts_table(ex: dict):
    """A mixture-of-experts target's expert placement (offload/planning/experts.py), speeds modelled:
    "split" (attention+shared on the card, routed experts apart by tier) or "on-demand"."""
    from rich.table import Table

    split, held = ex["mode"] == "split", ex["mode"] == "on-demand"
    titles = {
        "split": "experts: attention+shared on the card, routed experts apart",
        "on-demand": "experts: disk layers' routed experts read when routed",
    }
    table = Table(title=titles.get(ex["mode"], "experts: whole layers"), header_style="bold cyan")
    for col, justify in (("part", "left"), ("where", "left"), ("experts", "right"), ("GB", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    if split:
        dev, n = ex["device_bytes"], ex["gpu_experts"] + ex["ram_experts"] + ex["disk_experts"]
        table.add_row("attention+shared (every layer)", "cuda", "", _gb(dev["attention_shared"]))
        table.add_row("expert cache (hottest first)", "cuda", f"{ex['gpu_experts']} of {n}", _gb(dev["expert_cache"]))
        table.add_row(
            "experts computed on the CPU", "ram", str(ex["ram_experts"]), _gb(ex["host_bytes"]["experts_ram"])
        )
        table.add_row("experts read when routed", "disk", str(ex["disk_experts"]), _gb(ex["disk_bytes"]))
        if ex.get("cache_experts"):
            cache = _gb(ex["host_bytes"]["expert_cache"])
            table.add_row("their RAM cache (most recently used)", "ram", str(ex["cache_experts"]), cache)
    if held:
        n = ex["ram_experts"] + ex["disk_experts"]
        table.add_row("experts in their layers (resident, RAM)", "ram", f"{ex['ram_experts']} of {n}", "")
        table.add_row("experts read when routed", "disk", f"{ex['disk_experts']} of {n}", "")
        table.add_row("expert cache (most recently used)", "ram", str(ex["cache_experts"]), _gb(ex["cache_bytes"]))
    table.caption = (
        f"{ex['experts']} experts, top-{ex['top_k']}, {ex['sparse_layers']} sparse layers · plain decoding "
        f"{ex['tokens_per_second']:.2f} tok/s modelled"
        + (f" (whole layers streamed: {ex['layers_tokens_per_second']:.2f})" if split or held else "")
        + f" · CPU experts {ex['cpu_bps'] / 1e9:.0f} GB/s ({escape(ex['cpu_source'])}) · {ex['routing']} routing"
    )
    return table
