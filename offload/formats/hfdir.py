"""What every Hugging Face model directory holds besides its weights, read once for a Checkpoint.

Contract: `read_config(root)` parses config.json (a JSON object with a supported `model_type`, else
one OffloadError line); `hf_config(root)` is transformers' config object for it; `quant_config(cfg)`
its `quantization_config` dict (or None); `checkpoint(root, reader, ...)` the Checkpoint a safetensors
reader opens (headers, tokenizer source, chat template, generation defaults); `is_st_dir(path)`
whether `path` is a directory with config.json and safetensors weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from offload.errors import OffloadError
from offload.formats.base import Checkpoint
from offload.formats.st_index import SafetensorsIndex


def is_st_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_config(root: Path) -> dict:
    from offload.arch.families import SUPPORTED

    cfg_file = root / "config.json"
    try:
        data = json.loads(cfg_file.read_bytes())
    except OSError as exc:
        raise OffloadError(f"{cfg_file}: cannot read ({exc.strerror}); check the model directory") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise OffloadError(f"{cfg_file}: not valid JSON ({str(exc)[:80]}); fix or re-download it") from None
    if not isinstance(data, dict):
        raise OffloadError(f"{cfg_file}: must hold a JSON object; fix or re-download it")
    if not isinstance(data.get("model_type"), str) or not data["model_type"]:
        raise OffloadError(f'{cfg_file}: no "model_type" field; fix or re-download it')
    if data["model_type"] not in SUPPORTED:
        raise OffloadError(
            f"{cfg_file}: unsupported model_type {data['model_type'][:40]!r}; supported: {', '.join(SUPPORTED)}"
        )
    return data


def quant_config(cfg: dict) -> dict | None:
    qc = cfg.get("quantization_config")
    return qc if isinstance(qc, dict) else None


def quant_method(path: Path) -> str | None:
    """`quantization_config.quant_method` of a model directory (None: none, or unreadable)."""
    method = (quant_config(_json(path / "config.json")) or {}).get("quant_method")
    return method if isinstance(method, str) else None


def hf_config(root: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(root)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad config.json
        first = (str(exc).splitlines() or [""])[0][:120]
        raise OffloadError(
            f"{root / 'config.json'}: cannot use it ({exc.__class__.__name__}: {first}); fix or re-download it"
        ) from None


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def chat_template(root: Path) -> str | None:
    """tokenizer_config.json's `chat_template`, else chat_template.jinja / chat_template.json."""
    tpl = _json(root / "tokenizer_config.json").get("chat_template")
    if isinstance(tpl, list):  # named templates: the default one
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(tpl, str):
        return tpl
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(errors="replace")
    tpl = _json(root / "chat_template.json").get("chat_template")
    return tpl if isinstance(tpl, str) else None


def checkpoint(root: Path, reader, fmt: str, cfg: dict, config, quant=None, packed=None, index=None):
    """The Checkpoint of model directory `root` as `reader` opened it (`index`: read here when None; absent
    files give None / {}); the reader's strict check sets `shapes`."""
    index = SafetensorsIndex(root) if index is None else index
    has_tok = any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    return Checkpoint(
        path=root,
        format=fmt,
        config=cfg,
        hf_config=config,
        tensors=index.entries,
        files=list(index.files),
        reader=reader,
        quant=quant,
        packed=packed or {},
        tokenizer_path=root if has_tok else None,
        chat_template=chat_template(root),
        generation=_json(root / "generation_config.json"),
        source_name=index.source_name,
    )
