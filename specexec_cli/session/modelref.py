"""One model a command names (`--target`, `--draft`): resolved, checked, opened and tokenized once.

Contract: a `ModelRef` is made once per command (options.pick_refs, or `LoadOptions` from a plain name)
and passed to planning, the package check, the prompt check and loading, which read its parts: `path`,
`format`, `safe` (the weights check), `checkpoint` (validated) and `tokenizer`, each computed on first
use and kept. Errors are one SpecxError line that starts with the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from specexec_cli.errors import SpecxError, offload_errors
from specexec_cli.session.names import is_gguf, ollama_blob, resolve_path
from specexec_cli.session.strict import check_config

SELF = "self"  # --draft self: the target's own low-bit substitute (offload/selfdraft/build.py)
AUTO = "auto"  # --draft auto (or no --draft): the candidate with the most modelled tokens/s


@dataclass(frozen=True)
class ModelRef:
    """What names the model is frozen; the parts below fill in on first use (cached_property)."""

    flag: str  # the flag that named it, "--target" or "--draft": the start of its error lines
    name: str  # what the user wrote: a dir, a .gguf file, demo, an ollama name, a distribution, a hub id
    allow_pickle: bool = False  # --allow-pickle: pickle (.bin) weights may load (resident, unplanned)
    trust: bool = False  # --trust-remote-code: its tokenizer and model may run the checkpoint's code

    @cached_property
    def path(self) -> Path:
        return resolve_path(self.name, self.flag)

    @cached_property
    def format(self) -> str:
        """How the weights are stored, from file names: gguf | safetensors | pickle | "" (none)."""
        if is_gguf(self.path):
            return "gguf"
        if any(self.path.glob("*.safetensors")):
            return "safetensors"
        return "pickle" if any(any(self.path.glob(p)) for p in ("*.bin", "*.pt", "*.pth")) else ""

    @cached_property
    def safe(self) -> bool:
        """The weights check: True for safetensors or GGUF, False for pickle under --allow-pickle."""
        return check_weights(self)

    @cached_property
    def checkpoint(self):
        """The validated offload.formats.Checkpoint (an ollama name's with its params over the file's)."""
        if is_gguf(self.path) and ollama_blob(self.name, self.flag) == self.path:
            from offload.formats import GGUF_READER

            with offload_errors(self.flag):
                return GGUF_READER.open_ollama(self.name)
        return open_checkpoint(self.path, self.flag)

    @cached_property
    def tokenizer(self):
        """Its tokenizer (a GGUF's is built from the file's metadata)."""
        from transformers import AutoTokenizer

        try:
            if self.format == "gguf":
                return self.checkpoint.load_tokenizer(self.trust)
            return AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust)
        except Exception as exc:
            raise SpecxError(
                f"{self.flag} {self.path}: cannot load the tokenizer ({exc.__class__.__name__}); "
                "the model directory needs tokenizer files"
            ) from None


def check_weights(ref: ModelRef) -> bool:
    path, flag = ref.path, ref.flag
    if ref.format != "gguf":
        if not (path / "config.json").is_file():
            raise SpecxError(f"{flag} {path}: missing config.json; is this a Hugging Face model directory?")
        check_config(path, flag)
    if ref.format in ("gguf", "safetensors"):
        return ref.checkpoint is not None  # opening it reads the headers and checks config.json against them
    if ref.format == "pickle" and ref.allow_pickle:
        return False
    if ref.format == "pickle":
        raise pickle_refused(ref)
    raise SpecxError(f"{flag} {path}: no weights (*.safetensors) found; the model directory is incomplete")


def pickle_refused(ref: ModelRef) -> SpecxError:
    return SpecxError(
        f"{ref.flag} {ref.path}: only pickle (.bin) weights found, which can run arbitrary code; "
        "convert to safetensors or pass --allow-pickle if you trust the source"
    )


def open_checkpoint(path: Path, flag: str):
    """The validated Checkpoint of a path no ModelRef names (the plan's 4-bit cache)."""
    from offload.formats import open_checkpoint as open_ck

    with offload_errors(flag):
        return open_ck(path)
