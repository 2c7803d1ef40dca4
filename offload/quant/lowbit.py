"""HQQ low-bit substitutes of decoder layers: the self-draft's 3- and 2-bit layers (offload/selfdraft/build.py).

Contract:
- `GROUPS[bits]`: the HQQ group size; each group of weights along the input dimension (HQQ's axis 1)
  has one scale and one zero in the compute dtype.
- `ensure_lowbit_layers(src, layers, bits, progress)` -> the cache directory of 16-bit checkpoint `src`
  at `bits` (quant_cache.keyed_path: a changed checkpoint gets a new directory, the old one removed), one
  `layer-NNNNN.safetensors` per layer asked for: per nn.Linear `<name>.W_q` (HQQ's packed codes),
  `.scale`, `.zero`, every other tensor as stored. Shards are written under a temporary name and renamed;
  one whose header does not parse is rebuilt with an OffloadNotice. `progress(done, total, what)` per layer.
- `lowbit_layer(skeleton, shard, device, compute, pool)`: the meta-device HF layer with every nn.Linear a
  `LowbitLinear` (or, where `blocks_serve`, a quant/lowbit_pack.py `KernelLowbitLinear`), device bytes
  counted in `pool` under "draft". `LowbitLinear` multiplies by `dense` once set (quant/dense.py), else
  per quant/fused.py's kernel_choice: fused, or the eager reference (HQQ's unpack, then the matmul).
HQQ is optional (specx's `lowbit` extra); without it `hqq_quantizer()` raises an OffloadError naming the install.
"""

from __future__ import annotations

import functools
import json
import math
import os
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from offload.errors import OffloadError, OffloadNotice
from offload.formats.qfuse import SIBLINGS, fuse_siblings
from offload.formats.qlinear import PackedLinear
from offload.quant.fused import fused_linear, kernel_choice
from offload.quant.lowbit_pack import BLOCKS, TYPE_OF_BITS, KernelLowbitLinear, pack
from offload.quant.quant_cache import drop_stale, keyed_path

GROUPS = {4: 64, 3: 64, 2: 32}
FORMAT = 1
SOURCE = "specx-source.json"  # in each cache directory: the checkpoint it was made from
PACKING = {4: "4bit_u8", 3: "3bit_32", 2: "2bit_u8"}
ROWS_PER_WORD = {4: 2, 3: 10, 2: 4}  # group rows packed into one stored element (uint8, int32, uint8)


@functools.cache  # every draft forward unpacks through it
def hqq_quantizer():
    """HQQ's Quantizer (imported once, its import-time warnings silenced), or a one-line error."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from hqq.core.quantize import Quantizer
    except ImportError:
        raise OffloadError(
            "--draft-bits 3 and 2 quantize with HQQ, which is not installed; fix: "
            "pip install 'hqq>=0.2.8,<0.3' (specx's lowbit extra), or a small --draft DIR"
        ) from None
    return Quantizer


def blocks_serve(shape: tuple[int, ...], bits: int, device, compute: torch.dtype | None) -> bool:
    """Whether a substitute of this (out, in) weight is stored as the CPU kernel's blocks (lowbit_pack.py)."""
    return (
        len(shape) == 2
        and shape[-1] % GROUPS[bits] == 0
        and bits in TYPE_OF_BITS
        and kernel_choice(device, compute) == "blocks"
    )


def lowbit_weight_bytes(shape: tuple[int, ...], bits: int, scale_bytes: int = 2, blocks: bool = False) -> int:
    """Device bytes of a (out, in) weight at `bits`: packed codes + one scale and zero per group; as
    the kernel's blocks (`blocks`): one block of BLOCKS[type] bytes per group."""
    group = GROUPS[bits]
    if blocks:
        return math.prod(shape) // group * BLOCKS[TYPE_OF_BITS[bits]][1]
    rows = math.prod(shape) // group
    words = math.ceil(rows / ROWS_PER_WORD[bits]) * group
    return words * (4 if bits == 3 else 1) + 2 * rows * scale_bytes


def check_shape(name: str, shape: tuple[int, ...], bits: int) -> None:
    group = GROUPS[bits]
    if math.prod(shape) % (group * (1 if bits == 3 else ROWS_PER_WORD[bits])):
        raise OffloadError(
            f"{name}: shape {tuple(shape)} does not split into {bits}-bit groups of {group}; "
            "fix: --draft-bits 4 or a small --draft DIR"
        )


class LowbitLinear(nn.Module):
    """y = x W^T (+ b), W = (codes - zero) * scale from HQQ codes, through quant/fused.py or HQQ's unpack."""

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None,
        shape: tuple[int, int],
        bits: int,
    ):
        super().__init__()
        self.register_buffer("W_q", codes)  # (rows / per-word, group) packed codes, rows = out*in/group
        self.register_buffer("scale", scale)  # (rows, 1) compute dtype
        self.register_buffer("zero", zero)  # (rows, 1) compute dtype
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.shape, self.bits = tuple(shape), bits
        self.in_features, self.out_features = shape[1], shape[0]
        self.kernel = kernel_choice(codes.device)  # "fused" (offload/quant/fused.py) or "eager" (the reference)
        self.dense: torch.Tensor | None = None  # weight_now() kept once (offload/quant/dense.py)

    def weight_now(self) -> torch.Tensor:
        unpack = hqq_quantizer().unpack[PACKING[self.bits]]
        codes = unpack(self.W_q, dtype=self.scale.dtype)[: self.scale.shape[0]]  # 3-bit pads rows to x10
        return codes.sub_(self.zero).mul_(self.scale).reshape(self.shape)  # in place: one temporary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:  # dequantized once: the eager reference's weight
            return nn.functional.linear(x, self.dense.to(x.dtype), self.bias)
        if self.kernel == "eager":
            return self.forward_eager(x)
        return fused_linear(
            x, self.W_q, self.scale, self.zero, self.bias, self.out_features, self.in_features, self.bits
        )

    def forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: HQQ's own unpack, the weight rebuilt in 16 bits, then the matmul."""
        return nn.functional.linear(x, self.weight_now().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={GROUPS[self.bits]}"


def quantize_weight(w: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """HQQ (axis 1, group GROUPS[bits], optimized) on the GPU when there is one: codes, scale, zero, on the host."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    codes, meta = hqq_quantizer().quantize(
        w.float().to(device), nbits=bits, group_size=GROUPS[bits], axis=1, optimize=True, bitpack=True, device=device
    )
    return {
        "W_q": codes.cpu().contiguous(),
        "scale": meta["scale"].float().cpu().contiguous(),
        "zero": meta["zero"].float().cpu().contiguous(),
    }


# -- the cache ------------------------------------------------------------------------------------
def _settings(bits: int) -> dict:
    return {"format": FORMAT, "method": "hqq", "bits": bits, "group": GROUPS[bits], "axis": 1}


def cache_dir(src: Path, bits: int) -> Path:
    return keyed_path(src, f"hqq{bits}", {"settings": _settings(bits)})


def shard_path(out: Path, i: int) -> Path:
    return out / f"layer-{i:05d}.safetensors"


def _readable(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return bool(list(f.keys()))
    except Exception:  # noqa: BLE001 - any failure to parse the header means a corrupt shard
        return False


def ensure_lowbit_layers(
    src: str | Path, layers: list[int], bits: int, progress: Callable[[int, int, str], None] | None = None
) -> Path:
    """The cache directory of `src` (a model directory or its opened formats.Checkpoint: a packed one gives
    its dequantized weights) at `bits` with a shard for every layer in `layers` (see contract)."""
    from offload.formats import Checkpoint, open_checkpoint

    if bits not in GROUPS:
        raise OffloadError(f"--draft-bits must be 4, 3 or 2, got {bits}")
    ck = src if isinstance(src, Checkpoint) else None
    src = ck.path if ck is not None else Path(src)
    out = cache_dir(src, bits)
    missing = []
    for i in layers:
        p = shard_path(out, i)
        if p.exists() and not _readable(p):
            warnings.warn(
                f"offload: the {bits}-bit substitute {p} is corrupt (unreadable safetensors header); rebuilding it",
                OffloadNotice,
                stacklevel=2,
            )
            p.unlink()
        if not p.exists():
            missing.append(i)
    if not missing:
        return out
    hqq_quantizer()  # fail before any work when HQQ is absent
    index = ck or open_checkpoint(src)
    linears = {n for n, shape in index.shapes.items() if n.startswith("model.layers.") and len(shape) == 2}
    out.mkdir(parents=True, exist_ok=True)
    (out / SOURCE).write_text(json.dumps({"source": str(src.resolve())}))
    drop_stale(out, SOURCE, lambda m: m.get("source") == str(src.resolve()))  # another checkpoint's: kept
    for done, i in enumerate(missing):
        if progress is not None:
            progress(done, len(missing), f"quantizing layer {i} to {bits}-bit HQQ (once)")
        _write_shard(index, i, linears, bits, shard_path(out, i))
    if progress is not None:
        progress(len(missing), len(missing), "quantized")
    return out


def _write_shard(index, i: int, linears: set[str], bits: int, path: Path) -> None:
    from safetensors.torch import save_file

    prefix, tensors = f"model.layers.{i}.", {}
    for name in sorted(k for k in index.shapes if k.startswith(prefix)):
        t, short = index.dense(name), name[len(prefix) :]
        if name in linears:
            check_shape(name, tuple(t.shape), bits)
            for part, q in quantize_weight(t, bits).items():
                tensors[f"{short.removesuffix('.weight')}.{part}"] = q
        else:
            tensors[short] = t.contiguous()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt", "specx": json.dumps(_settings(bits))})
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# -- building the substitute layer ----------------------------------------------------------------
def lowbit_layer(skeleton: nn.Module, shard: Path, device: torch.device, compute: torch.dtype, pool) -> nn.Module:
    """The meta-device decoder layer `skeleton` with its weights from `shard` (see contract)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(str(shard))
    with safe_open(str(shard), "pt") as f:
        bits = json.loads(f.metadata()["specx"])["bits"]

    def put(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return pool.copy(t.to(dtype) if dtype is not None else t, "draft")

    for name, mod in list(skeleton.named_modules()):
        if isinstance(mod, (nn.Linear, PackedLinear)):
            bias = tensors.get(f"{name}.bias")
            shape = (mod.out_features, mod.in_features)
            if bias is None and blocks_serve(shape, bits, device, compute):  # the kernel's blocks (placed below)
                sub = KernelLowbitLinear(_blocks(tensors, name, bits, shape), TYPE_OF_BITS[bits], *shape)
            else:
                sub = LowbitLinear(
                    put(tensors[f"{name}.W_q"]),
                    put(tensors[f"{name}.scale"], compute),
                    put(tensors[f"{name}.zero"], compute),
                    None if bias is None else put(bias, compute),
                    shape,
                    bits,
                )
            parent, _, leaf = name.rpartition(".")
            setattr(skeleton.get_submodule(parent), leaf, sub)  # get_submodule(""): the skeleton itself
    for name, p in list(skeleton.named_parameters()):
        if p.is_meta:
            owner, _, leaf = name.rpartition(".")
            setattr(skeleton.get_submodule(owner), leaf, nn.Parameter(put(tensors[name], compute), requires_grad=False))
    _place_blocks(skeleton, put)
    return skeleton


def _place_blocks(layer: nn.Module, put: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Put the layer's kernel blocks on the device: each sibling set (q|k|v, gate|up: qfuse.SIBLINGS) of one
    type and input width as ONE buffer, each member a view of its rows, so the one-call stack multiplies a
    set in one call over one 8-bit image of the input (qfuse.FusedGroup); every other block set its own."""
    placed, named = set(), dict(layer.named_modules())
    for names in SIBLINGS:
        mods = [named[n] for n in names if n in named]
        blocks = len(mods) > 1 and all(isinstance(m, KernelLowbitLinear) for m in mods)
        if not blocks or len({(m.ggml_type, m.in_features) for m in mods}) != 1:
            continue
        flat = put(torch.cat([m.packed.reshape(-1) for m in mods]))
        at = 0
        for m in mods:
            m.packed, at = flat[at : at + m.packed.numel()], at + m.packed.numel()
            placed.add(id(m))
    for m in layer.modules():
        if isinstance(m, KernelLowbitLinear) and id(m) not in placed:
            m.packed = put(m.packed)
    fuse_siblings(layer)


def _blocks(tensors: dict, name: str, bits: int, shape: tuple[int, int]) -> torch.Tensor:
    """Linear `name`'s HQQ codes, scale and zero from a shard as the kernel's blocks (lowbit_pack.pack)."""
    scale = tensors[f"{name}.scale"]
    codes = hqq_quantizer().unpack[PACKING[bits]](tensors[f"{name}.W_q"], dtype=torch.float32)
    return pack(codes[: scale.shape[0]], scale, tensors[f"{name}.zero"], bits, shape[0])
