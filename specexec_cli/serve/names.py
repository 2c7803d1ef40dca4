"""The model id `specx serve` lists in /v1/models and puts in every response, and the ids it also takes.

Contract: `model_id(target, resolved)` is a name a person would call the model, never a path: the
demo pair is `specx-demo`; a `.gguf` file its `gguf_stem` (no split-part suffix, no quantization
tag); an extension-less GGUF blob its `general.name` (else its file name); a directory its name (a
hub cache snapshot `models--org--name/snapshots/<hash>`: `org/name`); a name that is not a path (hub
id, ollama name) as the user wrote it, unless it resolved to a distribution's `.gguf` (its stem).
`aliases(target, resolved, name)`: the --target as given, its path and absolute path, for which
GET /v1/models/{id} also answers with the card of `name` (clients configured with a path still work).
"""

from __future__ import annotations

import re
from pathlib import Path

# The quantization tag at the end of a GGUF file's stem, after ".", "-" or "_": Q4_1, Q4_K_M, IQ3_XS,
# Q8_0, F16, BF16, F32, FP16 (llama.cpp's and the hub uploaders' spellings, any case).
_QUANT = re.compile(r"[-._](?:I?Q\d(?:_[A-Z0-9]+)*|B?F16|F32|FP16|FP32)$", re.IGNORECASE)
_SPLIT = re.compile(r"-\d{5}-of-\d{5}$")


def gguf_stem(file_name: str) -> str:
    """`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct` (the stem when nothing is left)."""
    stem = file_name[: -len(".gguf")] if file_name.lower().endswith(".gguf") else file_name
    stem = _SPLIT.sub("", stem)
    bare = _QUANT.sub("", stem)
    return bare or stem


def _gguf_name(path: Path) -> str:
    """A GGUF file's name: its stem (see gguf_stem); an extension-less blob's general.name."""
    if path.suffix.lower() == ".gguf":
        return gguf_stem(path.name)
    try:
        from offload.formats import gguf_value, read_gguf_part

        name = gguf_value(read_gguf_part(path), "general.name")
    except Exception:  # noqa: BLE001 - a header we cannot read names nothing; the file name does
        name = None
    return str(name).strip() if name and str(name).strip() else path.name


def model_id(target: str, resolved: Path | None = None) -> str:
    """The served model's id (module contract); `resolved`: the path --target resolved to, if any."""
    from specexec_cli.session.names import DEMO_DIR

    path = Path(target).expanduser()
    if path.exists():
        if path.resolve() == (DEMO_DIR / "target").resolve():
            return "specx-demo"
        if path.is_dir():
            path = path.resolve()
            repo = path.parent.parent.name
            if path.parent.name == "snapshots" and repo.startswith("models--"):  # a hub cache snapshot
                return repo[len("models--") :].replace("--", "/")
            return path.name
        return _gguf_name(path)
    if resolved is not None and resolved.is_file() and resolved.suffix.lower() == ".gguf":
        return gguf_stem(resolved.name)  # an installed distribution's GGUF, named by its file
    return target  # a hub id or an ollama name, as the user wrote it


def aliases(target: str, resolved: Path | None, name: str) -> set[str]:
    ids = {target}
    for path in (Path(target).expanduser(), resolved):
        if path is not None and path.exists():
            ids |= {str(path), str(path.resolve())}
    ids.discard(name)
    return ids
