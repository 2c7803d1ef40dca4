"""specx's own CPU kernels against the torch paths it chose not to use, on SmolLM2-135M's layer shapes.

Run by hand (not a test), under the bench lock:
`flock -x /tmp/bench.lock python bench/cpu_runtime.py [--threads 1] [--reps 20] [--layers 30]
 [--out bench/results/cpu_runtime.json] [--doc] [--table JSON]`.
Contract: one decoder layer of SmolLM2-135M's shapes (hidden 576, 9 query / 3 KV heads of 64, MLP 1536),
random weights (Q4_1 blocks as bench/gguf_kernel.py makes them; every other path holds the same
weights: the fp32 ones are their dequantization, torch's int4 ones their codes with scale d and zero
m + 8 d), timed on `--threads` torch threads at T = 1 and T = 5 tokens over a 32-token KV context:
- the layer's seven linears (q, k, v, o, gate, up, down; one call each) through (a) specx's kernel
  (ggml_kernel.linear on the Q4_1 bytes), (b) torch's int4 CPU op (`_weight_int4pack_mm_for_cpu`,
  `_convert_weight_to_int4pack_for_cpu`, group size 32; rows saying why where this torch lacks it)
  with fp32 activations (fp32 throughout, as specx computes) and with bf16 ones (x, the scales and
  the output in bf16: the op's fast path, not specx's exact-fp32 numbers), (c) dense fp32 F.linear;
- the whole layer: (d) transformers' LlamaDecoderLayer (fp32 weights, SDPA) eager and under
  `torch.compile` (default mode, one compiled function for every layer; its first call per T, on a
  fresh inductor cache, is the compile time, reported apart), and specx's one-call stack
  (kernels/decode_stack.c through offload/cpu/leanstack.py's structs: q|k|v and gate|up each one
  Q4_1 segment, as formats/qfuse.py stacks a file's).
Each timing is the median over `--reps` passes of a pass through `--layers` distinct layers (as a
decode step reads its weights from memory, not a warm cache), divided by the layers: ms per layer.
Layer outputs are checked against the eager layer's (largest absolute difference, in the JSON).
JSON to --out (the command, threads, versions, load average); a markdown table on stdout, and with
--doc in docs/performance.md's `<!-- bench:cpu-runtime -->` block (bench/manifest.py).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # after the package: bench/offload.py must not shadow offload/

from gguf_kernel import random_blocks  # noqa: E402

from offload.cpu import ggml_kernel, leanstack  # noqa: E402
from offload.formats import gguf_quants as gq  # noqa: E402

D, H, HKV, HD, FF = 576, 9, 3, 64, 1536  # SmolLM2-135M: hidden, heads, KV heads, head dim, MLP width
LINEARS = {"q": (H * HD, D), "k": (HKV * HD, D), "v": (HKV * HD, D), "o": (D, H * HD)}
LINEARS |= {"gate": (FF, D), "up": (FF, D), "down": (D, FF)}  # name -> (out, in)
PAST, ROWS, GROUP, EPS = 32, (1, 5), 32, 1e-5
PATHS = {  # row key -> (what, weights, the row its ratio is taken against)
    "kernel": ("7 linears: specx kernel (`ggml_kernel.linear`)", "Q4_1", "kernel"),
    "int4": ("7 linears: torch int4 (`_weight_int4pack_mm_for_cpu`, group 32), fp32 activations", "int4", "kernel"),
    "int4_bf16": ("7 linears: torch int4, bf16 activations, scales and outputs", "int4", "kernel"),
    "dense": ("7 linears: dense `F.linear`", "fp32", "kernel"),
    "stack": ("decoder layer: specx one-call stack (`decode_stack.c`)", "Q4_1", "stack"),
    "eager": ("decoder layer: HF `LlamaDecoderLayer`, eager", "fp32", "stack"),
    "compiled": ("decoder layer: HF `LlamaDecoderLayer`, `torch.compile`", "fp32", "stack"),
}


def q4_1_fields(raw: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 bytes -> codes (n, k) int32, d and m (n, k/32) fp32: block = fp16 d, fp16 m, 16 bytes whose
    byte i holds value i (low nibble) and value i + 16 (high nibble); w = d * code + m."""
    b = raw.view(n, k // 32, 20)
    d = b[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    m = b[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
    nib = b[..., 4:].to(torch.int32)
    codes = torch.cat([nib & 0xF, nib >> 4], dim=-1)  # (n, k/32, 32): values 0-15, then 16-31
    return codes.reshape(n, k), d, m


def int4_reason() -> str | None:
    """None when this torch has the int4 CPU op pair, else why the row is skipped."""
    ops = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")
    missing = [o for o in ops if not hasattr(torch.ops.aten, o)]
    return f"torch {torch.__version__} lacks aten.{', aten.'.join(missing)}" if missing else None


def to_int4(raw: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Q4_1 weight in torch's int4 layout: dequant = (code - 8) * scale + zero, so scale = d and
    zero = m + 8 d give d * code + m; packed codes, scales and zeros (k/32, n, 2) in fp32 and bf16
    (the op takes them in the activations' dtype)."""
    codes, d, m = q4_1_fields(raw, n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_zeros, scales_zeros.bfloat16()


def make_layers(count: int, with_int4: bool) -> list[dict]:
    """`count` layers of random Q4_1 weights, each with its fp32 dequantization, its int4 form, norm
    weights and a 32-row K/V context (1, HKV, PAST, HD)."""
    layers = []
    for i in range(count):
        raw = {name: random_blocks(gq.Q4_1, n, k, seed=100 * i + j) for j, (name, (n, k)) in enumerate(LINEARS.items())}
        lay = {"raw": raw, "dense": {name: gq.dequantize(raw[name], gq.Q4_1, LINEARS[name]) for name in raw}}
        lay["int4"] = {name: to_int4(raw[name], *LINEARS[name]) for name in raw} if with_int4 else None
        g = torch.Generator().manual_seed(i)
        lay["norms"] = [1 + 0.1 * torch.randn(D, generator=g) for _ in range(2)]
        lay["kv"] = [torch.randn(1, HKV, PAST, HD, generator=g) for _ in range(2)]
        layers.append(lay)
    return layers


def per_layer_ms(passes: dict, reps: int, layers: int) -> dict:
    """Median ms per layer of each `passes[key]()` (a pass through every layer) over `reps` passes after
    two, the paths taken in turns, each round in another order, so a busy moment costs all of them."""
    keys, times = list(passes), {key: [] for key in passes}
    for rep in range(reps + 2):
        for key in keys[rep % len(keys) :] + keys[: rep % len(keys)]:
            t = time.perf_counter()
            passes[key]()
            if rep >= 2:
                times[key].append(time.perf_counter() - t)
    return {key: statistics.median(ts) * 1e3 / layers for key, ts in times.items()}


def linear_passes(layers: list[dict], t: int) -> dict:
    """A pass of each linears path: every layer's seven linears on fixed (t, in) inputs."""
    xs = {name: torch.randn(t, k, generator=torch.Generator().manual_seed(k)) for name, (_, k) in LINEARS.items()}

    def kernel():
        for lay in layers:
            for name, (n, _) in LINEARS.items():
                ggml_kernel.linear(xs[name], lay["raw"][name], gq.Q4_1, n)

    def dense():
        for lay in layers:
            for name in LINEARS:
                F.linear(xs[name], lay["dense"][name])

    def int4(bf16: bool):
        def go():
            for lay in layers:
                for name in LINEARS:
                    int4_linear(xs[name], lay, name, bf16)

        return go

    has = layers[0]["int4"] is not None
    return {"kernel": kernel, "dense": dense, "int4": has and int4(False), "int4_bf16": has and int4(True)}, xs


def int4_linear(x: torch.Tensor, lay: dict, name: str, bf16: bool) -> torch.Tensor:
    """x W^T through torch's int4 op: fp32 throughout, or x, scales and the output in bf16."""
    packed, sz32, sz16 = lay["int4"][name]
    if bf16:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, GROUP, sz16)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz32)


class Prefix:
    """The cache a layer's attention updates: its fixed 32-row context, the new rows appended (not kept)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def update(self, k, v, layer_idx, *args, **kwargs):
        return torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)


def hf_layers(layers: list[dict]):
    """transformers' LlamaDecoderLayer for each layer, over its fp32 weights; the rotary module."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=HKV, head_dim=HD,
                      intermediate_size=FF, rms_norm_eps=EPS, num_hidden_layers=1, vocab_size=64)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    mods = []
    for lay in layers:
        mod = LlamaDecoderLayer(cfg, layer_idx=0).eval()
        at, mlp = mod.self_attn, mod.mlp
        for name, lin in zip(
            LINEARS, (at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        ):
            lin.weight = torch.nn.Parameter(lay["dense"][name], requires_grad=False)
        mod.input_layernorm.weight.data.copy_(lay["norms"][0])
        mod.post_attention_layernorm.weight.data.copy_(lay["norms"][1])
        mods.append((mod, Prefix(*lay["kv"])))
    return mods, LlamaRotaryEmbedding(cfg)


def run_layer(mod, h, cos, sin, mask, cache):
    """One decoder layer over h (1, t, D): the positional call both transformers 4.x and 5.x accept."""
    out = mod(h, mask, None, cache, False, (cos, sin))
    return out[0] if isinstance(out, tuple) else out


class Stack:
    """decode_stack_lanes over every layer in one call, through leanstack's ctypes structs."""

    def __init__(self, layers: list[dict]):
        self.fn, self.keep = leanstack._function(), []
        self.dims = leanstack._Dims(D, H, HKV, HD, FF, EPS, HD**-0.5)
        self.structs = (leanstack._Layer * len(layers))()
        for s, lay in zip(self.structs, layers):
            raw = lay["raw"]
            qkv, gu = torch.cat([raw["q"], raw["k"], raw["v"]]), torch.cat([raw["gate"], raw["up"]])  # qfuse's stacking
            slabs = [torch.zeros(1, HKV, PAST + max(ROWS), HD) for _ in range(2)]
            for slab, ctx in zip(slabs, lay["kv"]):
                slab[:, :, :PAST] = ctx
            self.keep += [qkv, gu, *slabs]
            s.attn_norm, s.ffn_norm = lay["norms"][0].data_ptr(), lay["norms"][1].data_ptr()
            for seg, (buf, rows) in zip(
                (s.qkv[0], s.o, s.gu[0], s.down),
                ((qkv, (H + 2 * HKV) * HD), (raw["o"], D), (gu, 2 * FF), (raw["down"], D)),
            ):
                seg.w, seg.map, seg.type, seg.rows = buf.data_ptr(), None, gq.Q4_1, rows
            s.k, s.v, s.cap, s.past = slabs[0].data_ptr(), slabs[1].data_ptr(), PAST + max(ROWS), PAST

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layers: int | None = None):
        """h (1, t, D) after the layers (causal over the context and the t new rows); h is not written."""
        out = h[0].contiguous().clone()
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        lane = leanstack._LaneT(ctypes.addressof(self.structs), out.shape[0], cos.data_ptr(), sin.data_ptr(), None, 0)
        n = layers or len(self.structs)
        rc = self.fn(
            ctypes.addressof(lane), 1, n, ctypes.addressof(self.dims), out.data_ptr(), torch.get_num_threads(), 0
        )
        if rc != 0:
            raise RuntimeError(f"decode_stack failed ({rc})")
        return out[None]


def causal_mask(t: int) -> torch.Tensor:
    """(1, 1, t, PAST + t) additive: the context visible to every new token, the new ones causally."""
    m = torch.zeros(1, 1, t, PAST + t)
    m[..., PAST:] = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
    return m


def weight_bytes(lay: dict) -> dict:
    """Bytes of one layer's weights as each path reads them."""
    q4 = sum(r.numel() for r in lay["raw"].values())
    fp32 = sum(4 * n * k for n, k in LINEARS.values())
    int4 = {  # the scales and zeros in fp32 or in bf16
        key: sum(p.numel() + size * sz.numel() for p, sz, _ in lay["int4"].values()) if lay["int4"] else None
        for key, size in (("int4", 4), ("int4_bf16", 2))
    }
    return {"kernel": q4, "stack": q4, **int4, "dense": fp32, "eager": fp32, "compiled": fp32}


def measure_t(t: int, layers, mods, rotary, stack, compiled, reps: int) -> tuple[dict, float, dict]:
    """ms per layer of every path at t tokens, the compile time of the first compiled call, and the
    largest absolute differences from the fp32 reference (linears: F.linear; layers: the eager one)."""
    passes, xs = linear_passes(layers, t)
    h = torch.randn(1, t, D, generator=torch.Generator().manual_seed(t))
    cos, sin = rotary(h, torch.arange(PAST, PAST + t)[None])
    mask = causal_mask(t)
    start = time.perf_counter()
    first = compiled(mods[0][0], h, cos, sin, mask, mods[0][1])
    compile_s = time.perf_counter() - start

    def hf_pass(fn):
        def go():
            x = h
            for mod, cache in mods:
                x = fn(mod, x, cos, sin, mask, cache)

        return go

    passes |= {"stack": lambda: stack(h, cos, sin), "eager": hf_pass(run_layer), "compiled": hf_pass(compiled)}
    ms = per_layer_ms({key: fn for key, fn in passes.items() if fn}, reps, len(layers))
    ref = run_layer(mods[0][0], h, cos, sin, mask, mods[0][1])
    lay = layers[0]
    diff = {
        "stack": (stack(h, cos, sin, layers=1) - ref).abs().max().item(),
        "compiled": (first - ref).abs().max().item(),
    }
    dense = {name: F.linear(xs[name], lay["dense"][name]) for name in LINEARS}
    diff["kernel"] = max(
        (ggml_kernel.linear(xs[name], lay["raw"][name], gq.Q4_1, LINEARS[name][0]) - dense[name]).abs().max().item()
        for name in LINEARS
    )
    for key, bf16 in (("int4", False), ("int4_bf16", True)) if lay["int4"] is not None else ():
        diff[key] = max(
            (int4_linear(xs[name], lay, name, bf16).float() - dense[name]).abs().max().item() for name in LINEARS
        )
    return ms, compile_s, diff


def measure(reps: int, count: int) -> dict:
    if not ggml_kernel.enabled() or leanstack._function() is None:
        raise SystemExit(f"the GGUF kernel is not built: {ggml_kernel.kernel_status()}")
    why_int4 = int4_reason()
    layers = make_layers(count, why_int4 is None)
    mods, rotary = hf_layers(layers)
    stack, compiled = Stack(layers), torch.compile(run_layer)  # default mode
    ms, compile_s, diffs = {}, {}, {}
    for t in ROWS:
        ms[t], compile_s[str(t)], diffs[str(t)] = measure_t(t, layers, mods, rotary, stack, compiled, reps)
    sizes = weight_bytes(layers[0])
    rows = []
    for key, (path, weights, against) in PATHS.items():
        row = {"key": key, "path": path, "weights": weights, "bytes_per_layer": sizes[key], "against": against}
        if key.startswith("int4") and why_int4:
            row["skipped"] = why_int4
        else:
            row["ms"] = {str(t): round(ms[t][key], 4) for t in ROWS}
        rows.append(row)
    return {"rows": rows, "compile_s": {t: round(s, 2) for t, s in compile_s.items()}, "max_abs_diff": diffs}


def table(data: dict) -> str:
    """The markdown block: one row a path, ms per layer at each T and the ratio to specx's own path."""
    ts = [str(t) for t in data["rows_t"]]
    by_key = {r["key"]: r for r in data["rows"]}
    head = ["path", "weights a layer reads"] + [f"T = {t}, ms / layer" for t in ts] + [f"÷ specx, T = {t}" for t in ts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["rows"]:
        size = f"{r['bytes_per_layer'] / 1e6:.1f} MB {r['weights']}" if r["bytes_per_layer"] else r["weights"]
        if "skipped" in r:
            cells = [r["path"], size, f"skipped: {r['skipped']}"] + [""] * (2 * len(ts) - 1)
        else:
            base = by_key[r["against"]]["ms"]
            cells = [r["path"], size] + [f"{r['ms'][t]:.3f}" for t in ts]
            cells += [f"{r['ms'][t] / base[t]:.2f}x" for t in ts]
        lines.append("| " + " | ".join(cells) + " |")
    comp = ", ".join(f"{s:.1f} s at T = {t}" for t, s in data["compile_s"].items())
    diff = data["max_abs_diff"][ts[-1]]
    lines.append("")
    lines.append(
        f"`torch.compile`'s first call per T (the compile, fresh inductor cache): {comp}. Largest |difference| "
        f"at T = {ts[-1]} from the fp32 reference: "
        + ", ".join(f"{k} {v:.1e}" for k, v in diff.items())
        + f". {data['threads']} thread{'s' if data['threads'] != 1 else ''}, {data['layers']} layers cycled, a {data['past']}-token context; "
        f"torch {data['torch']}, transformers {data['transformers']}; `{data['command']}`."
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=30, help="distinct layers a pass cycles through")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_runtime.json")
    ap.add_argument("--doc", action="store_true", help="write docs/performance.md's block from the result")
    ap.add_argument("--table", type=Path, metavar="JSON", help="write the block from this result, measure nothing")
    args = ap.parse_args(argv)
    if args.table:
        data = json.loads(args.table.read_text())
    else:
        import transformers

        torch.set_num_threads(args.threads)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cpu-runtime-inductor-")  # a cold compile
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        data = {
            "command": "python bench/cpu_runtime.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "commit": commit.stdout.strip(),
            "threads": args.threads,
            "layers": args.layers,
            "past": PAST,
            "rows_t": list(ROWS),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "loadavg_before": os.getloadavg(),
        }
        with torch.inference_mode():
            data |= measure(args.reps, args.layers)
        data["loadavg_after"] = os.getloadavg()
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))
    if args.doc or args.table:
        import manifest  # bench/manifest.py: the block's pages

        manifest.write("cpu-runtime", table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
