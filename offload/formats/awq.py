"""AWQ checkpoints (AutoAWQ / llm-awq "GEMM" layout), as transformers and vLLM read them.

Contract: `READER` claims a safetensors directory whose config.json has
`quantization_config.quant_method == "awq"`: 4 bits, `version` "gemm", with zero points, any
group size dividing the input size; anything else (the GEMV layout, other bit widths,
`zero_point: false`) is a one-line error naming the fix.
Layout of one linear with in_features K, out_features N, group size g (G = K / g groups):
  qweight (K, N/8) int32   eight 4-bit codes per word along the OUTPUT dim, interleaved (REVERSE)
  qzeros  (G, N/8) int32   the zero points, packed the same way
  scales  (G, N) fp16      per-group scales
  W[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]   (HF weight (N, K) = the transpose)
"""

from __future__ import annotations

from pathlib import Path

import torch

from offload.errors import OffloadError
from offload.formats.packed import PackedReader, bits4, group_size, unpack_cols

# AWQ packs column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i] into field i: REVERSE[j] is the field holding column 8c + j
REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)


def awq_unpack(w: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (R, 8C) codes in column order."""
    fields = unpack_cols(w)  # (R, 8C) in field order
    idx = torch.tensor(REVERSE, device=w.device)
    return fields.view(w.shape[0], -1, 8).index_select(2, idx).reshape(w.shape[0], -1)


class AwqReader(PackedReader):
    name = "awq"
    suffixes = ("qweight", "qzeros", "scales")

    def params(self, qc: dict, path: Path) -> dict:
        version = str(qc.get("version", "gemm")).lower()
        if version == "gemv" or version == "gemv_fast":
            raise OffloadError(
                f"{path / 'config.json'}: AWQ {version.upper()} layout is not supported; "
                "use an AWQ checkpoint in the GEMM layout (re-export with version='gemm')"
            )
        if version != "gemm":
            raise OffloadError(
                f"{path / 'config.json'}: AWQ version {version!r} is not supported; "
                "use an AWQ checkpoint in the GEMM layout"
            )
        bits4(qc, path, "AWQ")
        if not qc.get("zero_point", True):
            raise OffloadError(
                f"{path / 'config.json'}: AWQ without zero points is not supported; "
                "use an AWQ GEMM checkpoint with zero_point=true"
            )
        return {"method": "awq", "bits": 4, "group_size": group_size(qc, path), "version": "gemm"}

    def shapes(self, q, out_f, in_f, present):
        g = q["group_size"] if q["group_size"] > 0 else in_f
        if in_f % g:
            raise OffloadError(
                f"AWQ: input size {in_f} is not a multiple of group_size {g}; the checkpoint does not match its config"
            )
        groups = in_f // g
        return {"qweight": (in_f, out_f // 8), "qzeros": (groups, out_f // 8), "scales": (groups, out_f)}

    def dequant(self, q, parts, out_f, in_f, dtype):
        g = q["group_size"] if q["group_size"] > 0 else in_f
        zeros = awq_unpack(parts["qzeros"]).to(dtype)  # (G, N)
        scales = parts["scales"].to(dtype)  # (G, N)
        w = awq_unpack(parts["qweight"]).to(dtype).view(-1, g, out_f)  # (G, g, N) codes
        w.sub_(zeros[:, None]).mul_(scales[:, None])  # exact ints, one rounding
        return w.view(in_f, out_f).t()  # (N, K) view


READER = AwqReader()
