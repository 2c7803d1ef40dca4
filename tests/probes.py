"""Test-side probes on an OffloadedCausalLM, put on from outside: the product code has no hook.

- `after_each_layer(model, fn)`: fn(i) right after decoder layer i runs (a torch forward hook on each
  of `model.layers`), where the product's layer loop ran it; returns `remove()`. The one-call C
  stack (offload/cpu/leanstack.py) runs no layer module, so on a model that has one the test
  turns it off first ($SPECX_DECODE_STACK=off, read per pass); `after_each_layer` refuses otherwise.
- `before_each_read(model, fn)`: fn(layer) on the read thread before each streamed layer's read
  stage (it wraps the prefetcher's read callable; every read goes through the read thread while it
  is on, as a slow real read would); returns `remove()`.
- `count_stack_passes(monkeypatch)`: `passes(lean)`, the passes LeanStack `lean` ran since (it wraps
  LeanStack._advance, which runs once at the end of every pass on the stack); 0 for None.
- `count_kernel_calls(monkeypatch)`: a list that grows by one per `ggml_kernel.linear` call that
  returned (the GGUF kernel ran); every caller looks `linear` up on the module at call time.
- `unfuse(layer)`: detach every qfuse.FusedGroup of a layer, so each linear computes alone again.
- `undensify(layer, pool)`: drop what quant/dense.densify kept of a layer (its pool bytes too), so
  the per-forward dequantization runs again.
"""

from __future__ import annotations

from collections.abc import Callable


def after_each_layer(model, fn: Callable[[int], object]) -> Callable[[], None]:
    from offload.cpu import leanstack

    if getattr(model, "lean", None) is not None and not leanstack._off():
        raise AssertionError("the model runs the C stack (no layer module is called): set SPECX_DECODE_STACK=off")

    def hook(i):
        def after(_module, _args, _out):
            fn(i)  # the hook's return value would replace the layer's output: dropped

        return after

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(model.layers)]

    def remove() -> None:
        for h in handles:
            h.remove()

    return remove


def before_each_read(model, fn: Callable[[int], object]) -> Callable[[], None]:
    pf = model.prefetcher
    read, is_free = pf.read, pf.is_free

    def slow_read(layer, h):
        fn(layer)
        return read(layer, h)

    pf.read, pf.is_free = slow_read, None

    def remove() -> None:
        pf.read, pf.is_free = read, is_free

    return remove


def count_kernel_calls(monkeypatch) -> list:
    from offload.cpu import ggml_kernel

    calls: list = []
    linear = ggml_kernel.linear

    def counted(*args, **kwargs):
        y = linear(*args, **kwargs)
        calls.append(None)
        return y

    monkeypatch.setattr(ggml_kernel, "linear", counted)
    return calls


def count_stack_passes(monkeypatch) -> Callable[[object], int]:
    from offload.cpu.leanstack import LeanStack

    counts: dict[int, int] = {}
    orig = LeanStack._advance

    def advance(self, keep, jobs):
        counts[id(self)] = counts.get(id(self), 0) + 1
        return orig(self, keep, jobs)

    monkeypatch.setattr(LeanStack, "_advance", advance)
    return lambda lean: 0 if lean is None else counts.get(id(lean), 0)


def unfuse(layer) -> None:
    for mod in layer.modules():
        if getattr(mod, "group", None) is not None:
            mod.group = None


def undensify(layer, pool) -> None:
    from offload.quant.dense import COMPONENT, dense_linears

    for _, mod in dense_linears(layer):
        if mod.dense is not None:
            pool.free(COMPONENT, mod.dense)
            mod.dense = None
