"""Request models (pydantic, strict) and the OpenAI response shapes of `specx serve`.

Contract: `ChatRequest` and `CompletionRequest` validate a request body: wrong types, out-of-range
values and unknown roles fail validation (app.py turns that into a 400 in OpenAI's error shape).
Parameters that would change the output but are not supported (logprobs, penalties, logit_bias,
tools, ...) are accepted by the model and refused by `unsupported()` with a 400 that names them,
as are a message without content (but an assistant's), image/audio/file parts and token-id
prompts. The values other servers accept mean what they mean there: `max_tokens` -1 or null = no
limit (llama-server, ollama), `top_k` -1 = off (vLLM), `stream` null = false;
parameters with no effect on the text (user, metadata, ...) are ignored. `to_work()` turns a
request into the worker's `Work`. The `*_body`/`*_chunk` functions build the exact OpenAI shapes
(dicts), each with the `specx` extension field when given. `APIError` is every error the server
answers, with `error_body()` its JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_STOPS = 16


class APIError(Exception):
    """An error answered as {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(Strict):
    """One part of a content array; only "text" parts are taken (check_messages refuses the rest)."""

    type: str
    text: Optional[str] = None


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = None  # None: only an assistant may omit it
    name: Optional[str] = None

    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as OpenAI's and vLLM's servers do)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


class StreamOptions(Strict):
    include_usage: bool = False



class Sampling(Strict):
    """Fields both endpoints share."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=-1, le=2**31)  # -1 or None: no limit; 0 is refused
    temperature: Optional[float] = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = Field(default=None, ge=-1, le=2**31)  # -1 or 0: off
    seed: Optional[int] = Field(default=None, ge=-(2**63), lt=2**64)
    stop: Union[str, list[str], None] = Field(default=None)
    stream: Optional[bool] = False  # null = false
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(default=None, ge=1, le=128)
    user: Optional[str] = None
    # Accepted so that unsupported values are refused by name (see unsupported()), never ignored.
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    min_p: Any = None
    best_of: Any = None
    tools: Any = None
    functions: Any = None
    response_format: Any = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=-1, le=2**31)


class CompletionRequest(Sampling):
    prompt: Union[str, list[Union[str, int, list[int]]]]  # token ids are refused by name (to_work)
    echo: Any = None
    suffix: Any = None


def _set(value) -> bool:
    """True when an optional parameter is given with an effect (not null/false/0/empty)."""
    return value not in (None, False, 0, 0.0, "", [], {})


def unsupported(req: Sampling) -> None:
    """Raise a 400 for a parameter that would change the output and that specx does not implement."""
    for name in ("max_tokens", "max_completion_tokens"):
        if getattr(req, name, None) == 0:
            raise APIError(400, f"{name} must be at least 1 (or -1/null: to EOS or the context end)", param=name)
    if isinstance(req, ChatRequest):
        check_messages(req.messages)
    if req.n not in (None, 1):
        raise APIError(400, f"n must be 1 (got {req.n}): one completion per request", param="n")
    checks = [
        ("logprobs", _set(req.logprobs)), ("top_logprobs", _set(req.top_logprobs)),
        ("presence_penalty", _set(req.presence_penalty)), ("frequency_penalty", _set(req.frequency_penalty)),
        ("repetition_penalty", req.repetition_penalty not in (None, 1, 1.0)), ("logit_bias", _set(req.logit_bias)),
        ("min_p", _set(req.min_p)), ("best_of", req.best_of not in (None, 1)), ("tools", _set(req.tools)),
        ("functions", _set(req.functions)),
        ("response_format", _set(req.response_format) and req.response_format != {"type": "text"}),
    ]  # fmt: skip
    if isinstance(req, CompletionRequest):
        checks += [("echo", _set(req.echo)), ("suffix", _set(req.suffix))]
    for name, given in checks:
        if given:
            raise APIError(400, f"{name} is not supported by specx; remove it from the request", param=name,
                           code="unsupported_parameter")  # fmt: skip
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"stop takes at most {MAX_STOPS} strings (got {len(stops)})", param="stop")


TEXT_ONLY = {"image_url": "image", "input_image": "image", "image": "image", "input_audio": "audio",
             "audio": "audio", "file": "file", "input_file": "file", "video_url": "video"}


def check_messages(messages: list[Message]) -> None:
    """400 for a message without content (OpenAI requires it of every role but assistant) and for
    content parts other than text, each with the param that names it."""
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            raise APIError(400, f"messages.{i}.content is missing: a {m.role} message needs content (a string "
                           "or text parts)", param=f"messages.{i}.content", code="missing_required_parameter")
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            param = f"messages.{i}.content.{j}"
            if part.type == "text" and part.text is None:
                raise APIError(400, f"{param}: a text part needs a \"text\" string", param=param)
            if part.type != "text":
                kind = TEXT_ONLY.get(part.type, f"{part.type!r}")
                raise APIError(400, f"{param}: this model takes text only; {kind} parts are not supported (send "
                               "text parts or a string)", param=param, code="unsupported_content")  # fmt: skip


@dataclass
class Work:
    """What the worker needs from a request: the prompt (messages or text) and the settings."""

    messages: list[dict] | None = None  # chat: [{role, content}], roles system/user/assistant
    prompt: str | None = None  # completions: plain text, no template
    max_tokens: int | None = None  # None: the server's --max-new-tokens, else to EOS or the context end
    temperature: float | None = None  # None: the checkpoint's generation_config.json
    top_k: int | None = None  # 0: off (the request's -1 too)
    top_p: float | None = None
    seed: int | None = None  # None: fresh randomness
    stops: list[str] = field(default_factory=list)


def to_work(req: Sampling) -> Work:
    """The request's `Work` (call `unsupported(req)` first)."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    top_k = 0 if req.top_k == -1 else req.top_k
    work = Work(temperature=req.temperature, top_k=top_k, top_p=req.top_p, seed=req.seed, stops=stops)
    if isinstance(req, ChatRequest):
        work.messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                         for m in req.messages]  # fmt: skip
        work.max_tokens = limit(req.max_completion_tokens) or limit(req.max_tokens)
    else:
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if any(not isinstance(p, str) for p in prompts):
            raise APIError(400, "prompt: token-id prompts are not supported; send the prompt as a string",
                           param="prompt", code="unsupported_content")  # fmt: skip
        if len(prompts) != 1:
            raise APIError(400, f"prompt must be one string (got a list of {len(prompts)}): one completion "
                           "per request", param="prompt")  # fmt: skip
        work.prompt, work.max_tokens = prompts[0], limit(req.max_tokens)
    return work


def limit(max_tokens: int | None) -> int | None:
    """A request's max_tokens as the worker's: -1 (llama-server's and ollama's "no limit") is None."""
    return None if max_tokens == -1 else max_tokens


# -- response shapes ----------------------------------------------------------------------------
def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip


def chat_body(rid: str, created: int, model: str, text: str, finish: str, usage: dict, specx: dict) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
              "logprobs": None, "finish_reason": finish}  # fmt: skip
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": None, "choices": [choice], "usage": usage, "specx": specx}  # fmt: skip


def _chunk(obj: str, rid: str, created: int, model: str, choice: dict | None, specx: dict | None,
           usage: dict | None, with_usage: bool) -> dict:
    """One streamed chunk of either endpoint; choice None = the usage chunk (no choices)."""
    chunk = {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
             "choices": [] if choice is None else [choice]}  # fmt: skip
    if with_usage:
        chunk["usage"] = usage
    if specx is not None:
        chunk["specx"] = specx
    return chunk


def chat_chunk(rid: str, created: int, model: str, delta: dict | None, finish: str | None = None,
               specx: dict | None = None, usage: dict | None = None, with_usage: bool = False) -> dict:
    """A chat.completion.chunk; delta None = the usage chunk (no choices)."""
    choice = None if delta is None else {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return _chunk("chat.completion.chunk", rid, created, model, choice, specx, usage, with_usage)


def completion_body(rid: str, created: int, model: str, text: str, finish: str, usage: dict, specx: dict) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None, "choices": [choice], "usage": usage, "specx": specx}  # fmt: skip


def completion_chunk(rid: str, created: int, model: str, text: str | None, finish: str | None = None,
                     specx: dict | None = None, usage: dict | None = None, with_usage: bool = False) -> dict:
    """A streamed text_completion; text None = the usage chunk (no choices)."""
    choice = None if text is None else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return _chunk("text_completion", rid, created, model, choice, specx, usage, with_usage)
