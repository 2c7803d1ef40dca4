"""The OpenAI response shapes of `specx serve`: bodies, streamed chunks, usage, logprobs.

Contract: pure functions from a reply's parts to the exact dicts OpenAI's API returns. `envelope`
wraps one choice (`chat_choice`, `completion_choice`) into a body or chunk of either endpoint; a
chunk without a choice is the `stream_options.include_usage` chunk. A reply's logprobs travel as
chat-style entries (`token_entry`); `completion_logprobs` converts a run of them.
"""

from __future__ import annotations

from itertools import accumulate


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def token_entry(text: str, logprob: float, top: list[tuple[str, float]]) -> dict:
    """One token of chat's `logprobs.content`: its text, natural-log probability, UTF-8 bytes, and
    the top alternatives (each the same without its own alternatives)."""
    return {
        "token": text,
        "logprob": logprob,
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in top],
    }


def completion_logprobs(entries: list[dict] | None, offset: int) -> dict | None:
    """Completions' logprobs of `entries`, the first token starting `offset` characters into the text."""
    if entries is None:
        return None
    starts = list(accumulate((len(e["token"]) for e in entries), initial=offset))  # one more: the end
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": starts[:-1],
    }


def envelope(obj: str, head: tuple, choice: dict | None, specx: dict | None, usage, with_usage: bool = True) -> dict:
    """A body or chunk (`obj`: its OpenAI object name; `head`: its id, created, model); choice None:
    the usage chunk (no choices)."""
    rid, created, model = head
    out = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [] if choice is None else [choice],
    }
    if with_usage:
        out["usage"] = usage
    if specx is not None:
        out["specx"] = specx
    return out


def chat_message(text: str, tool_calls: list[dict] | None) -> dict:
    """The assistant message of a chat body (content None when the reply is only tool calls)."""
    message = {"role": "assistant", "content": text if text or not tool_calls else None, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_choice(key: str, value: dict, finish: str | None, logprobs: list[dict] | None) -> dict:
    """A chat choice: `key` "message" (a body) or "delta" (a streamed chunk)."""
    lp = None if logprobs is None else {"content": logprobs, "refusal": None}
    return {"index": 0, key: value, "logprobs": lp, "finish_reason": finish}


def completion_choice(text: str, finish: str | None, logprobs: dict | None) -> dict:
    """A text_completion choice; `logprobs` in completions' shape (completion_logprobs)."""
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
