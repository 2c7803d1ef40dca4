"""Routed experts read on demand, whole layers, and the plan's automatic choice: bytes read and ms per pass,
measured beside modelled, every layer on disk.

Usage: `flock -x /tmp/bench.lock python bench/moe_apart.py [--out bench/results/moe_apart.json] [--dir DIR]
[--experts 24 --top-k 2 --layers 4 --hidden 512 --inter 384] [--tokens 1,8,32] [--rounds 5] [--batch 4]
[--models qwen3_moe,gpt_oss] [--doc]`.

First the hardware probes `specx profile` runs (tools/profiler.probe_hardware over `--dir`: the disk's rate and
per-read latency, memory bandwidth, matmul and kernel rates, MXFP4 dequantization included) give the
passcost.Device the plan is modelled with (session/profiles.cost_device_for). Then each of `--models` in turn: a
seeded Qwen3-MoE checkpoint (default 4 layers of 24 experts of 2.4 MB, top-2, fp32, 0.24 GB, saved by transformers
into `--dir` on the disk, not tmpfs), a seeded gpt-oss of the same shape stored as the published checkpoints are
(its fused experts' matrices MXFP4, 4.25 bits a weight: 0.31 MB an expert, tests/mxfp4_ckpt.py; the rest bf16,
computed in fp32), is planned with `--offload disk` on that Device (memplan.plan_memory; also on the priors
alone, a machine without a profile) and loaded three times with every layer on disk
(`OffloadedCausalLM.from_pretrained(offload="disk")`, the CPU): with its routed experts held apart
(`experts="on-demand"`: each disk layer streams its attention+router part, and the experts its tokens routed to
are read when routed, O_DIRECT, into a cache of one layer's experts; a pass routing to many of them reads the next
layer's experts whole, ahead: stream/expertbulk.py), with whole layers streamed
(`experts="layers"`), and as the plan chose (`memplan=` the plan, experts="auto": the loader follows
plan.experts["mode"]). Each round runs, for each pass size, `--batch` passes of each model on the same fresh random
ids (no KV cache: a pass of n tokens, as a verify pass of an n-token tree), the models interleaved: one model's
passes back to back, all but the first timed (steady state: the stream's read-ahead of a pass overlaps only the
pass before it, as in plain decoding with nothing between passes), then a 0.5 s pause so that its read-ahead does
not run inside the next model's passes. Per pass: ms (perf_counter around the call), the bytes it read
(`stats.streamed_bytes_per_pass`: the dense parts' or whole layers' spans, plus the experts' spans, or the whole
layers' experts read ahead) and the layers whose experts it read whole (`ExpertStore.layers_read_whole`); modelled: the
same pass (no KV cache) in each explicit mode, planning/experts.mode_seconds on that Device. Each pass's greedy id
(its last row) must agree between the three. Reported: the medians over rounds, and the plan's choice with both
modelled tokens/s (profiled and on the priors). Writes JSON; `--doc` rewrites `<!-- bench:moe-apart -->` on the
pages bench/manifest.py lists for it (`block(result)`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from offload import OffloadedCausalLM  # noqa: E402

sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
from docblock import md_table  # noqa: E402  (bench/docblock.py)

MODELS = {"qwen3_moe": "Qwen3-MoE (fp32)", "gpt_oss": "gpt-oss (MXFP4 experts, the rest bf16)"}


def gpt_oss_checkpoint(args) -> Path:
    """A seeded gpt-oss of the same shape stored as the published checkpoints are: its experts' matrices in MXFP4
    (tests/mxfp4_ckpt.py), the rest bf16; written once per shape."""
    import transformers

    from tests.mxfp4_ckpt import write_mxfp4

    path = args.dir / f"gptoss_mxfp4_bf16_e{args.experts}k{args.top_k}l{args.layers}h{args.hidden}i{args.inter}"
    if (path / "config.json").exists():
        return path
    cfg = transformers.GptOssConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        sliding_window=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    src = path.with_name(path.name + "_src")
    transformers.GptOssForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src, safe_serialization=True)
    write_mxfp4(src, path)
    for f in src.iterdir():
        f.unlink()
    src.rmdir()
    return path


def checkpoint(args, model: str = "qwen3_moe") -> Path:
    """The seeded checkpoint of `model` under args.dir (written once per shape)."""
    import transformers

    if model == "gpt_oss":
        return gpt_oss_checkpoint(args)
    path = args.dir / f"qwen3moe_e{args.experts}k{args.top_k}l{args.layers}h{args.hidden}i{args.inter}"
    if (path / "config.json").exists():
        return path
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        moe_intermediate_size=args.inter,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
    return path


def one_pass(m, ids: torch.Tensor) -> tuple[float, int, int, int]:
    """(ms, bytes read, greedy id of the last row, layers whose experts it read whole) of one pass over `ids`."""
    before = m.experts.layers_read_whole if m.experts is not None else 0
    t = time.perf_counter()
    logits = m(input_ids=ids[None], use_cache=False).logits
    ms = 1e3 * (time.perf_counter() - t)
    whole = (m.experts.layers_read_whole if m.experts is not None else 0) - before
    return ms, m.stats.streamed_bytes_per_pass, int(logits[0, -1].argmax()), whole


def interleaved(models: dict, args) -> dict:
    """{(mode, n): [(ms, bytes read, layers read whole)]}: a warm-up pass of each size and model, then `--rounds` rounds of
    `--batch` passes of each model on the same fresh ids, all but the first timed, models interleaved with a
    0.5 s pause between them (see the module docstring); every pass's greedy id must agree across models."""
    gen = torch.Generator().manual_seed(1)
    samples = {(mode, n): [] for mode in models for n in args.tokens}
    for n in args.tokens:  # warm-up: one pass of each size and model
        ids = torch.randint(1, 256, (n,), generator=gen)
        for m in models.values():
            one_pass(m, ids)
    for _ in range(args.rounds):
        for n in args.tokens:
            batch = [torch.randint(1, 256, (n,), generator=gen) for _ in range(args.batch)]
            got = {}
            for mode, m in models.items():
                time.sleep(0.5)
                got[mode] = []
                for b, ids in enumerate(batch):
                    ms, nbytes, top, whole = one_pass(m, ids)
                    got[mode].append(top)
                    if b:
                        samples[(mode, n)].append((ms, nbytes, whole))
            assert all(tops == got[next(iter(got))] for tops in got.values()), (n, got)
    return samples


def profiled_device(args):
    """The passcost.Device `specx profile` would give this machine (its hardware probes: the disk's rate and
    per-read latency under --dir, memory bandwidth, matmul rates, the kernel rates, MXFP4's included), and
    the profile's hardware part."""
    import socket

    from specexec_cli.session.profiles import cost_device_for
    from specexec_cli.tools.profiler import probe_hardware

    hw = probe_hardware(args.dir, 64 << 20)
    return cost_device_for("cpu", None, {"hostname": socket.gethostname(), **hw}), hw


def plans(path: Path, dev) -> tuple:
    """(the plan `--offload disk` makes for `path` with this Device, the one it makes on the priors alone)."""
    import psutil

    from offload.formats import open_checkpoint
    from offload.planning.memplan import PlanRequest, plan_memory

    ck = open_checkpoint(path)
    ram = psutil.virtual_memory().available
    req = PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=ram, offload="disk", cost_device=dev)
    return ck, plan_memory(ck, None, req), plan_memory(ck, None, replace(req, cost_device=None))


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    dev, hw = profiled_device(args)
    runs = [measure(args, model, dev) for model in args.models]
    first = runs[0]
    return dict(
        command="python bench/moe_apart.py " + " ".join(sys.argv[1:]),
        machine=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        load_average=[round(x, 2) for x in os.getloadavg()],
        experts=args.experts,
        top_k=args.top_k,
        layers=args.layers,
        hidden=args.hidden,
        inter=args.inter,
        expert_mb=first["expert_mb"],
        checkpoint_gb=first["checkpoint_gb"],
        cache_experts=first["cache_experts"],
        direct_io=first["direct_io"],
        rounds=args.rounds,
        batch=args.batch,
        device=dict(
            disk_gbps=dev.disk_bps / 1e9,
            disk_read_us=dev.disk_read_s * 1e6,
            memory_gbps=dev.memory_bps / 1e9,
            mxfp4_gbps=dev.dequant_bps.get("mxfp4", 0) / 1e9,
            cpu_experts_gbps=dev.dequant_bps.get("cpu-experts", 0) / 1e9,
            disk_method=hw["disk"]["method"],
        ),
        cells=[c for r in runs for c in r["cells"]],
        models={r["model"]: {k: v for k, v in r.items() if k != "cells"} for r in runs},
    )


MODES = ("on-demand", "layers", "auto")  # explicit: experts apart, whole layers; auto: the plan's choice


def measure(args, model: str, dev) -> dict:
    """One model's cells (each with its `model`), its expert size, checkpoint size, cache and the plans' choices."""
    from offload.planning.experts import mode_seconds
    from offload.planning.membytes import arch_of

    path = checkpoint(args, model)
    ck, plan, prior = plans(path, dev)
    models = {
        mode: OffloadedCausalLM.from_pretrained(
            path, dtype=torch.float32, offload="disk", **({"memplan": plan} if mode == "auto" else {"experts": mode})
        )
        for mode in MODES
    }
    samples = interleaved(models, args)
    apart, a = models["on-demand"].experts, arch_of(ck.config)
    cells = []
    for n in args.tokens:  # modelled: the pass as the bench runs it, no KV cache (ctx 0), fp32
        row = dict(model=model, tokens=n, auto_mode=plan.experts["mode"])
        for mode, key in (("on-demand", "apart"), ("layers", "layers"), ("auto", "auto")):
            ms, nbytes, whole = zip(*samples[(mode, n)])
            row[f"{key}_ms"], row[f"{key}_mb"] = statistics.median(ms), statistics.median(nbytes) / 1e6
            row[f"{key}_whole"] = statistics.median(whole)  # layers whose experts a pass read whole
        for mode, key in (("on-demand", "apart"), ("layers", "layers")):
            row[f"{key}_model_ms"] = 1e3 * mode_seconds(a, plan, dev, n, 0, 4, mode)
        cells.append(row)
        print(json.dumps(row), flush=True)
    direct_io = models["layers"].plan.direct_io
    for m in models.values():
        m.close()
    weights = 3 * args.hidden * args.inter  # gate, up, down of one expert
    figures = ("mode", "on_demand_tokens_per_second", "layers_tokens_per_second")
    return dict(
        model=model,
        expert_mb=weights * (4.25 / 8 if model == "gpt_oss" else 4) / 1e6,  # MXFP4: 4.25 bits a weight
        checkpoint_gb=sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9,
        cache_experts=apart.capacity,
        direct_io=direct_io,
        plan={k: plan.experts[k] for k in figures},
        prior_plan={k: prior.experts[k] for k in figures},
        cells=cells,
    )


def block(result: dict) -> str:
    models = result["models"]
    rows = [
        [
            MODELS[r["model"]],
            r["tokens"],
            f"{r['layers_mb']:.1f}",
            f"{r['apart_mb']:.1f} ({r['apart_whole']:.0f} whole)",
            f"{r['layers_ms']:.0f} ({r['layers_model_ms']:.0f})",
            f"{r['apart_ms']:.0f} ({r['apart_model_ms']:.0f})",
            f"{r['layers_ms'] / r['apart_ms']:.2f}x",
            f"{r['auto_mode']}: {r['auto_ms']:.0f}",
            f"{min(r['layers_ms'], r['apart_ms']) / r['auto_ms']:.2f}x",
        ]
        for r in result["cells"]
    ]
    head = [
        "model",
        "tokens per pass",
        "MB read: whole layers",
        "experts apart (layers read whole)",
        "ms measured (modelled): whole layers",
        "experts apart",
        "apart speed-up",
        "automatic: plan's choice, ms",
        "auto vs best explicit",
    ]
    d = result["device"]
    io = "O_DIRECT" if result["direct_io"] else "buffered reads"
    what = " and ".join(
        f"{MODELS[name]}, experts of {m['expert_mb']:.2f} MB ({m['checkpoint_gb']:.2f} GB)"
        for name, m in models.items()
    )
    choices = "; ".join(
        f"{MODELS[name]}: {m['plan']['mode']} ({m['plan']['on_demand_tokens_per_second']:.1f} tok/s apart against "
        f"{m['plan']['layers_tokens_per_second']:.1f} whole, modelled), on the priors alone {m['prior_plan']['mode']} "
        f"({m['prior_plan']['on_demand_tokens_per_second']:.1f} against {m['prior_plan']['layers_tokens_per_second']:.1f})"
        for name, m in models.items()
    )
    return (
        f"`{result['command']}` on this CPU ({result['threads']} threads, load average {result['load_average'][0]} "
        f"when it finished): seeded models of {result['layers']} layers x {result['experts']} experts "
        f"(top-{result['top_k']}, hidden {result['hidden']}, expert intermediate {result['inter']}), {what}, every "
        f"layer on disk ({io}), the experts apart with a cache of {result['cache_experts']} experts (one layer's; a pass "
        f"routing to many reads the next layer's experts whole, ahead), "
        f'whole layers streamed, and the automatic choice (`--offload disk`\'s plan, experts="auto"), the three '
        f"interleaved, medians of {result['rounds']} rounds x {result['batch'] - 1} passes back to back. Modelled "
        f"(in brackets): planning/experts.mode_seconds of the same pass (no KV cache) on the Device `specx profile`'s "
        f"probes give this machine (disk {d['disk_gbps']:.2f} GB/s and {d['disk_read_us']:.0f} us a read, MXFP4 "
        f"dequantization {d['mxfp4_gbps']:.2f} GB/s, CPU experts {d['cpu_experts_gbps']:.2f} GB/s). The plan's "
        f"choice: {choices}.\n\n" + md_table(head, rows)
    )


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "moe_apart.json")
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "specx-bench")
    ap.add_argument("--experts", type=int, default=24)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=384)
    ap.add_argument("--tokens", type=ints, default=[1, 8, 32])
    ap.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS), help="qwen3_moe,gpt_oss")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4, help="back-to-back passes per model, the first untimed")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--doc", action="store_true", help="rewrite <!-- bench:moe-apart --> from the JSON")
    args = ap.parse_args()
    result = run(args)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(block(result))
    if args.doc:
        import manifest  # bench/manifest.py: the block's pages

        manifest.write("moe-apart", block(result))


if __name__ == "__main__":
    main()
