"""Incremental detokenizing: token ids in, newly printable text out.

Contract: `TextStream.feed` returns only text that will not change when more tokens arrive (an
incomplete UTF-8 sequence waits); `feed_split` marks how much of it came from the draft's tree.
"""

from __future__ import annotations


class TextChunk(str):
    """Newly printable text (a plain str) whose first `draft_chars` characters came from the draft's tree."""

    draft_chars: int = 0


class TextStream:
    """Incremental detokenizer: feed token ids, get the newly printable text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0

    def feed(self, tokens: list[int]) -> str:
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more bytes
            return ""
        new, self.printed = text[self.printed :], len(text)
        return new

    def feed_split(self, tokens: list[int], accepted: int) -> TextChunk:
        """feed(tokens) as a TextChunk whose draft_chars covers tokens[:accepted]."""
        head = self.feed(tokens[:accepted]) if accepted else ""
        chunk = TextChunk(head + self.feed(tokens[accepted:]))
        chunk.draft_chars = len(head)
        return chunk
