"""Request models of `specx serve` (pydantic, strict): a request body checked, or refused with a 400.

Contract: `ChatRequest` and `CompletionRequest` validate a body (app.py answers a failure as a 400).
Parameters that would change the output but are not supported (penalties, logit_bias, the legacy
`functions`, ...) are accepted, then refused by name by `unsupported()`, as are a message without
content (but an assistant's) and non-text parts. Other servers' values mean what they mean there:
`max_tokens` -1 = no limit, `top_k` -1 = off, `stream` null = false; fields with no effect on the
text are ignored. `Work` is what the worker takes (structured.to_work); `APIError` is every error
the server answers, `error_body()` its JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOPS = 16
MAX_LOGPROBS = 20  # top_logprobs (chat) and logprobs (completions) at most, as OpenAI
# Parameters accepted only to be refused by name (unsupported()) when given with an effect, in this order:
# a value in NO_EFFECT, else null/false/0/empty, has none.
UNSUPPORTED = "presence_penalty frequency_penalty repetition_penalty logit_bias min_p best_of functions echo suffix"
NO_EFFECT = {"repetition_penalty": (None, 1, 1.0), "best_of": (None, 1)}


class APIError(Exception):
    """An error answered as {"error": {message, type, param, code}} with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(Strict):
    """One part of a content array; only "text" parts are taken (check_messages refuses the rest)."""

    type: str
    text: str | None = None


class FunctionCall(Strict):
    name: str
    arguments: str | dict  # OpenAI: a JSON object as a string (an object is taken too)


class ToolCallIn(Strict):
    """A call in an earlier assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(Strict):
    name: str = Field(min_length=1, max_length=256)  # any name a template can render (MCP tools use ":" and ".")
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema of the arguments object; None: no arguments
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # "schema" would shadow BaseModel.schema
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None  # needed with type json_schema


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # None: only an assistant may omit it
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as OpenAI's and vLLM's servers do)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


class StreamOptions(Strict):
    include_usage: bool = False


class SpecxFields(Strict):
    """The request's `specx` extension object (unknown keys in it are ignored, as elsewhere)."""

    repetition_guard: bool | None = None  # None: the server's switch (off for a greedy request); limits.py


class Sampling(Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=-1, le=2**31)  # -1: no limit; None: the default cap; 0 is refused
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=2**31)  # -1 or 0: off
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = Field(default=None)
    stream: bool | None = False  # null = false
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    user: str | None = None
    # Accepted so that unsupported values are refused by name (see unsupported()), never ignored.
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    min_p: Any = None
    best_of: Any = None
    functions: Any = None
    response_format: ResponseFormat | None = None
    specx: SpecxFields | None = None  # specx's own extension fields


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=-1, le=2**31)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto
    parallel_tool_calls: bool | None = None  # None: true
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(Sampling):
    prompt: str | list[str | int | list[int]]  # token ids are refused by name (structured.to_work)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # top alternatives per token
    echo: Any = None
    suffix: Any = None


def unsupported(req: Sampling) -> None:
    """Raise a 400 for a parameter that would change the output and that specx does not implement."""
    for name in ("max_tokens", "max_completion_tokens"):
        if getattr(req, name, None) == 0:
            raise APIError(400, f"{name} must be at least 1 (or -1: to EOS or the context end)", param=name)
    if isinstance(req, ChatRequest):
        check_messages(req.messages)
    if req.n not in (None, 1):
        raise APIError(400, f"n must be 1 (got {req.n}): one completion per request", param="n")
    for name in UNSUPPORTED.split():  # echo and suffix: completions only (None on a chat request)
        if getattr(req, name, None) not in NO_EFFECT.get(name, (None, False, 0, 0.0, "", [], {})):
            message = f"{name} is not supported by specx; remove it from the request"
            raise APIError(400, message, param=name, code="unsupported_parameter")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"stop takes at most {MAX_STOPS} strings (got {len(stops)})", param="stop")


TEXT_ONLY = {
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "input_audio": "audio",
    "audio": "audio",
    "file": "file",
    "input_file": "file",
    "video_url": "video",
}


def check_messages(messages: list[Message]) -> None:
    """400 for a message without content (OpenAI requires it of every role but assistant) and for
    content parts other than text, each with the param that names it (tool calls: structured.py)."""
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            message = f"messages.{i}.content is missing: a {m.role} message needs content (a string or text parts)"
            raise APIError(400, message, param=f"messages.{i}.content", code="missing_required_parameter")
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            param = f"messages.{i}.content.{j}"
            if part.type == "text" and part.text is None:
                raise APIError(400, f'{param}: a text part needs a "text" string', param=param)
            if part.type != "text":
                kind = TEXT_ONLY.get(part.type, f"{part.type!r}")
                message = (
                    f"{param}: this model takes text only; {kind} parts are not supported (send text parts or a string)"
                )
                raise APIError(400, message, param=param, code="unsupported_content")


@dataclass
class Work:
    """What the worker needs from a request: the prompt (messages or text) and the settings."""

    messages: list[dict] | None = None  # chat: [{role, content, ...}] as templates take them (structured.py)
    prompt: str | None = None  # completions: plain text, no template
    max_tokens: int | None = None  # None: the server's default (limits.reply_limit); -1: to EOS or the context end
    temperature: float | None = None  # None: the checkpoint's generation_config.json
    top_k: int | None = None  # 0: off (the request's -1 too)
    top_p: float | None = None
    seed: int | None = None  # None: fresh randomness
    stops: list[str] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)  # the request's tools (OpenAI function dicts)
    tool_choice: str = "auto"  # "auto" | "none" | "required" | "function" (a named one: `tool_name`)
    tool_name: str | None = None  # tool_choice "function": the function the reply must call
    parallel_tool_calls: bool = True  # False: at most one call is returned
    response_format: dict | None = None  # {"type": "json_object"} or {"type": "json_schema", "schema": {...}}
    logprobs: int | None = None  # None: off; k: each token's logprob and its k top alternatives
    repetition_guard: bool | None = None  # the request's specx.repetition_guard (None: the server decides)
