"""The 4-bit cache: a 16-bit checkpoint quantized ONCE into a pre-quantized bitsandbytes checkpoint.

Contract:
- `write_quantized(src, out, progress, tokenizer)` writes a checkpoint in prequant.py's format that
  transformers' `from_pretrained` loads too: one safetensors shard per decoder layer (every nn.Linear
  weight NF4-packed from its 16-bit values, everything else as stored), one for the other tensors, the
  index, `config.json` with `quantization_config` and (tokenizer=True) the source's tokenizer files. It
  is written into a temporary sibling, `specx-manifest.json` (file sizes, source fingerprint) LAST, then
  renamed into place: a directory without a matching manifest is never used.
- `ensure_nf4_cache(src, progress, packing)` -> the cache directory for `src` (a 16-bit Checkpoint or its
  directory) under `cache_root()`, (re)built when missing, partial, stale or corrupt (with an OffloadNotice
  when it existed); its name's key covers the source files' names, sizes and mtimes, the settings and the
  packing (`keyed_path`).
- `packing` (nf4.packing_for(device)): "standard" is bnb's serialized layout; nf4.CPU_PACKING stores the
  bytes in bnb's fused CPU kernel's layout (nf4.cpu_relayout), marked `"specx_packing"` in config.json.
- `progress(done, total, what)` is called once per layer while quantizing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from offload.cachedir import cache_root
from offload.errors import OffloadError, OffloadNotice
from offload.formats import Checkpoint, open_checkpoint
from offload.formats.prequant import quant_tensors
from offload.quant.nf4 import (
    CPU_PACKING,
    NF4_BLOCKSIZE,
    NF4_COMPRESS_STATISTICS,
    cpu_layout_fits,
    cpu_relayout,
    quantize_nf4,
)

MANIFEST = "specx-manifest.json"
FORMAT_VERSION = 2
SETTINGS = {
    "format": FORMAT_VERSION,
    "quant_type": "nf4",
    "blocksize": NF4_BLOCKSIZE,
    "double_quant": NF4_COMPRESS_STATISTICS,
    "quant_from": "16-bit source dtype (fp32 -> bf16)",
}
_WEIGHT_FILES = ("config.json", "model.safetensors.index.json")
_SIDE_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|generation_config\.json|.*\.model|vocab\..*|"
    r"merges\.txt|chat_template\.(jinja|json)|added_tokens\.json)$"
)
Progress = Callable[[int, int, str], None]


def source_fingerprint(src: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of the files that define the weights."""
    files = [src / n for n in _WEIGHT_FILES if (src / n).exists()] + sorted(src.glob("*.safetensors"))
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def manifest_source(out: Path) -> Path | None:
    """The 16-bit checkpoint a cache directory was built from (None: not one of our caches)."""
    try:
        return Path(json.loads((Path(out) / MANIFEST).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def settings(packing: str = "standard") -> dict:
    return {**SETTINGS, "packing": packing}


def keyed_path(src: Path, kind: str, extra: dict) -> Path:
    """cache_root()/<src's folder name>-<kind>-<key>, the key 24 hex digits of SHA-256 over the source's
    weight files (source_fingerprint) and `extra`: a changed source or setting is a new path."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", src.resolve().name) or "model"
    blob = json.dumps({"files": source_fingerprint(src), **extra}, sort_keys=True)
    return cache_root() / f"{name}-{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:24]}"


def cache_key(src: Path, packing: str = "standard") -> str:
    """The key in cache_dir(src, packing)'s name (its manifest records it)."""
    return cache_dir(src, packing).name.rsplit("-", 1)[1]


def cache_dir(src: Path, packing: str = "standard") -> Path:
    return keyed_path(src, "nf4", {"settings": settings(packing)})


def is_complete(out: Path, key: str | None = None) -> bool:
    """A manifest written last, matching `key` (when given), and every file at its recorded size."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        if key is not None and manifest.get("key") != key:
            return False
        return all((out / name).stat().st_size == size for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def ensure_nf4_cache(src: Path, progress: Progress | None = None, packing: str = "standard") -> Path:
    ckpt = src if isinstance(src, Checkpoint) else None
    src = ckpt.path if ckpt is not None else Path(src)
    out, key = cache_dir(src, packing), cache_key(src, packing)
    bad = _unusable(out, key)
    if bad:
        if out.exists():
            warnings.warn(f"offload: the 4-bit cache {out} is {bad}; rebuilding it", OffloadNotice, stacklevel=2)
            shutil.rmtree(out, ignore_errors=True)
        write_quantized(ckpt or src, out, progress, tokenizer=True, key=key, packing=packing)
        source = str(src.resolve())
        drop_stale(
            out,
            MANIFEST,
            lambda m: m.get("source") == source and m.get("settings", {}).get("packing", "standard") == packing,
        )
    return out


def _unusable(out: Path, key: str) -> str:
    """Why the cache at `out` cannot be used ("" when it can): incomplete, stale, or a corrupt shard header."""
    if not is_complete(out, key):
        return "incomplete or stale"
    from offload.formats.st_index import SafetensorsIndex

    try:
        SafetensorsIndex(out)
    except (OffloadError, OSError, ValueError):
        return "corrupt (unreadable safetensors header)"
    return ""


def drop_stale(keep: Path, record: str, same: Callable[[dict], bool]) -> None:
    """Remove the caches beside `keep` of the same name and kind whose JSON `record` file satisfies `same`
    (older caches of the same source and settings: their key no longer matches the source's files)."""
    for old in keep.parent.glob(keep.name.rsplit("-", 1)[0] + "-*"):
        try:
            stale = old != keep and same(json.loads((old / record).read_text()))
        except (OSError, ValueError, AttributeError):
            stale = False
        if stale:
            shutil.rmtree(old, ignore_errors=True)


def _shard(index: Checkpoint, names: list[str], linears: set[str], packing: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in names:
        t = index.read(name)
        if name in linears:
            # on the GPU when there is one (minutes of CPU per 70B layer otherwise); quant_tensors moves to the host
            dev = torch.device("cuda" if torch.cuda.is_available() and packing != CPU_PACKING else "cpu")
            dtype = t.dtype if t.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16  # fp32 -> bf16
            packed, state = quantize_nf4(t, dev, dtype)
            if packing == CPU_PACKING and cpu_layout_fits(state):
                # same ((N*K+1)//2, 1) shape, bytes in the kernel's (N, K/2) block layout
                packed = cpu_relayout(packed, tuple(state.shape)).reshape(packed.shape)
            tensors.update(quant_tensors(name, packed, state))
        else:
            tensors[name] = t.contiguous()
    return tensors


def write_quantized(
    src: Path,
    out: Path,
    progress: Progress | None = None,
    tokenizer: bool = True,
    key: str | None = None,
    packing: str = "standard",
) -> None:
    """`src`: the opened 16-bit Checkpoint (a directory is opened here)."""
    from safetensors.torch import save_file

    index = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    src, out, config = index.path, Path(out), index.hf_config
    if index.quantized:
        raise OffloadError(f"{src / 'config.json'}: already quantized ({index.format}); quantize a 16-bit checkpoint")
    linears = {n for n, shape in index.shapes.items() if n.startswith("model.layers.") and len(shape) == 2}
    n = config.num_hidden_layers
    per_layer = [[k for k in index.entries if k.startswith(f"model.layers.{i}.")] for i in range(n)]
    rest = sorted(set(index.entries) - {k for names in per_layer for k in names})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        weight_map, dtype = {}, None
        for i, names in enumerate([*per_layer, rest]):
            if progress is not None:
                progress(i, n, f"quantizing layer {i} to nf4 (once)" if i < n else "writing embeddings")
            tensors = _shard(index, names, linears, packing)
            dtype = dtype or next((t.dtype for t in tensors.values() if t.is_floating_point()), None)
            fname = f"model-{i + 1:05d}-of-{n + 1:05d}.safetensors"
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in tensors})
        total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
        _write_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_config(src, tmp, dtype or torch.bfloat16, packing)
        if tokenizer:
            for f in src.iterdir():
                if f.is_file() and _SIDE_FILES.match(f.name):
                    shutil.copy2(f, tmp / f.name)
        files = {f.name: f.stat().st_size for f in tmp.iterdir()}
        _write_json(
            tmp / MANIFEST,
            {
                "key": key,
                "source": str(src.resolve()),
                "settings": settings(packing),
                "source_files": source_fingerprint(src),
                "files": files,
            },
        )
        _publish(tmp, out, key)
        if progress is not None:
            progress(n, n, "quantized")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, out: Path, key: str | None) -> None:
    """Atomic rename into place, replacing a stale/partial `out`; a concurrent builder may win.
    Only an empty directory or one of ours (it has a manifest, or none yet) is ever replaced."""
    if out.exists():
        if is_complete(out, key) and key is not None:
            shutil.rmtree(tmp)
            return
        ours = out.is_dir() and (not any(out.iterdir()) or (out / MANIFEST).exists() or key is not None)
        if not ours:  # write_quantized removes tmp
            raise OffloadError(f"{out}: exists and is not a specx 4-bit checkpoint; choose another directory")
        shutil.rmtree(out)
    try:
        os.rename(tmp, out)
    except OSError:
        if key is not None and is_complete(out, key):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        raise


def _write_config(src: Path, out: Path, dtype: torch.dtype, packing: str) -> None:
    cfg = json.loads((src / "config.json").read_text())
    if packing != "standard":
        cfg["specx_packing"] = packing
    name = str(dtype).removeprefix("torch.")
    cfg["quantization_config"] = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "load_in_8bit": False,
        "_load_in_4bit": True,
        "_load_in_8bit": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": NF4_COMPRESS_STATISTICS,
        "bnb_4bit_compute_dtype": name,
        "bnb_4bit_quant_storage": "uint8",
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "llm_int8_skip_modules": None,
        "llm_int8_threshold": 6.0,
    }
    _write_json(out / "config.json", cfg)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
