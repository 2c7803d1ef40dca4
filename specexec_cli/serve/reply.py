"""One reply's text on its way to the client: stop strings, then tool calls, with the origin of
every character and the logprobs of every token riding along.

Contract: `Reply(tokenizer, stops, names, forced, logprobs, limit)` is fed the engine's `StepEvent`s
in order; `feed(ev)` returns what is safe to send now (a `Piece`) or None. Text passes
`chat.StopScanner` (`used`: the tokens through the stop string), then, with tools,
`tools.ToolScanner` (`limit` caps the calls). `finish()` returns the last piece and the reply's tool
calls (OpenAI dicts; [] for text). `parts` is the content of a response not streamed: the text sent,
plus calls that never closed (a reply cut by max_tokens). Logprob entries ride on the next piece
sent, none past a stop string; `entries` keeps them all.
"""

from __future__ import annotations

from dataclasses import dataclass

from specexec_cli.serve.shapes import token_entry
from specexec_cli.session.chat import StopScanner
from specexec_cli.session.tools import ToolScanner


def stop_end(stops: list[str], buf: str, cut: int) -> int:
    """Where in `buf` the stop string that StopScanner found at `cut` ends (the shortest one there)."""
    return cut + min((len(s) for s in stops if buf.startswith(s, cut)), default=0)


def tokens_through(tokenizer, before: list[int], new: list[int], chars: int) -> int:
    """How many of `new` (generated right after `before`) it takes to decode `chars` more characters."""
    base = len(tokenizer.decode(before))
    for k in range(1, len(new) + 1):
        if len(tokenizer.decode(before + new[:k])) - base >= chars:
            return k
    return len(new)


def merge_deltas(entries: list[dict]) -> list[dict]:
    """Tool-call delta entries with each run of argument pieces of one call joined into one."""
    out: list[dict] = []
    for e in entries:
        if out and "id" not in e and "id" not in out[-1] and out[-1]["index"] == e["index"]:
            joined = out[-1]["function"]["arguments"] + e["function"]["arguments"]
            out[-1] = {"index": e["index"], "function": {"arguments": joined}}
        else:
            out.append(e)
    return out


@dataclass
class Piece:
    text: str  # what the client may see now
    mask: list  # per character: True = a draft-accepted token's text
    logprobs: list | None  # logprob entries not sent before (None: logprobs off)
    tool_calls: list | None = None  # OpenAI delta.tool_calls entries, in order (None: none now)


class Reply:
    def __init__(
        self,
        tokenizer,
        stops: list[str],
        names: list[str],
        forced: bool,
        logprobs: int | None,
        limit: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.stop = StopScanner(stops)
        self.tools = ToolScanner(names, forced, limit) if names else None
        self.unsent: list[bool] = []  # the origin mask of the text fed and not sent yet
        self.generated: list[int] = []  # token ids so far
        self.used: int | None = None  # tokens through the stop string, once one is found
        self.entries: list | None = [] if logprobs is not None else None
        self.sent_entries = 0  # entries already attached to a piece
        self.parts: list[str] = []  # the content of a response not streamed (module docstring)

    def feed(self, ev) -> Piece | None:
        text = str(ev.text)
        draft = getattr(ev.text, "draft_chars", 0)
        self.unsent += [True] * draft + [False] * (len(text) - draft)
        held = self.stop.pending
        out = self.stop.feed(text)
        if self.stop.stopped and self.used is None:  # completion_tokens counts none past the stop string
            chars = stop_end(self.stop.stops, held + text, len(out)) - len(held)
            self.used = len(self.generated) + tokens_through(self.tokenizer, self.generated, ev.tokens, chars)
        self.generated += ev.tokens
        self._logprobs(getattr(ev, "logprobs", None))
        if self.tools is not None:
            out = self.tools.feed(out)
            return self._piece(out, calls=self.tools.take())
        return self._piece(out)

    def finish(self) -> tuple[Piece | None, list[dict]]:
        out = self.stop.flush()
        if self.tools is not None:
            out = self.tools.feed(out)
            content, calls, unsent = self.tools.finish()
            piece = self._piece(out + content, last=True, calls=self.tools.take())
            if unsent:
                self.parts.append(unsent)
            return piece, [c.body() for c in calls]
        return self._piece(out, last=True), []

    def _logprobs(self, items) -> None:
        if self.entries is None or not items:
            return
        for item in items:
            top = [(self.tokenizer.decode([tid]), float(lp)) for tid, lp in item.top]
            self.entries.append(token_entry(self.tokenizer.decode([item.token]), float(item.logprob), top))
        if self.used is not None:
            del self.entries[self.used :]

    def _piece(self, text: str, last: bool = False, calls: list | None = None) -> Piece | None:
        fresh = None
        if self.entries is not None and (text or last or calls):
            fresh, self.sent_entries = self.entries[self.sent_entries :], len(self.entries)
        if not text and not fresh and not calls:
            return None
        mask, self.unsent = self.unsent[: len(text)], self.unsent[len(text) :]
        self.parts.append(text)
        return Piece(text, mask, fresh, merge_deltas(calls) if calls else None)
