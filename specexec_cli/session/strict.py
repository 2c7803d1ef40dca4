"""Strict checkpoint checks for the resident (Hugging Face `from_pretrained`) load path.

Contract: a model directory either loads with every parameter taken from its checkpoint, or is
refused with one `SpecxError` line naming the file and the first offending tensor. Never is a
model run with randomly initialised weights (e.g. a Llama checkpoint whose config.json says
`model_type: bert`). Tied embeddings (an absent lm_head when config.json ties it) are the one
documented exception. Three stages, cheapest first:
1. `check_config`: config.json is a JSON object naming a `model_type`.
2. `check_files`: every safetensors header parses and fits its file (offload.st_index does the
   byte-level validation before anything is allocated); returns the index, or None for pickle.
3. `check_architecture` (before the memory plan and before allocating): the architecture
   built on the meta device must agree with the headers (see its docstring), and the weights
   config.json implies must not dwarf the files (a huge `hidden_size` is refused instead of
   allocated). `check_loading_info` (after `from_pretrained(output_loading_info=True)`)
   refuses missing, unexpected and mismatched tensors as HF reports them; HF's report already
   understands key renames, tied weights and pre-quantized formats (bnb `.absmax`, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specexec_cli.errors import SpecxError

# The 16-bit size of the weights config.json implies may be at most this many times the files'
# bytes (an 8-bit file is 2x); beyond that config.json describes a different model.
MAX_EXPANSION = 2
SLACK_BYTES = 64 << 20


def check_config(path: Path, flag: str) -> dict:
    """config.json must be a JSON object with a string `model_type`; returns it."""
    cfg_file = path / "config.json"
    try:
        data = json.loads(cfg_file.read_bytes())
    except OSError as exc:
        raise SpecxError(f"{flag} {cfg_file}: cannot read ({exc.strerror}); check the model directory") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise SpecxError(f"{flag} {cfg_file}: not valid JSON ({str(exc)[:80]}); fix or re-download it") from None
    if not isinstance(data, dict):
        raise SpecxError(f"{flag} {cfg_file}: must hold a JSON object; fix or re-download it")
    if not isinstance(data.get("model_type"), str) or not data["model_type"]:
        raise SpecxError(f"{flag} {cfg_file}: no \"model_type\" field; fix or re-download it")
    from offload.families import SUPPORTED

    if data["model_type"] not in SUPPORTED:
        # Tree verification needs exact 4-D masks and positions, which specx checks per family.
        raise SpecxError(f"{flag} {cfg_file}: unsupported model_type {data['model_type'][:40]!r}; "
                         f"supported: {', '.join(SUPPORTED)}")
    return data


def check_files(path: Path, flag: str):
    """Parse and validate every safetensors header; returns the SafetensorsIndex (None if pickle)."""
    from offload import OffloadError
    from offload.st_index import SafetensorsIndex

    if not any(path.glob("*.safetensors")):
        return None
    try:
        return SafetensorsIndex(path)
    except OffloadError as exc:
        raise SpecxError(f"{flag} {exc}") from None


def load_config(path: Path, flag: str, trust: bool):
    """transformers' config object; any parse failure is a one-line error."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust)
    except Exception as exc:  # noqa: BLE001 - every failure here is a bad config.json
        if "trust_remote_code" in str(exc):
            raise SpecxError(f"{flag} {path}: needs custom code; pass --trust-remote-code if you trust it") from None
        first = (str(exc).splitlines() or [""])[0][:120]
        raise SpecxError(f"{flag} {path / 'config.json'}: cannot use it ({exc.__class__.__name__}: {first}); "
                         "fix or re-download it") from None


def meta_model(config, flag: str, path: Path, trust: bool):
    """The architecture config.json describes, built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()   # stderr carries only our one line (this runs before the load)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust)
    except Exception as exc:  # noqa: BLE001 - unknown model_type, impossible sizes, ...
        first = (str(exc).splitlines() or [""])[0][:120]
        raise SpecxError(f"{flag} {path / 'config.json'}: does not describe a causal LM this build can run "
                         f"({exc.__class__.__name__}: {first}); fix config.json or re-download") from None


_CHECKED: set[str] = set()   # model dirs whose architecture check passed (it runs once per dir)


def check_architecture(path: Path, flag: str, index, cfg: dict) -> None:
    """Before allocating: config.json's architecture (built on the meta device) vs the headers.

    Families specx runs (offload.families.SUPPORTED) store exactly HF's parameter names, so the
    full check applies: missing, unexpected, reshaped or non-float tensors are refused. Other
    types may rename keys on load, so only tensors both sides name are compared here (shape,
    float dtype) and HF's loading report decides the rest. Either way the weights config.json
    implies must not dwarf the files: a wrong architecture is refused, never allocated.
    Skipped for pickle, pre-quantized (`quantization_config`) and custom-code (`auto_map`) dirs.
    """
    from offload import OffloadError
    from offload.families import SUPPORTED
    from offload.st_index import check_tensor_set

    key = str(path.resolve())
    if index is None or key in _CHECKED or "quantization_config" in cfg or "auto_map" in cfg:
        return
    layers = (cfg.get("text_config") or cfg).get("num_hidden_layers", 0)
    if not isinstance(layers, int) or layers < 0 or layers > len(index.entries):
        # Every layer stores at least one tensor; checked before building (a huge count would hang).
        raise SpecxError(f"{flag} {path / 'config.json'}: num_hidden_layers {str(layers)[:20]} does not match the "
                         f"{len(index.entries)} tensors of the checkpoint; fix config.json or re-download")
    config = load_config(path, flag, trust=False)
    model = meta_model(config, flag, path, trust=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    if config.model_type in SUPPORTED:
        tied = getattr(model, "_tied_weights_keys", None) if getattr(config, "tie_word_embeddings", False) else None
        expected = {n: tuple(p.shape) for n, p in params.items()}
        floats = {n for n, p in params.items() if p.dtype.is_floating_point}
        try:
            check_tensor_set(index, expected, f"model_type {config.model_type!r}",
                             tied=dict(tied) if isinstance(tied, dict) else None, float_names=floats)
        except OffloadError as exc:
            raise SpecxError(f"{flag} {exc}") from None
    for name in sorted(n for n in params if n in index.entries):
        e, p = index.entries[name], params[name]
        if tuple(e.shape) != tuple(p.shape):
            raise SpecxError(f"{flag} {e.file}: tensor {name!r} has shape {list(e.shape)}, config.json implies "
                             f"{list(p.shape)}; the checkpoint does not match its config")
        if p.dtype.is_floating_point and not e.dtype.is_floating_point:
            raise SpecxError(f"{flag} {e.file}: tensor {name!r} is stored as {e.dtype} but must be a float; "
                             "the checkpoint is corrupt - re-download it")
    need = sum(p.numel() for p in {id(p): p for p in params.values()}.values()) * 2   # at 16 bits
    have = sum(f.stat().st_size for f in index.files)
    if need > MAX_EXPANSION * have + SLACK_BYTES:
        raise SpecxError(f"{flag} {path / 'config.json'}: describes {need >> 20} MiB of 16-bit weights but the "
                         f"checkpoint holds {have >> 20} MiB; config.json does not match the weights")
    _CHECKED.add(key)


def check_loading_info(info: dict, index, flag: str, path: Path, model_type: str) -> None:
    """After from_pretrained: refuse anything HF initialised at random or dropped."""
    source = index.source_name if index is not None else path
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())
    counts = f"{len(missing)} missing, {len(unexpected)} unexpected"
    if missing:
        raise SpecxError(f"{flag} {source}: tensor {missing[0]!r} that model_type {model_type!r} needs is missing "
                         f"({counts}); the checkpoint does not match config.json - fix it or re-download")
    if unexpected:
        name = unexpected[0]
        where = index.entries[name].file if index is not None and name in index.entries else source
        raise SpecxError(f"{flag} {where}: unexpected tensor {name!r} ({counts}; not used by model_type "
                         f"{model_type!r}); the checkpoint does not match config.json - fix it or re-download")
    if mismatched:
        name = mismatched[0][0]
        raise SpecxError(f"{flag} {source}: tensor {name!r} has the wrong shape for config.json; "
                         "the checkpoint does not match its config")
    errors = list(info.get("error_msgs") or ())
    if errors:
        raise SpecxError(f"{flag} {source}: cannot load the weights ({str(errors[0]).splitlines()[0][:120]})")
