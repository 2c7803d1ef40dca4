"""Strict loading, once, when a checkpoint is opened: the stored tensors are exactly what the
architecture config.json describes needs, in the format's stored form.

Contract: `check_tensors(ckpt, parts)` builds the architecture on the meta device and refuses, in one
OffloadError line naming the file, the first offending tensor and the fix: a missing tensor (but a tied
lm_head), an unexpected one, a wrong shape, a plain tensor stored as a non-float, and 16/32-bit weights
that dwarf the files (MAX_EXPANSION). `parts(hf_weight_name, logical_shape)` gives a packed decoder
weight's stored tensors -> expected shape (None: any), or None when stored plain. Returns the meta
model's parameter shapes (name -> logical shape).
"""

from __future__ import annotations

from collections.abc import Callable

from offload.errors import OffloadError
from offload.formats.base import Checkpoint

MAX_EXPANSION = 2  # 16-bit bytes config.json implies / bytes of a 16-bit checkpoint's files
SLACK_BYTES = 64 << 20

Parts = Callable[[str, tuple[int, ...]], "dict[str, tuple[int, ...] | None] | None"]


def meta_model(ckpt: Checkpoint):
    from offload.arch.families import meta_model

    cfg = ckpt.config.get("text_config") or ckpt.config
    layers = cfg.get("num_hidden_layers", 0)
    if not isinstance(layers, int) or layers < 0 or layers > len(ckpt.tensors):
        # Every layer stores at least one tensor; checked before building (a huge count would hang).
        raise OffloadError(
            f"{ckpt.root / 'config.json'}: num_hidden_layers {str(layers)[:20]} does not match the "
            f"{len(ckpt.tensors)} tensors of the checkpoint; fix config.json or re-download"
        )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return meta_model(ckpt.hf_config, ckpt.root / "config.json")


def _tied(hf, config) -> dict[str, str]:
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    keys = getattr(hf, "_tied_weights_keys", None)
    return dict(keys) if isinstance(keys, dict) else {"lm_head.weight": "model.embed_tokens.weight"}


def check_tensors(ckpt: Checkpoint, parts: Parts) -> dict[str, tuple[int, ...]]:
    hf = meta_model(ckpt)
    params = {n: p for n, p in hf.named_parameters(remove_duplicate=False)}
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    expected: dict[str, tuple[int, ...] | None] = {}
    floats = set()
    for name, shape in shapes.items():
        packed = parts(name, shape) if name.startswith("model.layers.") else None
        if packed:
            expected.update(packed)
        else:
            expected[name] = shape
            if params[name].dtype.is_floating_point:
                floats.add(name)
    tied = _tied(hf, ckpt.hf_config)
    what = f"model_type {ckpt.hf_config.model_type!r}"
    missing = sorted(n for n in expected if n not in ckpt.tensors and n not in tied)
    unexpected = sorted(n for n in ckpt.tensors if n not in expected and not n.endswith("inv_freq"))
    if missing:
        raise OffloadError(
            f"{ckpt.source_name or ckpt.path}: tensor {missing[0]!r} that {what} needs is missing ({len(missing)} "
            f"missing, {len(unexpected)} unexpected); the checkpoint does not match config.json - fix it or re-download"
        )
    if unexpected:
        e = ckpt.tensors[unexpected[0]]
        raise OffloadError(
            f"{e.file}: unexpected tensor {e.name!r} ({len(unexpected)} not used by {what}); the checkpoint "
            "does not match config.json - fix it or re-download"
        )
    for name in sorted(n for n in expected if n in ckpt.tensors):
        e, want = ckpt.tensors[name], expected[name]
        if want is not None and tuple(e.shape) != tuple(want):
            raise OffloadError(
                f"{e.file}: tensor {name!r} has shape {list(e.shape)}, config.json implies "
                f"{list(want)}; the checkpoint does not match its config"
            )
        if name in floats and e.qtype is None and not e.dtype.is_floating_point:
            raise OffloadError(
                f"{e.file}: tensor {name!r} is stored as {e.dtype} but must be a float; "
                "the checkpoint is corrupt or not in this format - re-download it"
            )
    if not ckpt.quantized:
        need = sum(p.numel() for p in {id(p): p for p in params.values()}.values()) * 2  # at 16 bits
        have = sum(f.stat().st_size for f in ckpt.files)
        if need > MAX_EXPANSION * have + SLACK_BYTES:
            raise OffloadError(
                f"{ckpt.root / 'config.json'}: describes {need >> 20} MiB of 16-bit weights but the "
                f"checkpoint holds {have >> 20} MiB; config.json does not match the weights"
            )
    return shapes
