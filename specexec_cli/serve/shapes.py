"""The OpenAI response shapes of `specx serve`: bodies, streamed chunks, usage, logprobs.

Contract: pure functions from a reply's parts to the exact dicts OpenAI's API returns, each with
the `specx` extension field when given: `chat_body`/`chat_chunk` (`chat.completion[.chunk]`, with
`message.tool_calls` / `delta.tool_calls` and `logprobs.content`), `completion_body`/
`completion_chunk` (`text_completion`, logprobs as tokens, token_logprobs, top_logprobs,
text_offset). A reply's logprobs travel as chat-style entries (`token_entry`); `completion_logprobs`
converts a run of them. A chunk without a choice is the `stream_options.include_usage` chunk.
"""

from __future__ import annotations


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


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    return None if entries is None else {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict] | None, offset: int) -> dict | None:
    """Completions' logprobs of `entries`, the first token starting `offset` characters into the text."""
    if entries is None:
        return None
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def chat_body(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str,
    usage: dict,
    specx: dict,
    tool_calls: list[dict] | None = None,
    logprobs: list[dict] | None = None,
) -> dict:
    message = {"role": "assistant", "content": text if text or not tool_calls else None, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {"index": 0, "message": message, "logprobs": chat_logprobs(logprobs), "finish_reason": finish}
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [choice],
        "usage": usage,
        "specx": specx,
    }


def _chunk(
    obj: str,
    rid: str,
    created: int,
    model: str,
    choice: dict | None,
    specx: dict | None,
    usage: dict | None,
    with_usage: bool,
) -> dict:
    """One streamed chunk of either endpoint; choice None = the usage chunk (no choices)."""
    chunk = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [] if choice is None else [choice],
    }
    if with_usage:
        chunk["usage"] = usage
    if specx is not None:
        chunk["specx"] = specx
    return chunk


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict | None,
    finish: str | None = None,
    specx: dict | None = None,
    usage: dict | None = None,
    with_usage: bool = False,
    logprobs: list[dict] | None = None,
) -> dict:
    """A chat.completion.chunk; delta None = the usage chunk (no choices)."""
    choice = (
        None
        if delta is None
        else {"index": 0, "delta": delta, "logprobs": chat_logprobs(logprobs), "finish_reason": finish}
    )
    return _chunk("chat.completion.chunk", rid, created, model, choice, specx, usage, with_usage)


def completion_body(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str,
    usage: dict,
    specx: dict,
    logprobs: list[dict] | None = None,
) -> dict:
    choice = {"index": 0, "text": text, "logprobs": completion_logprobs(logprobs, 0), "finish_reason": finish}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [choice],
        "usage": usage,
        "specx": specx,
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    text: str | None,
    finish: str | None = None,
    specx: dict | None = None,
    usage: dict | None = None,
    with_usage: bool = False,
    logprobs: dict | None = None,
) -> dict:
    """A streamed text_completion; text None = the usage chunk (no choices). `logprobs` is already
    in completions' shape (the offsets run over the whole stream)."""
    choice = None if text is None else {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return _chunk("text_completion", rid, created, model, choice, specx, usage, with_usage)
