"""compressed-tensors checkpoints (llm-compressor), `pack-quantized` W4A16: int4 weights with
per-group or per-channel scales (symmetric, or asymmetric with packed zero points), 16-bit
activations.

Contract: `READER` claims a safetensors directory whose config.json has
`quantization_config.quant_method == "compressed-tensors"`; every config group must be weight-only
4-bit int, strategy "group" or "channel", format "pack-quantized" (else one line naming what is).
Layout of one linear with in_features K, out_features N, G groups (channel: G = 1):
  weight_packed     (N, ceil(K/8)) int32  codes + 8, eight per word along the input dim (field j of word c = column 8c + j)
  weight_scale      (N, G) float          per-group scales
  weight_zero_point (ceil(N/8), G) int32  asymmetric only: zero points + 8, packed along the output dim
  weight_shape      (2,) int              the logical (N, K)
  weight_g_idx      (K,) int              group of each input column (activation ordering "group"; optional)
  W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)], q and z signed in [-8, 7]
"""

from __future__ import annotations

from pathlib import Path

import torch

from offload.errors import OffloadError
from offload.formats.packed import PackedReader, unpack_cols, unpack_rows


class CompressedReader(PackedReader):
    name = "compressed-tensors"
    suffixes = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")

    def params(self, qc: dict, path: Path) -> dict:
        where = f"{path / 'config.json'}: compressed-tensors"
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise OffloadError(f"{where} without config_groups; fix or re-download the checkpoint")
        schemes = []
        for name, grp in groups.items():
            w = grp.get("weights") if isinstance(grp, dict) else None
            fmt = (grp.get("format") if isinstance(grp, dict) else None) or qc.get("format")
            if not isinstance(w, dict) or grp.get("input_activations") or fmt != "pack-quantized":
                raise OffloadError(
                    f"{where} group {name!r} is not pack-quantized W4A16 (format {fmt!r}); "
                    "specx runs int4 weight-only pack-quantized checkpoints"
                )
            if w.get("num_bits") != 4 or w.get("type", "int") != "int" or w.get("strategy") not in ("group", "channel"):
                raise OffloadError(
                    f"{where} group {name!r}: {w.get('num_bits')}-bit {w.get('type')} "
                    f"{w.get('strategy')} weights are not supported; use 4-bit int weights with "
                    "group or channel strategy"
                )
            schemes.append(
                (w["strategy"], w.get("group_size") if w["strategy"] == "group" else -1, bool(w.get("symmetric", True)))
            )
        if len(set(schemes)) != 1:
            raise OffloadError(
                f"{where}: config groups with different schemes are not supported; "
                "use one W4A16 scheme for every linear"
            )
        strategy, group, sym = schemes[0]
        if strategy == "group" and (not isinstance(group, int) or group <= 0):
            raise OffloadError(f"{where}: group strategy with group_size {group!r}; fix or re-download the checkpoint")
        return {
            "method": "compressed-tensors",
            "bits": 4,
            "strategy": strategy,
            "group_size": group,
            "sym": sym,
            "format": "pack-quantized",
        }

    def shapes(self, q, out_f, in_f, present):
        groups = 1 if q["strategy"] == "channel" else -(-in_f // q["group_size"])
        out = {"weight_packed": (out_f, -(-in_f // 8)), "weight_scale": (out_f, groups), "weight_shape": (2,)}
        if not q["sym"] or "weight_zero_point" in present:
            out["weight_zero_point"] = (-(-out_f // 8), groups)
        if "weight_g_idx" in present:
            out["weight_g_idx"] = (in_f,)
        return out

    def dequant(self, q, parts, out_f, in_f, dtype):
        scales = parts["weight_scale"].to(dtype)  # (N, G)
        zp = parts.get("weight_zero_point")
        # stored codes and zero points are the signed values + 8: the offsets cancel when both exist
        zeros = unpack_rows(zp)[:out_f].to(dtype) if zp is not None else torch.full_like(scales, 8)
        w = unpack_cols(parts["weight_packed"])[:, :in_f].to(dtype)  # (N, K) codes + 8
        groups = scales.shape[1]
        gidx = parts.get("weight_g_idx")
        if gidx is None and in_f % groups == 0:
            w.view(out_f, groups, -1).sub_(zeros[:, :, None]).mul_(scales[:, :, None])
            return w
        gi = gidx.long() if gidx is not None else torch.arange(in_f, device=w.device) // q["group_size"]
        return w.sub_(zeros.index_select(1, gi)).mul_(scales.index_select(1, gi))


READER = CompressedReader()
