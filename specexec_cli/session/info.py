"""`specx info PATH`: what a checkpoint is, from its headers and metadata alone (no tensor data).

Contract: `describe(name)` opens the checkpoint once (offload.formats.open_checkpoint) and returns an
`Info`: format, family, layers, stored bytes per layer, quantization, vocabulary, chat template, and
whether specx can run it (else the one-line reason; described as far as its config.json goes). A
name that resolves to nothing is a SpecxError. `rows(info)` is the table the terminal prints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Info:
    path: Path  # what was described
    format: str | None  # formats.FORMATS name; None when it could not be opened
    family: str | None  # config model_type (llama, qwen2, ...)
    layers: int | None  # decoder layers
    layer_bytes: list[int] = field(default_factory=list)  # stored bytes of each decoder layer
    total_bytes: int = 0  # bytes of the weight files
    quant: dict | None = None  # quantization parameters (None: 16/32-bit)
    vocab: int | None = None  # vocabulary size from the config
    template: str | None = None  # chat template (None: none found)
    runnable: bool = False  # specx can load and run it
    reason: str = ""  # why not, one line (empty when runnable)


def describe(name: str) -> Info:
    from offload import OffloadError
    from offload.formats import open_checkpoint
    from specexec_cli.session.strict import config_json

    path = Path(name).expanduser()
    if not path.exists():
        from specexec_cli.session.names import resolve_path

        path = resolve_path(name, "info")
    try:
        ck = open_checkpoint(path)
    except OffloadError as exc:
        cfg = config_json(path)
        qc = cfg.get("quantization_config")
        family = cfg.get("model_type")
        layers = cfg.get("num_hidden_layers")
        quant = qc if isinstance(qc, dict) else None
        return Info(path, None, family, layers, quant=quant, vocab=cfg.get("vocab_size"), reason=str(exc))
    cfg = ck.config.get("text_config") or ck.config
    n = ck.num_layers
    layer_bytes = [ck.layer_bytes(i) for i in range(n)]
    total = sum(f.stat().st_size for f in ck.files)
    family = cfg.get("model_type")
    vocab = cfg.get("vocab_size")
    return Info(path, ck.format, family, n, layer_bytes, total, ck.quant, vocab, ck.chat_template, runnable=True)


def _quant_text(q: dict | None) -> str:
    if not q:
        return "none (16/32-bit weights)"
    keys = (
        "method",
        "quant_method",
        "bits",
        "group_size",
        "strategy",
        "sym",
        "desc_act",
        "checkpoint_format",
        "version",
        "bnb_4bit_quant_type",
        "bnb_4bit_use_double_quant",
        "file_type",
    )
    return ", ".join(f"{k}={q[k]}" for k in keys if k in q) or json.dumps(q)[:120]


def rows(info: Info) -> list[tuple[str, str]]:
    from offload import format_bytes

    lb = info.layer_bytes
    per_layer = "unknown"
    if lb:
        lo, hi = format_bytes(min(lb)), format_bytes(max(lb))
        per_layer = lo if min(lb) == max(lb) else f"{lo} .. {hi}"
    template = "none" if not info.template else f"yes ({len(info.template)} chars)"
    run = "yes" if info.runnable else f"no: {info.reason}"
    return [
        ("path", str(info.path)),
        ("format", info.format or "unknown"),
        ("family", info.family or "unknown"),
        ("layers", str(info.layers) if info.layers is not None else "unknown"),
        ("bytes per layer", per_layer),
        ("weights", format_bytes(info.total_bytes) if info.total_bytes else "unknown"),
        ("quantization", _quant_text(info.quant)),
        ("vocabulary", str(info.vocab or "unknown")),
        ("chat template", template),
        ("specx can run it", run),
    ]
