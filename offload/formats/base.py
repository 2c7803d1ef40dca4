"""The one description of a checkpoint on disk, and the small interface every format reader implements.

Contract:
- `TensorInfo`: one STORED tensor as the file holds it; a block-quantized tensor (`qtype` set) is a
  flat (nbytes,) uint8 vector, its logical shape in `Checkpoint.shapes`.
- `Checkpoint`: everything specx needs to know about one model, read once from headers and metadata
  (no tensor data). `packed` maps every HF weight not stored as one plain float tensor to the stored
  tensors its reader's `load_weight` combines; `dense(hf_name)` is a parameter, dequantized when packed.
- `FormatReader` (each offload/formats/<format>.py exposes `READER`): `name`; `detect(path)`, a cheap
  sniff that never raises; `open(path)`, which parses and VALIDATES headers and metadata (missing,
  unexpected, misshapen or truncated tensors are one-line OffloadErrors naming the file, the tensor
  and the fix); `load_weight(ckpt, hf_weight_name, raw, device, dtype)`, the `dtype` weight of its
  logical HF shape on `device` by torch ops, from `raw` (stored name -> its bytes on `device`, flat
  uint8 or already typed: `as_stored` normalises both). Called once per weight per pass when streamed.
- Alignment: the loader's layouts start every `raw` tensor on a 256-byte boundary (storage.ARENA_ALIGN).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from offload.errors import OffloadError

FORMATS = ("bf16", "fp16", "fp32", "bnb-nf4", "awq", "gptq", "compressed-tensors", "gguf", "mxfp4")


@dataclass(frozen=True)
class TensorInfo:
    name: str  # HF tensor name (GGUF names are translated to HF's), e.g. model.layers.0.mlp.up_proj.qweight
    file: Path  # file that holds the bytes
    dtype: torch.dtype  # element type of the stored bytes (torch.uint8 for block-quantized bytes)
    shape: tuple[int, ...]  # stored shape in `dtype` elements (a `qtype` tensor: (nbytes,)); logical: Checkpoint.shapes
    begin: int  # absolute byte offset of the first byte in `file`
    end: int  # absolute byte offset one past the last byte
    qtype: str | None = None  # block-quant type of the bytes when not a plain `dtype` array (GGUF "Q4_K"); None = plain
    meta: dict = field(default_factory=dict, compare=False, hash=False)  # per-format extras (GGUF type id, ...)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class StoredTensors:
    """`get`/`read` of one stored tensor by name, over `entries` (name -> TensorInfo) and
    `source_name` (the file "missing tensor" messages name): a Checkpoint and a SafetensorsIndex."""

    entries: dict[str, TensorInfo]
    source_name: Path | None
    root: Path

    def get(self, name: str) -> TensorInfo:
        """The stored tensor `name`; a one-line OffloadError when the checkpoint lacks it."""
        try:
            return self.entries[name]
        except KeyError:
            raise OffloadError(
                f"{self.source_name or self.root}: missing tensor {name!r}; the checkpoint is incomplete or does not match "
                "its config"
            ) from None

    def read(self, name: str) -> torch.Tensor:
        """Stored tensor `name` as a CPU tensor of its stored dtype and shape (load time only)."""
        info = self.get(name)
        out = torch.empty(info.nbytes, dtype=torch.uint8)
        read_exact(info.file, info.begin, out)
        return as_stored(info, out)


@dataclass
class Checkpoint(StoredTensors):
    path: Path  # what the user named: a model directory or a .gguf file
    format: str  # one of FORMATS
    config: dict  # config.json-style dict (GGUF: built from metadata); the plan reads it
    hf_config: object  # transformers PretrainedConfig built from `config`
    tensors: dict[str, TensorInfo]  # every stored tensor by name
    files: list[Path]  # the weight files, in order (the index json is not one)
    reader: FormatReader  # the reader that opened it; its load_weight dequantizes
    quant: dict | None = None  # quantization parameters (bits, group_size, sym, desc_act, ...); None for 16/32-bit
    packed: dict[str, tuple[str, ...]] = field(default_factory=dict)  # HF weight -> stored tensors that make it
    tokenizer_path: Path | None = None  # directory (or file) AutoTokenizer.from_pretrained reads
    tokenizer_kwargs: dict = field(default_factory=dict)  # extra from_pretrained kwargs (GGUF: gguf_file=...)
    chat_template: str | None = None  # Jinja chat template (tokenizer_config.json / GGUF metadata)
    generation: dict = field(default_factory=dict)  # generation defaults (generation_config.json / GGUF metadata)
    source_name: Path | None = None  # file to name in "missing tensor" messages (index json when sharded)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # HF parameter -> logical shape (set by open)

    @property
    def root(self) -> Path:
        """The model directory (a .gguf file's directory)."""
        return self.path if self.path.is_dir() else self.path.parent

    @property
    def entries(self) -> dict[str, TensorInfo]:
        """Alias of `tensors` (st_index.SafetensorsIndex spelling, used by the strict checks)."""
        return self.tensors

    @property
    def num_layers(self) -> int:
        cfg = self.config.get("text_config") or self.config
        return int(cfg.get("num_hidden_layers", 0))

    @property
    def quantized(self) -> bool:
        """True when decoder linears are stored packed (every format but bf16/fp16/fp32)."""
        return self.format not in ("bf16", "fp16", "fp32")

    def layer_tensors(self, i: int) -> dict[str, TensorInfo]:
        """Stored tensors of decoder layer i, by full name."""
        prefix = f"model.layers.{i}."
        return {n: t for n, t in self.tensors.items() if n.startswith(prefix)}

    def layer_bytes(self, i: int) -> int:
        """Bytes decoder layer i occupies as stored (what streams per pass)."""
        return sum(t.nbytes for t in self.layer_tensors(i).values())

    def stored_parts(self, hf_name: str) -> tuple[str, ...]:
        """Stored tensors that make HF weight `hf_name` (itself when stored plain)."""
        return self.packed.get(hf_name, (hf_name,))

    def logical_shape(self, hf_name: str) -> tuple[int, ...]:
        """The HF parameter's shape ((out_features, in_features) for a linear), however it is stored."""
        if hf_name in self.shapes:
            return tuple(self.shapes[hf_name])
        return tuple(self.tensors[hf_name].shape)

    def dense(self, hf_name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """HF parameter `hf_name` as a CPU tensor: dequantized by the reader into `dtype` when
        stored packed, else read as stored (the self-draft's substitutes are made from these)."""
        if hf_name not in self.packed:
            return self.read(hf_name)
        raw = {n: self.read(n) for n in self.packed[hf_name]}
        return self.reader.load_weight(self, hf_name, raw, torch.device("cpu"), dtype).contiguous()

    def load_tokenizer(self, trust: bool = False):
        from transformers import AutoTokenizer

        if "gguf_file" in self.tokenizer_kwargs and len(self.tokenizer_kwargs) == 1:  # built once per machine
            from offload.formats.tokcache import gguf_tokenizer

            return gguf_tokenizer(Path(self.tokenizer_path or self.root), self.tokenizer_kwargs["gguf_file"], trust)
        return AutoTokenizer.from_pretrained(
            self.tokenizer_path or self.root, trust_remote_code=trust, **self.tokenizer_kwargs
        )


@runtime_checkable
class FormatReader(Protocol):
    name: str

    def detect(self, path: Path) -> bool: ...

    def open(self, path: Path) -> Checkpoint: ...

    def load_weight(
        self,
        ckpt: Checkpoint,
        hf_weight_name: str,
        raw: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
    ) -> torch.Tensor: ...


def as_stored(info: TensorInfo, t: torch.Tensor) -> torch.Tensor:
    """`t` (flat uint8 bytes, or already typed) viewed as the stored tensor of `info`."""
    if info.qtype is not None:
        return t if t.dtype == torch.uint8 and t.dim() == 1 else t.reshape(-1).view(torch.uint8)
    if t.dtype == info.dtype and tuple(t.shape) == tuple(info.shape):
        return t
    flat = t.reshape(-1).view(torch.uint8)
    return flat.view(info.dtype).view(info.shape) if info.shape else flat.view(info.dtype).reshape(())


def meta_param(info: TensorInfo) -> torch.nn.Parameter:
    """The stored tensor `info` as a weightless (meta) parameter for the loader to bind (`qtype`: its flat bytes)."""
    shape = (info.nbytes,) if info.qtype is not None else tuple(info.shape)
    dtype = torch.uint8 if info.qtype is not None else info.dtype
    return torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)


def read_exact(path: Path, offset: int, out: torch.Tensor) -> None:
    """Buffered read of `out.numel()` bytes at `offset` straight into a uint8 tensor."""
    mv = memoryview(out.numpy()).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], offset + done)
            if n <= 0:
                raise OffloadError(f"{path}: truncated while reading at byte {offset + done}; re-download it")
            done += n
    finally:
        os.close(fd)
