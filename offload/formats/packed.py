"""What the packed-int4 safetensors layouts (AWQ, GPTQ, compressed-tensors) share.

Contract: a `PackedReader` subclass's `name` is config.json's `quant_method` and its format; its
`suffixes` are the stored tensors of one linear (the first marks a linear as packed). It implements
`params(qc, path)` (validated parameters, or a one-line OffloadError), `shapes(q, out_f, in_f,
present)` (the stored shapes config.json implies) and `dequant(q, parts, out_f, in_f, dtype)`: the
(out_f, in_f) weight by torch ops, in place on the codes, maybe a transposed view (its peak is what
planning/membytes.linear_dequant_bytes counts). `open` validates headers, parameters and the tensor
set (validate.check_tensors), dtypes included. `load_weight` runs `dequant` torch.compile'd where
gguf_quants.kernel_choice says so (the same values).
"""

from __future__ import annotations

from pathlib import Path

import torch

from offload.errors import OffloadError
from offload.formats import gguf_quants as gq
from offload.formats import hfdir, validate
from offload.formats.base import Checkpoint, as_stored
from offload.formats.st_index import SafetensorsIndex

INT32_PARTS = ("qweight", "qzeros", "g_idx", "weight_packed", "weight_zero_point", "weight_g_idx")


def _nibbles(w: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (R, C, 8) uint8: field j (bits [4j, 4j+4)) of each word, via its bytes
    (little-endian: byte b holds fields 2b and 2b + 1), so no int32 copy of every code is made."""
    return gq.halves(w.contiguous().view(torch.uint8).view(*w.shape, 4), -1).view(*w.shape, 8)


def unpack_cols(w: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (R, 8C) uint8 in [0, 15]: word c's field j becomes column 8c + j."""
    return _nibbles(w).view(w.shape[0], -1)


def unpack_rows(w: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (8R, C) uint8 in [0, 15]: word r's field j becomes row 8r + j."""
    return _nibbles(w).permute(0, 2, 1).reshape(8 * w.shape[0], w.shape[1])


def group_count(in_f: int, group: int) -> int:
    """Groups along the input dim (group -1 or 0: one group over all of it)."""
    return 1 if group in (-1, 0) or group is None else -(-in_f // group)


class PackedReader:
    name = "packed"
    suffixes: tuple[str, ...] = ()

    def detect(self, path: Path) -> bool:
        return hfdir.is_st_dir(path) and hfdir.quant_method(path) == self.name

    def params(self, qc: dict, path: Path) -> dict:
        raise NotImplementedError

    def shapes(self, q: dict, out_f: int, in_f: int, present: set[str]) -> dict[str, tuple[int, ...] | None]:
        raise NotImplementedError

    def dequant(
        self, q: dict, parts: dict[str, torch.Tensor], out_f: int, in_f: int, dtype: torch.dtype
    ) -> torch.Tensor:
        raise NotImplementedError

    def open(self, path: Path) -> Checkpoint:
        cfg = hfdir.read_config(path)
        quant = self.params(hfdir.quant_config(cfg) or {}, path)
        index = SafetensorsIndex(path)
        packed = self._group(index.entries)
        ckpt = hfdir.checkpoint(path, self, self.name, cfg, hfdir.hf_config(path), quant, packed, index)

        def parts(name, shape):
            if name not in packed or len(shape) != 2:
                return None
            base = name[: -len(".weight")]
            present = {p[len(base) + 1 :] for p in packed[name]}
            want = self.shapes(quant, shape[0], shape[1], present)  # a stored part not in `want` is unexpected
            return {f"{base}.{s}": want[s] for s in want}

        ckpt.shapes = validate.check_tensors(ckpt, parts)
        self._check_dtypes(ckpt)
        return ckpt

    def _group(self, entries) -> dict[str, tuple[str, ...]]:
        """HF weight `X.weight` -> stored `X.<suffix>` for every linear stored packed."""
        mark = self.suffixes[0]
        out = {}
        for name in entries:
            if name.endswith(f".{mark}"):
                base = name[: -len(mark) - 1]
                out[f"{base}.weight"] = tuple(f"{base}.{s}" for s in self.suffixes if f"{base}.{s}" in entries)
        return out

    def _check_dtypes(self, ckpt: Checkpoint) -> None:
        for names in ckpt.packed.values():
            for n in names:
                e = ckpt.tensors[n]
                want_int = n.rsplit(".", 1)[-1] in INT32_PARTS
                ints = (torch.int32, torch.int64) if n.endswith("g_idx") else (torch.int32,)
                if want_int and e.dtype not in ints:
                    raise OffloadError(
                        f"{e.file}: tensor {n!r} is {e.dtype}, the {self.name} layout stores "
                        "int32 there; the checkpoint is corrupt or not in this format - re-download it"
                    )
                if not want_int and n.rsplit(".", 1)[-1] != "weight_shape" and not e.dtype.is_floating_point:
                    raise OffloadError(
                        f"{e.file}: tensor {n!r} is {e.dtype} but must be a float; "
                        "the checkpoint is corrupt - re-download it"
                    )

    def load_weight(self, ckpt: Checkpoint, hf_weight_name: str, raw, device, dtype) -> torch.Tensor:
        out_f, in_f = ckpt.logical_shape(hf_weight_name)
        base = hf_weight_name[: -len(".weight")]
        parts = {
            n[len(base) + 1 :]: as_stored(ckpt.tensors[n], raw[n]).to(device) for n in ckpt.stored_parts(hf_weight_name)
        }
        if gq.kernel_choice(device) == "compiled" and gq.kernel_status() is None:
            w = gq.run_compiled(self.name, self.dequant, ckpt.quant, parts, out_f, in_f, dtype)
            if w is not None:
                return w
        return self.dequant(ckpt.quant, parts, out_f, in_f, dtype)


def bits4(qc: dict, path: Path, what: str) -> None:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise OffloadError(
            f"{path / 'config.json'}: {what} with {bits} bits is not supported; specx runs 4-bit "
            f"{what} (use a 4-bit checkpoint)"
        )


def group_size(qc: dict, path: Path, key: str = "group_size") -> int:
    g = qc.get(key, qc.get("q_group_size", -1))
    if not isinstance(g, int) or (g <= 0 and g != -1):
        raise OffloadError(
            f"{path / 'config.json'}: bad quantization_config.{key} {str(g)[:20]!r}; fix or re-download the checkpoint"
        )
    return g
