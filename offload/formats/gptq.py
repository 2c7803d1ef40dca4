"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum layout), symmetric and asymmetric, with or
without act-order (`desc_act`, `g_idx`).

Contract: `READER` claims a safetensors directory whose config.json has
`quantization_config.quant_method == "gptq"`; 4 bits only. `checkpoint_format` "gptq" (v1, also
when absent) stores each zero point minus one; "gptq_v2" stores it as is.
Layout of one linear with in_features K, out_features N, G groups:
  qweight (K/8, N) int32   eight 4-bit codes per word along the INPUT dim: field j of word r is row 8r + j
  qzeros  (G, N/8) int32   zero points along the output dim: field j of word c is column 8c + j
  scales  (G, N) fp16      per-group scales
  g_idx   (K,) int32       group of each input row (optional; default k // group_size)
  W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]   (HF weight (N, K) = the transpose)
"""

from __future__ import annotations

from pathlib import Path

import torch

from offload.errors import OffloadError
from offload.formats.packed import PackedReader, bits4, group_count, group_size, unpack_cols, unpack_rows


class GptqReader(PackedReader):
    name = "gptq"
    suffixes = ("qweight", "qzeros", "scales", "g_idx")

    def params(self, qc: dict, path: Path) -> dict:
        bits4(qc, path, "GPTQ")
        fmt = str(qc.get("checkpoint_format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise OffloadError(
                f"{path / 'config.json'}: GPTQ checkpoint_format {fmt!r} is not supported; "
                "use a gptq or gptq_v2 checkpoint"
            )
        return {
            "method": "gptq",
            "bits": 4,
            "group_size": group_size(qc, path),
            "sym": bool(qc.get("sym", True)),
            "desc_act": bool(qc.get("desc_act", False)),
            "checkpoint_format": fmt,
        }

    def shapes(self, q, out_f, in_f, present):
        groups = group_count(in_f, q["group_size"])
        out = {"qweight": (in_f // 8, out_f), "qzeros": (groups, out_f // 8), "scales": (groups, out_f)}
        if "g_idx" in present:
            out["g_idx"] = (in_f,)
        return out

    def dequant(self, q, parts, out_f, in_f, dtype):
        g = q["group_size"] if q["group_size"] > 0 else in_f
        zeros = unpack_cols(parts["qzeros"])[:, :out_f].to(dtype)  # (G, N)
        if q["checkpoint_format"] == "gptq":
            zeros += 1  # v1 stores zero - 1
        scales = parts["scales"].to(dtype)
        w = unpack_rows(parts["qweight"]).to(dtype)  # (K, N) codes
        gidx = parts.get("g_idx")
        if gidx is None or _trivial(gidx, g):
            groups = scales.shape[0]
            w.view(groups, -1, out_f).sub_(zeros[:, None]).mul_(scales[:, None])
        else:
            gi = gidx.long()
            w.sub_(zeros.index_select(0, gi)).mul_(scales.index_select(0, gi))
        return w.t()  # (N, K) view


def _trivial(gidx: torch.Tensor, g: int) -> bool:
    """True when g_idx is the default k // g (then groups are contiguous row blocks)."""
    ref = torch.arange(gidx.numel(), device=gidx.device, dtype=torch.int32) // g
    return bool(torch.equal(gidx.to(torch.int32), ref)) and gidx.numel() % g == 0


READER = GptqReader()
