"""Prompts: a prompt file (or stdin) read as text, and text turned into the target's token ids.

Contract: `read_prompt` returns the text of PROMPT_FILE or '-' (stdin); `encode_prompt` wraps it in
the tokenizer's chat template (one user turn, generation prompt added) when asked and the tokenizer
has one, else encodes it plainly. Bad input raises `SpecxError` with a one-line fix.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specexec_cli.errors import SpecxError


def read_prompt(path: str) -> str:
    """PROMPT_FILE or '-' (stdin) → text; missing, empty and non-UTF-8 input are user errors."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except FileNotFoundError:
        raise SpecxError(f"prompt file {path} not found; pass an existing file or - for stdin") from None
    except IsADirectoryError:
        raise SpecxError(f"prompt file {path} is a directory; pass a text file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecxError(f"prompt file {path} is not UTF-8 text; re-save it as UTF-8") from None
    if not text.strip():
        raise SpecxError(f"prompt file {path} is empty; write a prompt into it")
    return text


def encode_prompt(tokenizer, text: str, chat_template: bool) -> list[int]:
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(text)["input_ids"])


def check_prompt_fits(opts, plan, text: str, chat_template: bool) -> list[int]:
    """The prompt's ids, encoded before any weight loads; a plan that cannot run here
    (planning.require_host), then a prompt that does not fit the context, is refused in one line."""
    from specexec_cli.session.planning import require_host

    require_host(plan)
    ids = encode_prompt(opts.target.tokenizer, text, chat_template)
    limit = plan.ctx if plan is not None else opts.ctx
    if len(ids) + 1 > limit:
        raise SpecxError(
            f"prompt needs {len(ids)} tokens but the context holds {limit} (--ctx {opts.ctx}); fix: "
            f"a larger --ctx (the memory plan says whether it fits) or a shorter prompt"
        )
    return ids
