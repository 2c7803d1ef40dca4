"""Input embeddings and an output layer kept only as their GGUF bytes (`--embeddings packed`).

Contract: fp32 copies of a GGUF model's embedding table and output layer take 4 bytes a weight where
the file holds 0.6-1.1; when the layers do not all fit in RAM those bytes are layers read from disk
again every pass, so the plan may keep both packed on the CPU (planning/memplan.py):
- `PackedEmbedding(raw, qtype, vocab, hidden)`: ids (...) -> (..., hidden) fp32, the looked-up rows
  dequantized (bit for bit the fp32 table's rows);
- `LeanHead(raw, qtype, out_features, in_features)`: cpu.ggml_kernel.PackedHead with no fp32 copy:
  every batch through the packed kernel, else through row blocks dequantized per call;
- `packed_globals_ok(ck, device, dtype)`: GGUF on the CPU in fp32, a head the kernel serves, and a
  quantized embedding table of a family whose embedding is a plain lookup (not Gemma's).
"""

from __future__ import annotations

import torch
from torch import nn

from offload.cpu.ggml_kernel import Q8A, PackedHead, linear, usable
from offload.formats import gguf_quants as gq
from offload.formats.qlinear import gguf_kernel_type

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
SCALED_EMBEDDINGS = ("gemma", "gemma2", "gemma3", "gemma3_text")  # embeddings times sqrt(hidden): not a plain lookup
HEAD_BLOCK_ROWS = 4096  # output rows dequantized at a time where the kernel cannot run (16 MB fp32 at 1024 wide)


def head_name(ck) -> str:
    """The stored name of the output layer's weight (a tied model's is the embedding table)."""
    return HEAD if HEAD in ck.tensors else EMBED


def packed_globals_ok(ck, device, dtype: torch.dtype) -> bool:
    if getattr(ck, "format", None) != "gguf" or torch.device(device).type != "cpu" or dtype != torch.float32:
        return False
    info = ck.tensors.get(EMBED)
    plain = (ck.config.get("text_config") or ck.config).get("model_type") not in SCALED_EMBEDDINGS
    return (
        plain
        and info is not None
        and info.qtype is not None
        and gguf_kernel_type(ck, head_name(ck), device, dtype) is not None
    )


class PackedEmbedding(nn.Module):
    def __init__(self, raw: torch.Tensor, qtype: int, vocab: int, hidden: int):
        super().__init__()
        self.qtype, self.num_embeddings, self.embedding_dim = qtype, vocab, hidden
        self.register_buffer("packed", raw.view(vocab, -1), persistent=False)  # (vocab, row bytes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(self.packed.device)
        rows = gq.dequantize(self.packed[flat], self.qtype, (flat.numel(), self.embedding_dim))
        return rows.reshape(*ids.shape, self.embedding_dim)


class LeanHead(PackedHead):
    def __init__(self, raw: torch.Tensor, qtype: int, out_features: int, in_features: int):
        nn.Module.__init__(self)
        self.out_features, self.in_features = out_features, in_features
        self.weight, self.bias, self.qtype = None, None, qtype
        self.register_buffer("packed", raw.reshape(-1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if usable(x, self.qtype, max_rows=None) and self.packed.device.type == "cpu":
            return linear(x, self.packed, self.qtype, self.out_features)
        # no kernel: blocks of output rows dequantized and multiplied one at a time (the Q8A view is Q8_0's bytes)
        qtype = gq.Q8_0 if self.qtype == Q8A else self.qtype
        blocks = self.packed.view(self.out_features, -1).split(HEAD_BLOCK_ROWS)
        outs = [x.float() @ gq.dequantize(b, qtype, (len(b), self.in_features)).T for b in blocks]
        return torch.cat(outs, dim=-1).to(x.dtype)

    def for_draft(self) -> PackedHead:
        """This head as the self-draft reads it (PackedHead.for_draft): Q8_0 bytes as Q8A."""
        return LeanHead(self.packed, Q8A, self.out_features, self.in_features) if self.qtype == gq.Q8_0 else self
