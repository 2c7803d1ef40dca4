"""The model's globals: input embeddings, final norm, output layer and rotary buffers, from the checkpoint.

Contract: `load_globals(index, hf, config, device, dtype, pool, embeddings)` -> (embed, norm, lm_head,
rotary), every device byte counted by `pool` under "embeddings", "final_norm", "lm_head" or "rotary".
`embeddings` is the memory plan's choice: "device" (a tied head shares the table), "host"
(`HostEmbedding`: only the looked-up rows cross) or "packed" (CPU GGUF: the table and head as the
file's bytes, formats/packed_globals.py). A GGUF head the CPU kernel serves keeps its packed bytes too.
"""

from __future__ import annotations

import torch
from torch import nn

from offload.arch.families import restore_buffers
from offload.cpu.ggml_kernel import PackedHead
from offload.formats import Checkpoint
from offload.formats.packed_globals import EMBED, LeanHead, PackedEmbedding, head_name
from offload.formats.qlinear import gguf_kernel_type
from offload.stream.devmem import DevicePool


class HostEmbedding(nn.Module):
    """Input embeddings in host RAM: the T looked-up rows cross in ONE copy per forward, counted in
    `counter` (an object with `calls`, `bytes`, `uploads`, e.g. specexec_cli's transfers.COUNTER)."""

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
    """`mod` (built on meta) with its weight: a counted pool buffer, or a host tensor when `pool` is None."""
    src = index.dense(weight_name, dtype)  # dequantized on the host where stored packed (GGUF)
    w = pool.copy(src.to(dtype), component) if pool is not None else src.to(dtype).clone()
    other = any(n != "weight" for n, _ in mod.named_parameters()) or any(True for _ in mod.buffers())
    mod = mod.to_empty(device=device if pool is not None else "cpu") if other else mod
    mod.weight = nn.Parameter(w, requires_grad=False)
    return mod


@torch.no_grad()
def load_globals(index: Checkpoint, hf, config, device, dtype, pool: DevicePool, embeddings: str = "device"):
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
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    if tied and not host:
        lm_head = hf.lm_head
        lm_head.weight = embed.weight
    else:
        lm_head = _materialize(hf.lm_head, head, index, dtype, pool, "lm_head", device)
    qtype = gguf_kernel_type(index, head, device, dtype)
    if qtype is not None and head in index.packed:  # the CPU kernel's head reads ~1 byte a weight, not 4
        lm_head = PackedHead(lm_head.weight, pool.copy(index.read(head), "lm_head"), qtype)
    restore_buffers(embed)
    for mod in (embed, norm, lm_head):
        mod.requires_grad_(False)
    return (HostEmbedding(embed, device) if host else embed), norm, lm_head, rotary


def _packed_globals(index: Checkpoint, device, dtype, pool: DevicePool):
    """`--embeddings packed`: (embed, lm_head) as their GGUF bytes only (a tied head reads the table's)."""
    vocab, hidden = index.logical_shape(EMBED)
    table = pool.copy(index.read(EMBED), "embeddings")
    embed = PackedEmbedding(table, index.tensors[EMBED].meta["ggml_type"], vocab, hidden)
    name = head_name(index)
    raw = table if name == EMBED else pool.copy(index.read(name), "lm_head")
    out_features, in_features = index.logical_shape(name)
    return embed, LeanHead(raw, gguf_kernel_type(index, name, device, dtype), out_features, in_features)
