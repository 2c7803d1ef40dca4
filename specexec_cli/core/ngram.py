"""Prompt lookup: continuations of the current suffix found earlier in the prompt and generated text.

Contract: `NgramIndex(ids)` indexes the latest `INDEX_WINDOW` committed tokens; `propose(tail, length)`
returns up to `length` tokens that followed the latest earlier occurrence of the longest suffix of
`tail` (at most `n` tokens) in the index, and `match` also its length (calibration scores by it).
"""

from __future__ import annotations

NGRAM = 3  # longest suffix matched (falls back to shorter ones)
INDEX_WINDOW = 4096  # most recent committed tokens indexed


class NgramIndex:
    """Suffix n-gram → where it last occurred, for n = 1..`n`."""

    def __init__(self, ids: list[int], n: int = NGRAM):
        self.ids = list(ids[-INDEX_WINDOW:])
        self.n = n
        self.last: dict[tuple[int, ...], int] = {}  # n-gram → end index of its latest occurrence
        for k in range(1, n + 1):
            for end in range(k, len(self.ids)):  # end < len: a continuation token exists
                self.last[tuple(self.ids[end - k : end])] = end

    def match(self, tail: list[int], length: int) -> tuple[list[int], int]:
        """(continuation of up to `length` tokens, matched suffix length); ([], 0) when none."""
        for k in range(min(self.n, len(tail)), 0, -1):
            end = self.last.get(tuple(tail[-k:]))
            if end is not None:
                return self.ids[end : end + length], k
        return [], 0

    def propose(self, tail: list[int], length: int) -> list[int]:
        """Up to `length` tokens continuing `tail` (longest matching suffix wins); [] if none."""
        return self.match(tail, length)[0]
