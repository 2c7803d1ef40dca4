"""Per-layer sizes for the memory plan, from config.json and safetensors headers only.

Contract: `layer_sizes(ck, arch, req)` reads a formats.Checkpoint's config and tensor headers (never
weight bytes) and returns a `LayerSizes`: per decoder layer the bytes loader.load_weights will allocate
or read for it, plus the NF4 quant-state and pinned-norm totals; for a family whose routed experts a disk
layer may hold apart, the experts' slot and read requests, sized apart (`apart`) or as whole layers.
`dequantize_once` picks what is dequantized once at load, `kernel_terms` what the GGUF CPU kernel serves.
memplan.py places the layers; this module only sizes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from offload.errors import OffloadError
from offload.formats.base import Checkpoint, TensorInfo
from offload.formats.prequant import packed_nf4_shape
from offload.planning.membytes import Arch, _packed, compute_bytes, compute_dtype, nf4_state_bytes, torch_dtype
from offload.planning.passcost import linear_weights
from offload.quant.dense import dense_bytes
from offload.stream.expertbulk import layer_spans
from offload.stream.expertstore import slot_bytes, split_layer, splits_experts, streams_whole
from offload.stream.hostmem import ARENA_ALIGN
from offload.stream.storage import CPU_ALIGN, IO_ALIGN, ParamSpec, align_up, file_layout, is_aligned, packed_layout

# how a decoder layer's parameters end: linears' and norms' weight/bias, gpt-oss's attention sinks and
# its fused 3-D experts (`mlp.experts.gate_up_proj` (E, H, 2I), `mlp.experts.down_proj` (E, I, H))
PARAM_ENDINGS = ("weight", "bias", "self_attn.sinks", "experts.gate_up_proj", "experts.down_proj")
# gpt-oss's experts stored as MXFP4 (formats/mxfp4.py): uint8 blocks and scales, streamed as stored
STORED_ENDINGS = tuple(f"experts.{m}_{p}" for m in ("gate_up_proj", "down_proj") for p in ("blocks", "scales"))


def layer_specs(ck: Checkpoint, i: int, storage: torch.dtype, nf4: bool) -> dict[str, tuple[ParamSpec, TensorInfo]]:
    """Parameters of decoder layer i from the headers. NF4 specs carry the LOGICAL shape: a packed uint8
    (rows, 1) weight of a pre-quantized checkpoint holds 2 x rows 4-bit values."""
    prefix = f"model.layers.{i}."
    out = {}
    packed = _packed(ck.config)
    for name, e in ck.tensors.items():
        rel = name[len(prefix) :]
        if not name.startswith(prefix):
            continue
        # AWQ/GPTQ/compressed-tensors parts (qweight, scales, ...) stream as stored (formats/qlinear.py)
        qparts = packed and (not rel.endswith((".weight", ".bias")) or not e.dtype.is_floating_point)
        if qparts or rel.endswith(STORED_ENDINGS):
            out[rel] = (ParamSpec(rel, tuple(e.shape), e.dtype), e)
        elif rel.endswith(PARAM_ENDINGS):
            q = nf4 and rel.endswith("_proj.weight") and (len(e.shape) == 2 or e.dtype == torch.uint8)
            shape = (2 * e.shape[0],) if q and e.dtype == torch.uint8 else tuple(e.shape)
            out[rel] = (ParamSpec(rel, shape, torch.uint8 if q else storage, nf4=q), e)
    if not out:
        raise OffloadError(f"{ck.root}: no tensors for model.layers.{i}; the checkpoint does not match config.json")
    return out


@dataclass
class LayerSizes:
    packed: list[int]  # packed arena bytes
    disk_slot: list[int]  # compute slot bytes when streamed from disk (aligned layout)
    raw: list[int]  # file-layout read buffer bytes
    convert: list[bool]  # disk bytes need a cast / quantization
    span_bytes: list[int]  # bytes read from disk per pass
    quant: int  # NF4 quant-state bytes of all layers
    stage: list[int] = field(default_factory=list)  # CUDA pinned staging bytes (file layout unless cast)
    repack: list[bool] = field(default_factory=list)  # compute slot != file layout (cast, off the 256-byte grid)
    substitute: list[int] = field(default_factory=list)  # --draft self: device bytes of each layer's substitute
    pinned: int = 0  # NF4: every layer's norms/biases, kept on the device
    dense: list[int] = field(default_factory=list)  # packed linears dequantized once (quant/dense.py), per layer
    estimated: bool = False  # NF4 file layout estimated (the 4-bit cache is not written yet)
    # a family whose routed experts a disk layer may hold apart (expertstore.splits_experts), sized either way:
    apart: bool = False  # the sizes above are of disk layers holding them apart (their dense part streams)
    expert_slot: list[int] = field(default_factory=list)  # one routed expert's cache slot bytes, per layer
    expert_reads: list[int] = field(default_factory=list)  # read requests (file spans) of one routed expert
    expert_whole: list[int] = field(default_factory=list)  # a whole read of the layer's experts (expertbulk buffer)
    dense_reads: list[int] = field(default_factory=list)  # read requests of the dense part held apart
    layer_reads: list[int] = field(default_factory=list)  # read requests of the whole layer


def layer_sizes(ck: Checkpoint, arch: Arch, req, apart: bool = True) -> LayerSizes:
    """Per-layer sizes as loader.load_weights computes them. NF4: only the packed linears stream, as stored;
    norms and biases are pinned on the device. From a 16-bit checkpoint the streamed file is the 4-bit cache,
    whose spans are estimated (each packed weight rounded up to 4 KiB pages, plus one page). `apart`: disk
    layers hold their routed experts apart where expertstore.splits_experts allows it."""
    nf4 = req.dtype == "nf4"
    storage = compute_dtype(req) if nf4 else torch_dtype(req.dtype)
    out = LayerSizes([], [], [], [], [], 0)
    # a disk layer streams its dense part only where its routed experts are read on demand (stream/expertstore.py)
    # packed linears stream with their layer; a GGUF's experts are rows of its fused tensors, read apart as stored
    splits = splits_experts(ck.config.get("model_type"), req.device, nf4 or streams_whole(ck.config))
    held = out.apart = splits and apart
    for i in range(arch.layers):
        specs = layer_specs(ck, i, storage, nf4)
        streamed = {n: se for n, se in specs.items() if se[0].nf4 or not nf4}
        entries = {n: e for n, (_, e) in streamed.items()}  # name -> its header entry
        packed = packed_layout([sp for sp, _ in streamed.values()]).nbytes
        prequant = all(e.dtype == torch.uint8 for _, e in streamed.values())
        if splits:  # the dense part as the loader reads it (expertstore.split_layer), the experts' slot and reads
            part, experts = split_layer(entries, [sp for sp, _ in streamed.values()], CPU_ALIGN)
            out.expert_slot.append(slot_bytes(experts.values()))
            out.expert_reads.append(max((len(x.spans) for x in experts.values()), default=0))
            out.expert_whole.append(layer_spans({(i, e): x for e, x in experts.items()})[0][i].nbytes if experts else 0)
            out.dense_reads.append(len(part.spans))
            out.layer_reads.append(len(file_layout(entries)[1]))
        if nf4 and not prequant:
            raw = sum(
                align_up(math.prod(packed_nf4_shape(sp.shape)), IO_ALIGN) + IO_ALIGN for sp, _ in streamed.values()
            )
            spans, convert, aligned = raw, False, False  # cache offsets unknown yet: assume a repack
            out.estimated = True
        elif held:
            raw, spans = part.raw.nbytes, sum(s.length for s in part.spans)
            convert, aligned = part.convert, not part.repack
        else:
            lay, span_list = file_layout(entries)
            raw, spans = lay.nbytes, sum(sp.length for sp in span_list)
            convert = any(e.dtype != (torch.uint8 if sp.nf4 else sp.dtype) for sp, e in streamed.values())
            # a CPU computes a disk layer in its file layout where offsets allow (storage.CPU_ALIGN)
            aligned = is_aligned(lay, CPU_ALIGN if req.device == "cpu" else ARENA_ALIGN)
        out.packed.append(packed)
        out.disk_slot.append(part.layout.nbytes if held else raw if aligned and not convert else packed)
        out.stage.append(packed if convert else raw)  # CUDA only (never held apart)
        out.raw.append(raw)
        out.convert.append(convert)
        out.repack.append(convert or not aligned)
        out.span_bytes.append(spans)
        out.quant += sum(nf4_state_bytes(math.prod(sp.shape)) for sp, _ in streamed.values() if sp.nf4)
        if nf4:
            out.pinned += packed_layout([sp for sp, _ in specs.values() if not sp.nf4]).nbytes
        out.dense.append(0 if nf4 else dense_bytes(ck, i, compute_bytes(req)))
    return out


def dense_substitutes(lay: LayerSizes, resident: list[int], req, arch: Arch, room: int) -> tuple[list[int], int]:
    """--draft self with HQQ substitutes (3 or 2 bits): the substituted layers, in order, whose linears
    dequantized once (passcost.linear_weights a layer) fit in `room`, and their bytes. NF4 substitutes and
    the CPU kernel's blocks stay packed (read directly, cheaper than any copy)."""
    if not req.self_draft or req.draft_bits not in (2, 3) or substitutes_are_blocks(req, arch):
        return [], 0
    per = linear_weights(arch) * compute_bytes(req)
    keep = set(resident)
    subs = [i for i, v in enumerate(lay.substitute) if v and i not in keep]
    n = min(len(subs), max(0, room) // per) if per else 0
    return subs[:n], n * per


def substitutes_are_blocks(req, arch: Arch, bits: int | None = None) -> bool:
    """Whether --draft self's HQQ substitutes load as the CPU kernel's blocks (quant/lowbit.blocks_serve
    of a hidden-wide row): then nothing of theirs is dequantized and the draft runs the kernel."""
    from offload.quant.lowbit import blocks_serve

    bits = req.draft_bits if bits is None else bits  # `bits`: a width the planner weighs (--draft-bits unset)
    if not getattr(req, "self_draft", False) or bits not in (2, 3):
        return False
    fp32 = torch.float32 if compute_bytes(req) == 4 else None
    return blocks_serve((arch.hidden, arch.hidden), bits, req.device, fp32)


@dataclass
class Dense:
    layers: list[int]  # layers whose linears are dequantized once at load, in order
    nbytes: int  # their bytes in the compute dtype


def dequantize_once(
    lay: LayerSizes, resident: list[int], req, arch: Arch, room: int, slack: float
) -> tuple[Dense, Dense]:
    """What the plan dequantizes once in `room`: the resident layers, in order, whose linears (lay.dense) fit,
    each costing `slack` times its size (CUDA: the allocator's rounding); then HQQ substitutes."""
    target = Dense([], 0)
    used = 0
    for i in resident:
        size = int(lay.dense[i] * slack)
        if size and used + size <= room:
            target.layers.append(i)
            target.nbytes += lay.dense[i]
            used += size
    return target, Dense(*dense_substitutes(lay, resident, req, arch, room - target.nbytes))


def dense_notes(target: Dense, draft: Dense, n_resident: int) -> list[str]:
    from offload.sizes import format_bytes

    notes = []
    if draft.layers:
        notes.append(
            f"self-draft dequantized once: {len(draft.layers)} substitutes "
            f"({format_bytes(draft.nbytes)} in the compute dtype), none rebuilt per draft forward"
        )
    if target.layers:
        rest = "the others dequantize on every pass" if len(target.layers) < n_resident else "none per pass"
        notes.append(
            f"dequantized once: {len(target.layers)} of {n_resident} resident layers "
            f"({format_bytes(target.nbytes)} in the compute dtype); {rest}"
        )
    return notes


def kernel_terms(ck: Checkpoint, n_layers: int, req, streams: bool = False) -> dict:
    """What the exact GGUF CPU kernel (cpu/ggml_kernel.py) serves, decided as the loader decides it
    (gguf_kernel_type): `layers` whose every packed linear it multiplies from the file's blocks, `rows` (a
    layer also dequantized once takes the kernel up to that many tokens), `head_bytes` (the packed head's
    bytes, 0: read in the compute dtype), `stack` (every layer served, a plain Llama: passes of up to
    `stack_rows` tokens run on the one-call stack, cpu/leanstack.py; STACK_ROWS with streamed layers,
    `streams`), `llama` (decode_stack.c's family); where a type is slower per byte than Q4_1 `cost` ({layer:
    its mean ggml_kernel.COST factor}) and `head_cost`, and for a Q8_0 head `draft_head_cost` (Q8A)."""
    from offload.cpu.ggml_kernel import COST, MAX_ROWS, Q8A
    from offload.cpu.leanstack import STACK_ROWS, family_reason
    from offload.formats.gguf_quants import Q8_0
    from offload.formats.qlinear import gguf_kernel_type

    def served(name: str) -> bool:
        return gguf_kernel_type(ck, name, req.device, compute_dtype(req)) is not None

    ok: dict[int, bool] = {}  # layer -> every packed tensor of it served (one pass over the names)
    weighed: dict[int, list] = {}  # layer -> [packed bytes, bytes x the type's COST]
    for name, t in ck.tensors.items():
        if t.qtype is not None and name.startswith("model.layers."):
            i = int(name.split(".", 3)[2])
            ok[i] = ok.get(i, True) and served(name)
            w = weighed.setdefault(i, [0, 0.0])
            w[0] += t.nbytes
            w[1] += t.nbytes * COST.get(t.meta.get("ggml_type"), 1.0)
    layers = [i for i in range(n_layers) if ok.get(i)]
    head = next((n for n in ("lm_head.weight", "model.embed_tokens.weight") if n in ck.tensors), None)
    head_bytes = ck.tensors[head].nbytes if head and served(head) else 0
    llama = family_reason(ck.config.get("text_config") or ck.config) is None
    stack = bool(n_layers) and len(layers) == n_layers and llama
    out = dict(
        layers=layers,
        rows=MAX_ROWS if layers or head_bytes else 0,
        head_bytes=head_bytes,
        stack=stack,
        llama=llama,
        stack_rows=STACK_ROWS if streams else MAX_ROWS,
    )
    cost = {i: round(weighed[i][1] / weighed[i][0], 4) for i in layers if weighed[i][1] != weighed[i][0]}
    head_type = ck.tensors[head].meta.get("ggml_type") if head_bytes else None
    head_cost = COST.get(head_type, 1.0) if head_bytes else 1.0
    if cost or head_cost != 1.0:  # types slower per byte than Q4_1 (ggml_kernel.COST): the speed model's factors
        out.update(cost=cost, head_cost=head_cost)
    if head_type == Q8_0:  # the self-draft reads a Q8_0 head over 8-bit activations (selfdraft/build.draft_head)
        out.update(draft_head_cost=COST[Q8A])
    return out
