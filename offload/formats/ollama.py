"""Ollama model names -> the GGUF blob ollama keeps for them, read-only.

Contract: `resolve(name)` maps an ollama model name (`llama3.1:70b`, `host/namespace/model:tag`; tag
`latest` and namespace `library` by default) to an `OllamaModel`: the GGUF blob under `$OLLAMA_MODELS`
(default ~/.ollama/models) that its manifest names as its model layer, plus its params layer's sampling
parameters. None when `name` is not a model name or has no manifest; OffloadError (one line) when
the manifest is unreadable or its blob is missing.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from offload.errors import OffloadError

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
MODEL_MEDIA = "application/vnd.ollama.image.model"
PARAMS_MEDIA = "application/vnd.ollama.image.params"
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME = re.compile(rf"^(?:(?:{_PART}/)?{_PART}/)?{_PART}(?::[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclass(frozen=True)
class OllamaModel:
    blob: Path  # the GGUF file (blobs/sha256-<hex>)
    params: dict  # the params layer: temperature, top_k, top_p, stop, ...


def models_dir() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def manifest_path(name: str, root: Path) -> Path | None:
    """The manifest file of `name`, or None when `name` is not an ollama model name."""
    if not _NAME.match(name) or name.startswith((".", "/")):
        return None
    model, _, tag = name.partition(":")
    parts = model.split("/")
    host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
    if len(parts) == 3:
        host, namespace, model = parts
    elif len(parts) == 2:
        namespace, model = parts
    return root / "manifests" / host / namespace / model / (tag or "latest")


def _blob(root: Path, digest: str, manifest: Path) -> Path:
    if not isinstance(digest, str) or not re.match(r"^sha256[:-][0-9a-f]{64}$", digest):
        raise OffloadError(f"{manifest}: bad layer digest {str(digest)[:80]!r}; re-pull the model with ollama")
    return root / "blobs" / digest.replace(":", "-")


def resolve(name: str) -> OllamaModel | None:
    root = models_dir()
    manifest = manifest_path(name, root)
    if manifest is None or not manifest.is_file():
        return None
    try:
        data = json.loads(manifest.read_bytes())
        layers = data["layers"]
        model = [lay for lay in layers if lay.get("mediaType") == MODEL_MEDIA]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise OffloadError(f"{manifest}: not an ollama manifest; re-pull the model with `ollama pull {name}`") from None
    if not model:
        raise OffloadError(f"{manifest}: names no model layer; re-pull the model with `ollama pull {name}`")
    blob = _blob(root, model[0].get("digest"), manifest)
    if not blob.is_file():
        raise OffloadError(
            f"{blob}: the blob of ollama model {name!r} is missing; re-pull it with `ollama pull {name}`"
        )
    params = {}
    for lay in layers:
        if lay.get("mediaType") == PARAMS_MEDIA:
            try:
                got = json.loads(_blob(root, lay.get("digest"), manifest).read_bytes())
            except (OSError, ValueError, RecursionError):
                got = {}
            params = got if isinstance(got, dict) else {}
    return OllamaModel(blob, params)
