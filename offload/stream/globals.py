"""The model's globals: input embeddings, final norm, output layer and rotary buffers, from the checkpoint.

Contract: `load_globals(index, hf, config, device, dtype, pool, embeddings)` -> (embed, norm, lm_head,
rotary), every device byte counted by `pool` under its component's name ("embeddings", "final_norm",
"lm_head", "rotary"). `embeddings` is the memory plan's choice: "device" (the fp32/16-bit table on the
device; a tied head shares it), "host" (the table in host RAM behind `HostEmbedding`: only the
looked-up rows cross, one counted copy per forward) or "packed" (CPU GGUF: the table and the head as
the file's bytes, formats/packed_globals.py). A GGUF head the CPU kernel serves keeps its packed
bytes beside its table (cpu/ggml_kernel.PackedHead), so a decode step reads ~1 byte a weight.
"""

from __future__ import annotations

import torch
from torch import nn

from offload.arch.families import restore_buffers
from offload.cpu.ggml_kernel import PackedHead
from offload.formats import Checkpoint
from offload.formats.packed_globals import EMBED, LeanHead, PackedEmbedding, head_name
from offload.formats.qlinear import gguf_kernel_type
from offload.stream.storage import DevicePool


class HostEmbedding(nn.Module):
    """Input embeddings kept in host RAM: only the T looked-up rows cross to the device, in ONE
    copy per forward counted in `counter` (any object with `calls`, `bytes`, `uploads`: the
    caller's transfer counter, e.g. specexec_cli's transfers.COUNTER; None counts nowhere)."""

    def __init__(self, inner: nn.Module, device: torch.device, counter=None):
        super().__init__()
        self.inner, self.device, self.counter = inner, device, counter

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # callers pass CPU ids (OffloadedCausalLM.input_device): no device->host sync per pass
        rows = self.inner(input_ids.to("cpu"))  # (B, T, hidden) on the host
        if self.counter is not None:  # counted on the CPU too, as every specx transfer
            self.counter.calls += 1
            self.counter.uploads += 1
            self.counter.bytes += rows.numel() * rows.element_size()
        return rows.to(self.device, non_blocking=True)


def _materialize(
    mod: nn.Module, weight_name: str, index: Checkpoint, dtype, pool: DevicePool | None, component: str, device
) -> nn.Module:
    """Give `mod` (built on meta) its weight from the file: a counted pool buffer on the device,
    or a plain host tensor when `pool` is None (host embeddings)."""
    src = index.dense(weight_name, dtype)  # dequantized on the host where stored packed (GGUF)
    w = pool.copy(src.to(dtype), component) if pool is not None else src.to(dtype).clone()
    mod = mod.to_empty(device=device if pool is not None else "cpu") if _has_other_state(mod) else mod
    mod.weight = nn.Parameter(w, requires_grad=False)
    return mod


def _has_other_state(mod: nn.Module) -> bool:
    return any(n != "weight" for n, _ in mod.named_parameters()) or any(True for _ in mod.buffers())


@torch.no_grad()
def load_globals(index: Checkpoint, hf, config, device, dtype, pool: DevicePool, embeddings: str = "device"):
    """Materialize embed_tokens (on the device, or host RAM), norm, lm_head (tied if configured and
    the embeddings are on the device) and rotary_emb; every device byte is counted by `pool`."""
    base = hf.model
    norm = _materialize(base.norm, "model.norm.weight", index, dtype, pool, "final_norm", device)
    rotary = type(base.rotary_emb)(config).to(device)
    pool.adopt("rotary", rotary.buffers())
    if embeddings == "packed":
        embed, lm_head = _packed_globals(index, device, dtype, pool)
        return embed, norm.requires_grad_(False), lm_head, rotary
    host = embeddings == "host"
    embed = _materialize(
        base.embed_tokens, "model.embed_tokens.weight", index, dtype, None if host else pool, "embeddings", device
    )
    tied = getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in index.entries
    if tied and not host:
        lm_head = hf.lm_head
        lm_head.weight = embed.weight
    else:
        lm_head = _materialize(
            hf.lm_head, "model.embed_tokens.weight" if tied else "lm_head.weight", index, dtype, pool, "lm_head", device
        )
    lm_head = _packed_head(
        index, lm_head, "model.embed_tokens.weight" if tied else "lm_head.weight", device, dtype, pool
    )
    restore_buffers(embed)
    for mod in (embed, norm, lm_head):
        mod.requires_grad_(False)
    return (HostEmbedding(embed, device) if host else embed), norm, lm_head, rotary


def _packed_globals(index: Checkpoint, device, dtype, pool: DevicePool):
    """`--embeddings packed` (formats/packed_globals.py): (embed, lm_head) as their GGUF bytes only, counted
    as "embeddings" and "lm_head" (a tied head reads the table's bytes)."""
    vocab, hidden = index.logical_shape(EMBED)
    table = pool.copy(index.read(EMBED), "embeddings")
    embed = PackedEmbedding(table, index.tensors[EMBED].meta["ggml_type"], vocab, hidden)
    name = head_name(index)
    raw = table if name == EMBED else pool.copy(index.read(name), "lm_head")
    out_features, in_features = index.logical_shape(name)
    return embed, LeanHead(raw, gguf_kernel_type(index, name, device, dtype), out_features, in_features)


def _packed_head(index: Checkpoint, lm_head: nn.Module, name: str, device, dtype, pool: DevicePool) -> nn.Module:
    """A GGUF head the CPU kernel serves keeps its packed bytes too (counted as "lm_head"), so a
    decode step reads them (~1 byte per weight) instead of the fp32 table (4 bytes)."""
    qtype = gguf_kernel_type(index, name, device, dtype)
    if qtype is None or name not in index.packed:
        return lm_head
    return PackedHead(lm_head.weight, pool.copy(index.read(name), "lm_head"), qtype)
