"""A GGUF file's tokenizer, built from its metadata once per machine and kept as tokenizer files.

Contract: `gguf_tokenizer(directory, filename, trust)` returns what
`AutoTokenizer.from_pretrained(directory, gguf_file=filename)` returns. The first build (seconds: the
whole vocabulary parsed from the metadata) is saved under $SPECX_CACHE/tokenizers/<key>, key = a hash
of the file's path, size and mtime and the transformers and tokenizers versions; later loads read those
files. The directory appears whole or not at all; an unwritable cache leaves the tokenizer built as
before. A gpt-oss file's tokenizer is built by the fast tokenizer class (transformers' GGUF config
reader fails on gpt-oss files); a transformers too old for that is one OffloadError line.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def _key(file: Path) -> str:
    import tokenizers
    import transformers

    st = file.stat()
    parts = (str(file.resolve()), st.st_size, st.st_mtime_ns, transformers.__version__, tokenizers.__version__)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


def gguf_tokenizer(directory: Path, filename: str, trust: bool = False):
    from transformers import AutoTokenizer

    from offload.cachedir import cache_root

    saved = cache_root() / "tokenizers" / _key(Path(directory) / filename)
    if (saved / "tokenizer_config.json").exists():
        tok = AutoTokenizer.from_pretrained(saved, trust_remote_code=trust)
    else:
        tok = _from_gguf(Path(directory), filename, trust)
        _save(tok, saved)
    return tok


def _from_gguf(directory: Path, filename: str, trust: bool):
    """transformers' tokenizer of the file (gpt-oss: the fast tokenizer class, which reads only its metadata)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from offload.errors import OffloadError
    from offload.formats import gguf_meta

    if gguf_meta.value(gguf_meta.read_part(directory / filename), "general.architecture") != "gpt-oss":
        return AutoTokenizer.from_pretrained(directory, gguf_file=filename, trust_remote_code=trust)
    try:
        return PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=filename)
    except (TypeError, ValueError, KeyError) as exc:  # older transformers read the whole config here too
        import transformers

        raise OffloadError(
            f"{directory / filename}: transformers {transformers.__version__} cannot build a gpt-oss GGUF's "
            f"tokenizer ({exc.__class__.__name__}); upgrade transformers to 5.24, which builds it"
        ) from None


def _save(tok, saved: Path) -> None:
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=saved.name + ".", dir=saved.parent))
    except OSError:
        return
    try:
        tok.save_pretrained(tmp)
        os.replace(tmp, saved)
    except OSError:  # another process renamed its copy first, or the disk is full: keep what exists
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
