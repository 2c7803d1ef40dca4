"""Strict checkpoint checks for the resident (Hugging Face `from_pretrained`) load path.

Contract: a model directory either loads with every parameter taken from its checkpoint, or is
refused with one `SpecxError` line naming the file and the first offending tensor; never is a model
run with randomly initialised weights (tied embeddings are the one exception). Stages, cheapest
first: `check_config` (config.json names a supported `model_type`); opening the checkpoint
(ModelRef.checkpoint: headers agree with config.json before anything is allocated); and
`check_loading_info` after `from_pretrained` (missing, unexpected, mismatched tensors).
"""

from __future__ import annotations

import json
from pathlib import Path

from specexec_cli.errors import SpecxError, offload_errors


def check_config(path: Path, flag: str) -> dict:
    """config.json, which must name a supported `model_type` (offload's check)."""
    from offload.formats import read_config

    with offload_errors(flag):
        return read_config(path)


def config_json(path: Path, name: str = "config.json") -> dict:
    """config.json (or `name`) as a dict, {} where it cannot be read (a broken config.json is
    check_config's to report)."""
    try:
        data = json.loads((Path(path) / name).read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def load_config(path: Path, flag: str, trust: bool):
    """transformers' config object; any parse failure is a one-line error."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust)
    except Exception as exc:  # noqa: BLE001 - every failure here is a bad config.json
        if "trust_remote_code" in str(exc):
            raise SpecxError(f"{flag} {path}: needs custom code; pass --trust-remote-code if you trust it") from None
        first = (str(exc).splitlines() or [""])[0][:120]
        raise SpecxError(
            f"{flag} {path / 'config.json'}: cannot use it ({exc.__class__.__name__}: {first}); fix or re-download it"
        ) from None


def check_loading_info(info: dict, index, flag: str, path: Path, model_type: str) -> None:
    """After from_pretrained: refuse anything HF initialised at random or dropped."""
    source = index.source_name if index is not None else path
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())
    counts = f"{len(missing)} missing, {len(unexpected)} unexpected"
    if missing:
        raise SpecxError(
            f"{flag} {source}: tensor {missing[0]!r} that model_type {model_type!r} needs is missing "
            f"({counts}); the checkpoint does not match config.json - fix it or re-download"
        )
    if unexpected:
        name = unexpected[0]
        where = index.entries[name].file if index is not None and name in index.entries else source
        raise SpecxError(
            f"{flag} {where}: unexpected tensor {name!r} ({counts}; not used by model_type "
            f"{model_type!r}); the checkpoint does not match config.json - fix it or re-download"
        )
    if mismatched:
        name = mismatched[0][0]
        raise SpecxError(
            f"{flag} {source}: tensor {name!r} has the wrong shape for config.json; "
            "the checkpoint does not match its config"
        )
    errors = list(info.get("error_msgs") or ())
    if errors:
        raise SpecxError(f"{flag} {source}: cannot load the weights ({str(errors[0]).splitlines()[0][:120]})")
