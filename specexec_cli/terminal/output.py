"""Raw generated text on stdout, optionally coloured by where each token came from.

Contract: `TextSink` is the one writer of generated text: exactly as decoded, no markup parser, a
flush per chunk. With colour on, a chunk's leading `draft_chars` characters (tokens accepted from the
draft's tree) are in an SGR colour, reset at every newline. Imports neither rich nor torch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TextIO

DRAFT_SGR = "\x1b[36m"  # cyan: tokens accepted from the draft's tree
RESET_SGR = "\x1b[0m"


def use_color(flag: bool | None, stream: TextIO | None = None) -> bool:
    """--color/--no-color when given; else on for a terminal unless NO_COLOR is set (no-color.org)."""
    stream = stream if stream is not None else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        tty = False
    if not tty:
        return False  # piped stdout never gets escape codes, whatever the flag says
    return flag if flag is not None else not os.environ.get("NO_COLOR")


def paint(text: str, sgr: str) -> str:
    """`text` in colour `sgr`, closed before each newline and reopened after it."""
    return "\n".join(f"{sgr}{line}{RESET_SGR}" if line else "" for line in text.split("\n"))


@dataclass
class TextSink:
    """Callable writer: sink(text[, draft_chars]); draft_chars defaults to text.draft_chars. Tracks whether the output ends a line."""

    color: bool = False  # wrap draft-accepted text in DRAFT_SGR
    stream: TextIO = field(default_factory=lambda: sys.stdout)  # where the text goes
    ended_line: bool = True  # the last character written was a newline (or nothing was written)
    owed: bool = False  # end_line() wrote a newline the caller may still write: it is dropped once

    def __call__(self, text: str, draft_chars: int | None = None) -> None:
        if not text:
            return
        if draft_chars is None:  # engine.TextChunk carries it; a plain str has none
            draft_chars = getattr(text, "draft_chars", 0)
        if self.owed and text.startswith("\n"):  # the newline end_line() already wrote
            text, draft_chars = text[1:], max(draft_chars - 1, 0)
        self.owed = False
        if not text:
            return
        if self.color and draft_chars > 0:
            out = paint(text[:draft_chars], DRAFT_SGR) + text[draft_chars:]
        else:
            out = text
        self.stream.write(out)
        self.stream.flush()
        self.ended_line = text.endswith("\n")

    def end_line(self) -> None:
        """Finish a partial last line now; a "\n" the caller writes next is then dropped (stdout unchanged)."""
        if not self.ended_line:
            self.stream.write("\n")
            self.stream.flush()
            self.ended_line, self.owed = True, True
