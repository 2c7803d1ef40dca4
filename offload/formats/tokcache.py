"""A GGUF file's tokenizer, built from its metadata once per machine and kept as tokenizer files.

Contract: `gguf_tokenizer(directory, filename, trust)` returns what
`AutoTokenizer.from_pretrained(directory, gguf_file=filename)` returns, the same ids for every
string, the same special tokens and chat template. transformers builds it by parsing the whole
vocabulary out of the GGUF metadata (about 6 s for a 49,152-token vocabulary on a 2-core CPU, and
`specx run` needed it twice); the first build is saved with `save_pretrained` under
$SPECX_CACHE/tokenizers/<key> (default ~/.cache/specx), key = a hash of the file's resolved path,
size and modification time and the transformers and tokenizers versions, so a changed file or an
upgraded library builds it again. Later loads read those files (about 0.15 s), each a new object. The directory appears whole or not at all (written beside it, then renamed);
a cache that cannot be written (read-only home) leaves the tokenizer built as before.
A gpt-oss file's tokenizer is built by transformers' fast tokenizer class from the tokenizer metadata alone
(transformers' GGUF config reader fails on gpt-oss files); a transformers too old to do that is one OffloadError line.
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
    """transformers' tokenizer of the file. For a gpt-oss file its fast tokenizer class itself: AutoTokenizer
    parses the whole config first, which transformers' GGUF reader fails on for gpt-oss (its YaRN keys), while
    the fast tokenizer reads the tokenizer metadata only (a byte-level BPE, as llama.cpp writes gpt-oss's)."""
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
