"""Every tensor handed to a decoder layer starts on a 256-byte boundary, in every tier and dtype.

Why: CUDA kernels that load 128-bit vectors (bitsandbytes' 4-bit kernels among them) fault with
`misaligned address` on pointers that are not 16-byte aligned; safetensors packs tensors back to
back, so file-layout views (the disk tier's zero-copy path) land at arbitrary offsets. The CPU
invariant checked here is the CUDA requirement: at the moment each layer runs (a forward hook, tests/probes.py),
`data_ptr() % 256 == 0` for its parameters, buffers and 4-bit quant-state tensors; tiers resident
(none), RAM and disk; dtypes bf16, fp16, the nf4 cache of a 16-bit checkpoint and a pre-quantized
bitsandbytes checkpoint. The fixtures are checked to hold misaligned file offsets, so the disk
tier's re-layout is really exercised (a CPU computes a disk layer in place where its offsets sit on
storage.CPU_ALIGN, GGUF's grid, tests/test_gguf.py; these fixtures' offsets miss even that).
"""

from __future__ import annotations

import pytest
import torch

from offload import OffloadedCausalLM
from offload.formats.st_index import SafetensorsIndex
from offload.stream.storage import CPU_ALIGN
from tests.probes import after_each_layer
from tests.test_families import make_family
from tests.test_prequant import Q4, _bnb_save

ALIGN = 256
TIERS = ["none", "ram", "disk"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("align")
    src = make_family("llama31", root / "bf16", seed=5, dtype=torch.bfloat16, **Q4)
    fp32 = make_family("llama31", root / "fp32", seed=5, **Q4)
    return {"bf16": src, "prequant": _bnb_save(fp32, root / "q4")}


def _tensors_of(layer: torch.nn.Module):
    for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
        yield name, t
    for mod_name, mod in layer.named_modules():
        qs = getattr(mod, "quant_state", None)
        for st in (qs, getattr(qs, "state2", None)):
            for attr in ("absmax", "code"):
                t = getattr(st, attr, None)
                if isinstance(t, torch.Tensor):
                    yield f"{mod_name}.quant_state.{attr}", t


def _misaligned_in_file(path) -> int:
    index = SafetensorsIndex(path)
    return sum(1 for e in index.entries.values() if ".layers." in e.name and e.begin % CPU_ALIGN)


def _check_every_layer(model) -> list[str]:
    bad, seen = [], set()

    def hook(i):
        seen.add(i)
        for name, t in _tensors_of(model.layers[i]):
            if t.numel() and t.data_ptr() % ALIGN:
                bad.append(f"layer {i} {name}: data_ptr % {ALIGN} = {t.data_ptr() % ALIGN}")

    after_each_layer(model, hook)
    model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    assert seen == set(range(len(model.layers)))
    return bad


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "nf4", "prequant"])
def test_every_tensor_handed_to_a_layer_is_256_aligned(ckpts, tier, dtype):
    path = ckpts["prequant" if dtype == "prequant" else "bf16"]
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    arg = "nf4" if dtype == "nf4" else torch_dtype
    if dtype in ("bf16", "prequant"):  # the zero-copy file-layout path must really meet bad offsets
        assert _misaligned_in_file(path) > 0
    model = OffloadedCausalLM.from_pretrained(path, dtype=arg, offload=tier)
    try:
        assert _check_every_layer(model) == []
    finally:
        model.close()


def test_cuda_copy_re_lays_file_layout_onto_the_grid(ckpts):
    """LayerStore.copy (the CUDA host->device stage, run here on CPU tensors): a disk layer read
    in its misaligned file layout arrives in the device slot at aligned offsets, byte-identical."""
    from offload.stream.hostmem import aligned_empty

    model = OffloadedCausalLM.from_pretrained(ckpts["bf16"], dtype=torch.bfloat16, offload="disk")
    try:
        store = model.store
        layer, d = next((i, d) for i, d in store.disk.items() if d.repack and not d.convert)
        host = aligned_empty(d.raw.nbytes)
        for span in d.spans:
            store.reader.read_span(span, host)
        out = store.copy(layer, host, 0)
        for name, s in d.packed.slices.items():
            assert s.offset % ALIGN == 0 and out.data_ptr() % ALIGN == 0
            assert torch.equal(d.packed.view(out, name), d.raw.view(host, name)), name
    finally:
        model.close()
