"""The mixture-of-experts plan tables of docs/memory-plan.md (`<!-- bench:plan-moe -->`, rendered by
tools/plan_tables.py, which imports `moe_block` from here).

Contract: `moe_block()` is two tables of offload.planning's figures for the MoE targets of MOE (sparse
checkpoints with real headers, tests/sparse_moe.py; every tok/s plain decoding and modelled):
1. each target planned for a 24 GB card with 64 and 128 GB of RAM (bf16, ctx 8192, no profile: prior
   rates): its expert placement (offload/planning/experts.py) and tok/s in bf16, with whole layers
   streamed, and in the format of the quoted runs (FORMAT_BITS: the experts' bits and the rest's);
2. each quoted run of PUBLISHED (issue 55's figures) modelled on its own card (CARDS or
   profiles/cards.json: spec-sheet bandwidth, PCIe and FLOP/s, `--max-gpu-memory` its size) with the
   RAM its source states (else room for every expert, said so), in its format, the routed experts not
   cached on the card read on the CPU at experts.CPU_EXPERTS' rate: the modelled tok/s, whether it is
   at, above or below the quoted figure, and the CPU read rate at which the model reaches the quoted
   figure (`needed_rate`; where no read rate does, the most any rate models and why).
Nothing is tuned to the quoted figures: they are printed beside the model's, never fed into it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
from docblock import md_table  # noqa: E402  (bench/docblock.py)

from offload.planning.experts import CPU_EXPERTS, CPU_READ_SHARE, DDR5_DESKTOP_PEAK  # noqa: E402
from offload.planning.passcost import PRIORS  # noqa: E402

CPU_EXPERTS_BPS = CPU_EXPERTS["bps"]  # the CPU read rate the machine rows assume (a DDR5 desktop's, a prior)
GB = 1e9
MOE = ("gpt-oss-120b", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b")  # tests/fixtures/configs names
FORMAT_BITS = {  # name -> (experts' bits per weight, attention/shared matrices' bits or None: 16-bit) of the runs quoted
    "gpt-oss-120b": (4.25, None),  # MXFP4 (32 4-bit codes + one 8-bit scale); the checkpoint keeps the rest bf16
    "qwen3-30b-a3b": (4.5, 4.5),  # Q4_K (256 weights in 144 bytes), every matrix of the GGUF
    "qwen3-235b-a22b": (4.5, 4.5),
    "mixtral-8x7b": (4.5, 4.5),
}
# the quoted runs' cards not in profiles/cards.json (the 3090 is), in its fields, from NVIDIA's Blackwell and Turing
# whitepapers: memory, its bandwidth, the PCIe generation, dense FP16 tensor TFLOP/s with FP32 accumulate, FP32
CARDS = {
    "RTX 5090": dict(memory_gib=32, memory_gbps=1792, pcie_gen=5, tensor16_tflops=209.5, fp32_tflops=104.8),
    "RTX 2080": dict(memory_gib=8, memory_gbps=448, pcie_gen=3, tensor16_tflops=40.3, fp32_tflops=10.1),
}


class Published(NamedTuple):
    """One published run, quoted (issue 55), and the machine it names."""

    name: str  # MOE name
    low: float  # tok/s, the quoted range (low == high: one figure)
    high: float
    figure: str  # as quoted, with the program and the machine
    card: str  # CARDS key, or a profiles/cards.json name
    ram_gb: int | None  # RAM the source states; None: not stated (room for every expert assumed)
    dtype: str  # the card's 16-bit compute dtype (Turing has no bf16)


PUBLISHED = (
    Published(
        "gpt-oss-120b", 37, 44, "37-44 tok/s: llama.cpp --n-cpu-moe, RTX 5090 + 64 GB DDR5", "RTX 5090", 64, "bf16"
    ),
    Published(
        "qwen3-30b-a3b",
        36.7,
        36.7,
        "36.7 tok/s: llama.cpp, every expert on the CPU, RTX 2080",
        "RTX 2080",
        None,
        "fp16",
    ),
    Published("qwen3-235b-a22b", 10, 10, "~10 tok/s: ktransformers, RTX 3090", "RTX 3090", None, "bf16"),
)


def gb(n: float) -> str:
    return "0" if n == 0 else f"{n / GB:.1f}"


def _moe_ckpt(name: str, root: Path):
    from tests.sparse_ckpt import read_checkpoint
    from tests.sparse_moe import write_sparse_moe

    return read_checkpoint(write_sparse_moe(name, root / name))


def moe_plans(ck, name: str) -> list[tuple[int, dict, dict]]:
    """(RAM GB, plan.experts in bf16, plan.experts in the quoted runs' format) for 64 and 128 GB of RAM."""
    from offload.planning.experts import expert_plan
    from offload.planning.membytes import arch_of
    from offload.planning.memlayers import layer_sizes
    from offload.planning.memplan import PlanRequest, plan_memory

    bits, dense_bits = FORMAT_BITS[name]
    out = []
    for ram in (64, 128):
        req = PlanRequest("cuda", "bf16", None, ram * 10**9, max_gpu_memory=24 * 10**9, ctx=8192)
        plan = plan_memory(ck, None, req)
        lay = layer_sizes(ck, arch_of(ck.config), req)
        out.append((ram, plan.experts, expert_plan(ck, lay, req, plan, bits=bits, dense_bits=dense_bits)))
    return out


def _bits(name: str) -> str:
    bits, dense_bits = FORMAT_BITS[name]
    return f"{bits} bits" + (f", the rest {dense_bits}" if dense_bits else ", the rest bf16")


def placement(ex: dict) -> str:
    """Where a plan.experts puts the experts: card cache / RAM / disk, with the card's attention+shared part."""
    if ex["mode"] != "split":
        return "whole layers (the split does not fit or models slower)"
    dev, n = ex["device_bytes"], ex["gpu_experts"] + ex["ram_experts"] + ex["disk_experts"]
    return (
        f"card {gb(dev['attention_shared'])} GB attention+shared, {ex['gpu_experts']} of {n} experts "
        f"({gb(dev['expert_cache'])} GB); RAM {ex['ram_experts']} ({gb(ex['host_bytes']['experts_ram'])} GB); "
        f"disk {ex['disk_experts']} ({gb(ex['disk_bytes'])} GB)"
    )


MOE_HEAD = ["model", "RAM", "experts (top-k)", "card: attention+shared / expert cache", "RAM experts"]
MOE_HEAD += ["disk experts", "tok/s bf16, modelled", "whole layers, modelled", "tok/s in the quoted format, modelled"]


def moe_table(rows: list[tuple[str, int, dict, dict]]) -> str:
    out = []
    for name, ram, ex, q in rows:
        n = ex["gpu_experts"] + ex["ram_experts"] + ex["disk_experts"]
        dev = ex["device_bytes"]
        out.append(
            [name, f"{ram} GB", f"{ex['experts']} x {ex['sparse_layers']} layers (top-{ex['top_k']})"]
            + [f"{gb(dev['attention_shared'])} GB / {gb(dev['expert_cache'])} GB ({ex['gpu_experts']} of {n})"]
            + [f"{ex['ram_experts']} ({gb(ex['host_bytes']['experts_ram'])} GB)"]
            + [f"{ex['disk_experts']} ({gb(ex['disk_bytes'])} GB)", f"{ex['tokens_per_second']:.2f}"]
            + [f"{ex['layers_tokens_per_second']:.2f}", f"{q['tokens_per_second']:.1f} ({_bits(name)})"]
        )
    return md_table(MOE_HEAD, out)


def machine_device(pub: Published, cpu_bps: float):
    """(passcost.Device of the quoted run's card from its spec sheet with routed experts read on the CPU
    at `cpu_bps`, the card's row)."""
    from offload.planning import LINK_EFFICIENCY, device_for
    from specexec_cli.session.profiles import PCIE_X16_GBPS, card

    row = CARDS.get(pub.card) or card(pub.card)
    given = dict(
        memory_bps=row["memory_gbps"] * 1e9,
        link_bps=LINK_EFFICIENCY * PCIE_X16_GBPS[row["pcie_gen"]] * 1e9,
        flops16=row["tensor16_tflops"] * 1e12,
        flops32=row["fp32_tflops"] * 1e12,
    )
    sources = {k: f"published: {pub.card}" for k in given} | {"dequant": f"{cpu_bps / 1e9:.0f} GB/s assumed"}
    return device_for("cuda", sources, {"cpu-experts": cpu_bps}, **given), row


def machine_plans(pub: Published, ck) -> tuple[int, Callable[[float], dict]]:
    """(RAM GB, cpu_bps -> plan.experts in the quoted format on the quoted run's card and RAM, the routed
    experts read on the CPU at cpu_bps). RAM the source does not state: room for every expert."""
    from offload.planning.experts import expert_plan, moe_shape
    from offload.planning.membytes import arch_of
    from offload.planning.memlayers import layer_sizes
    from offload.planning.memplan import PlanRequest, plan_memory
    from offload.planning.request import RAM_FRACTION

    bits, dense_bits = FORMAT_BITS[pub.name]
    dev, row = machine_device(pub, CPU_EXPERTS_BPS)
    req = PlanRequest("cuda", pub.dtype, None, 0, max_gpu_memory=row["memory_gib"] * 10**9, ctx=8192)
    lay = layer_sizes(ck, arch_of(ck.config), req)
    shape = moe_shape(ck, lay, req, bits)
    experts = shape.experts * sum(shape.expert_bytes)  # every expert's bytes in the quoted format
    ram = pub.ram_gb or 16 * (math.ceil(experts / RAM_FRACTION / 16e9) + 1)  # 16 GB steps, one spare
    req = dataclasses.replace(req, ram_free=ram * 10**9, cost_device=dev)
    plan = plan_memory(ck, None, req)

    def at(cpu_bps: float) -> dict:
        r = dataclasses.replace(req, cost_device=machine_device(pub, cpu_bps)[0])
        return expert_plan(ck, lay, r, plan, bits=bits, dense_bits=dense_bits)

    return ram, at


def needed_rate(at: Callable[[float], dict], tps: float) -> tuple[float | None, float]:
    """(the CPU read rate, bytes/s within 1 GB/s..10 TB/s, at which `at` models `tps` tok/s, or None where
    even 10 TB/s models slower; the tok/s `at` models at 10 TB/s). Bisection in log space: the modelled
    speed grows with the rate."""
    lo, hi = 1e9, 1e13
    cap = at(hi)["tokens_per_second"]
    if cap < tps:
        return None, cap
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if at(mid)["tokens_per_second"] < tps else (lo, mid)
    return hi, cap


def verdict(tps: float, pub: Published) -> str:
    return "below" if tps < pub.low else "above" if tps > pub.high else "at"


MACHINE_HEAD = ["model", "quoted run", "RAM", "format (experts, the rest)", "placement", "CPU experts read at"]
MACHINE_HEAD += ["tok/s, modelled", "against the quoted figure", "CPU read rate the quoted figure needs"]


def machine_table(rows: list[tuple[Published, int, dict, float | None, float]]) -> str:
    out = []
    for pub, ram, ex, need, cap in rows:
        tps = ex["tokens_per_second"]
        if need is None:  # what is left at any read rate: the CPU's FLOPs and the GPU's side of the pass
            need_text = f"none: at most {cap:.1f} tok/s at any read rate (the CPU FLOP/s prior and the pass floor)"
        else:
            need_text = f"{need / 1e9:.0f} GB/s"
        out.append(
            [pub.name, pub.figure, f"{ram} GB" + ("" if pub.ram_gb else " (not stated: room for every expert)")]
            + [_bits(pub.name), placement(ex), f"{ex['cpu_bps'] / 1e9:.0f} GB/s"]
            + [f"{tps:.1f}", f"{verdict(tps, pub)} ({tps / pub.low:.2f}x of {pub.low:g})", need_text]
        )
    return md_table(MACHINE_HEAD, out)


@functools.lru_cache(maxsize=1)
def moe_block() -> str:
    """The body of `<!-- bench:plan-moe -->`: the mixture-of-experts targets on a 24 GB card, then each
    quoted run's model on its own card in its own format, beside the quoted figure."""
    with tempfile.TemporaryDirectory() as d:
        cks = {name: _moe_ckpt(name, Path(d)) for name in MOE}
        card = moe_table([(name, ram, ex, q) for name in MOE for ram, ex, q in moe_plans(cks[name], name)])
        rows = []
        for pub in PUBLISHED:
            ram, at = machine_plans(pub, cks[pub.name])
            rows.append((pub, ram, at(CPU_EXPERTS_BPS), *needed_rate(at, pub.low)))
    caption = (
        f"On the quoted runs' cards (spec-sheet bandwidth and FLOP/s, `--max-gpu-memory` their size), in "
        f"their formats: the routed experts not cached on the card are read on the CPU at "
        f"{CPU_EXPERTS_BPS / 1e9:.0f} GB/s (experts.CPU_EXPERTS: CPU_READ_SHARE {CPU_READ_SHARE} of a DDR5-5000 "
        f"dual-channel desktop's {DDR5_DESKTOP_PEAK / 1e9:.0f} GB/s peak) and multiplied at "
        f"{CPU_EXPERTS['flops'] / 1e9:.0f} GFLOP/s (a prior), and every pass pays specx's "
        f"{PRIORS['cuda']['forward_floor_s'] * 1e3:.0f} ms forward floor on CUDA (passcost.PRIORS):"
    )
    return card + "\n\n" + caption + "\n\n" + machine_table(rows)
