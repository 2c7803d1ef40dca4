"""The FastAPI application of `specx serve`: OpenAI routes, health, metrics, the page, errors, auth.

Contract: `create_app(worker, model_name, ...)` returns an ASGI app whose handlers never touch the
model: they validate (models.py), hand a `jobs.Job` to the worker and await its reports. Every error
(malformed JSON, wrong types, unknown routes, internal failures) is answered in OpenAI's shape, a 5xx
only for a server-side failure; the middleware is guards.py's (`add_guards`). Streaming is SSE:
headers within HEADER_GRACE, `data: {json}` chunks (each with the `specx` field), `data: [DONE]`, and
a `: keep-alive` comment every `keepalive` seconds without one. A client that goes away cancels its
job at once. GET /v1/models/{id} takes `aliases`.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specexec_cli import __version__
from specexec_cli.serve import shapes
from specexec_cli.serve.guards import BearerAuth, BodyLimit, HostCheck, Observe, is_loopback_name, log_refusal
from specexec_cli.serve.jobs import Delta, Done, Failed, Job, Started
from specexec_cli.serve.models import APIError, ChatRequest, CompletionRequest, error_body, unsupported
from specexec_cli.serve.structured import to_work
from specexec_cli.session import notices
from specexec_cli.session.tools import renders_tools

MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused with 413
HEADER_GRACE = 0.25  # seconds a stream waits for its first report before it sends its headers
KEEPALIVE_SECONDS = 5.0  # an SSE comment this often while a stream has nothing to send
KEEPALIVE_COMMENT = ": keep-alive\n\n"


def create_app(
    worker,
    model_name: str,
    *,
    api_key: str | None = None,
    cors: list[str] | tuple = (),
    host: str | None = None,
    keepalive: float = KEEPALIVE_SECONDS,
    aliases: set[str] | frozenset = frozenset(),
) -> FastAPI:
    app = FastAPI(title="specx", version=__version__, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    page = resources.files("specexec_cli.serve").joinpath("page.html").read_text(encoding="utf-8")
    started = int(time.time())
    dropped = DroppedTools(worker)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if worker.stopping.is_set():
            return JSONResponse({"status": "stopping"}, status_code=503)
        if worker.state == "ready":
            return {"status": "ok"}
        return JSONResponse({"status": worker.state if worker.state == "loading" else "error"}, status_code=503)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(model_name, started)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != model_name and model_id not in aliases:  # the path, --target as given
            message = f"model {model_id!r} not found; this server has {model_name!r}"
            raise APIError(404, message, param="model", code="model_not_found")
        return model_card(model_name, started)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(worker.metrics.render(worker), media_type="text/plain; version=0.0.4")

    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)
    async def index():
        return HTMLResponse(page)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        fmt = Format(True, model_name, body, request.scope["state"]["request_id"])
        return await answer(worker, fmt, body, request, keepalive, dropped.note)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        fmt = Format(False, model_name, body, request.scope["state"]["request_id"])
        return await answer(worker, fmt, body, request, keepalive)

    add_guards(app, worker, api_key, cors, host)
    return app


def add_guards(app: FastAPI, worker, api_key: str | None, cors, host: str | None) -> None:
    """The middleware of guards.py (module docstring), added innermost first."""
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    if api_key:
        app.add_middleware(BearerAuth, key=api_key)
    elif host is not None and is_loopback_name(host.strip("[]").lower()):  # the --host the socket is bound to
        app.add_middleware(HostCheck, host=host)
    if cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"]
        )
    app.add_middleware(Observe, metrics=worker.metrics)


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "specx"}


class Format:
    """The response and chunk shapes of one request; `request_id` is guards.Observe's (always installed)."""

    def __init__(self, chat: bool, model: str, req, request_id: str):
        self.chat, self.request_id = chat, request_id
        self.head = (("chatcmpl-" if chat else "cmpl-") + request_id, int(time.time()), model)  # id, created, model
        self.usage = bool(req.stream_options and req.stream_options.include_usage)
        self.offset = 0  # completions: characters streamed so far (logprobs' text_offset)
        self.where = "POST /v1/" + ("chat/completions" if chat else "completions")  # the route, for log lines

    def _chunk(self, content, finish=None, specx=None, usage=None, logprobs=None, delta=None):
        """A streamed chunk; content (chat: and delta) None = the usage chunk."""
        if not self.chat:
            lp = shapes.completion_logprobs(logprobs, self.offset)
            self.offset += len(content or "")
            choice = None if content is None else shapes.completion_choice(content, finish, lp)
            return shapes.envelope("text_completion", self.head, choice, specx, usage, self.usage)
        if delta is None and content is not None:
            delta = {"content": content} if content or not finish else {}
        choice = None if delta is None else shapes.chat_choice("delta", delta, finish, logprobs)
        return shapes.envelope("chat.completion.chunk", self.head, choice, specx, usage, self.usage)

    def opening(self) -> list[dict]:
        idle = dict(spans=[], tokens_per_pass=0.0, target_passes=0, tokens_per_second=0.0, completion_tokens=0)
        return [self._chunk(None, specx=idle, delta={"role": "assistant", "content": ""})] if self.chat else []

    def delta(self, item: Delta) -> dict:
        specx = {"spans": item.spans, **item.live}
        if item.tool_calls:  # a call's id and name, or a piece of its arguments
            return self._chunk(None, specx=specx, delta={"tool_calls": item.tool_calls})
        return self._chunk(item.text, specx=specx, logprobs=item.logprobs)

    def closing(self, item: Done) -> list[dict]:
        """The finish_reason chunk and the usage chunk when asked for, both with the reply's `specx`
        (the tool calls went out as deltas while they were written)."""
        finish = "length" if item.finish == "cancelled" else item.finish
        chunks = [self._chunk("", finish, item.specx)]
        if self.usage:
            chunks.append(self._chunk(None, specx=item.specx, usage=item.usage))
        return chunks

    def body(self, item: Done) -> dict:
        finish = "length" if item.finish == "cancelled" else item.finish
        if self.chat:
            message = shapes.chat_message(item.text, item.tool_calls)
            choice = shapes.chat_choice("message", message, finish, item.logprobs)
            return shapes.envelope("chat.completion", self.head, choice, item.specx, item.usage)
        choice = shapes.completion_choice(item.text, finish, shapes.completion_logprobs(item.logprobs, 0))
        return shapes.envelope("text_completion", self.head, choice, item.specx, item.usage)


async def answer(worker, fmt: Format, req, request: Request, keepalive: float, on_done=lambda req, rid: None):
    """Queue the request, then stream its reports (SSE) or wait for the whole answer. A stream waits
    at most HEADER_GRACE for its first report, so an idle server still answers a bad prompt with a 4xx.
    `on_done(req, request_id)` runs once the request is answered (DroppedTools.note)."""
    unsupported(req)
    job = Job(to_work(req), asyncio.get_running_loop(), "chat" if fmt.chat else "completions")
    job.request_id = fmt.request_id
    job.interactive = bool(req.stream)  # a person watching the stream: served before background requests
    clock = Clock(worker.metrics, request.scope.get("state", {}).setdefault("access", {}))
    worker.submit(job)
    gone = asyncio.create_task(watch_disconnect(job, request))
    try:
        item = await next_report(job, gone, HEADER_GRACE if req.stream else None)
        if gone.done():
            return Response(status_code=499)  # the client left while queued
        if req.stream:  # from here starlette's StreamingResponse watches the client (sse cancels the job)
            if isinstance(item, Failed):
                raise item.error
            body = sse(job, fmt, item, clock, keepalive, lambda: on_done(req, fmt.request_id))
            return StreamingResponse(
                body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
        while item is not None:  # None: the client left
            clock.saw(item)
            if isinstance(item, Failed):
                raise item.error
            if isinstance(item, Done):
                on_done(req, fmt.request_id)
                return JSONResponse(fmt.body(item))
            item = await next_report(job, gone)
        return Response(status_code=499)
    finally:
        gone.cancel()


async def watch_disconnect(job: Job, request: Request) -> None:
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a receive channel that fails is a client that is gone
        pass
    job.cancel()


async def next_report(job: Job, gone: asyncio.Task, timeout: float | None = None):
    """The job's next report; None once the client has disconnected (`gone` done; the job is
    cancelled) or after `timeout` seconds without one."""
    report = asyncio.ensure_future(job.events.get())
    await asyncio.wait({report, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if report.done():
        return report.result()
    report.cancel()
    return None


class Clock:
    """The latency histograms of one request (time to its first token, and to its end) and the
    figures of its access-log line (`access`, which guards.Observe prints once the request ends)."""

    def __init__(self, metrics, access: dict):
        self.metrics, self.t0, self.first, self.access = metrics, time.perf_counter(), False, access

    def saw(self, item) -> None:
        if isinstance(item, (Delta, Done)) and not self.first:  # an empty reply: its first token was EOS
            self.first = True
            self.metrics.observe("specx_time_to_first_token_seconds", time.perf_counter() - self.t0)
        if isinstance(item, Started):
            self.access.update(prompt=item.prompt_tokens, cached=item.cached_tokens, completion=0, task=item.task)
        elif isinstance(item, Delta):  # a client that leaves mid-reply: the tokens it was sent
            self.access["completion"] = item.live.get("completion_tokens", 0)
        elif isinstance(item, Done):
            self.metrics.observe("specx_request_seconds", time.perf_counter() - self.t0)
            usage = item.usage
            why = item.specx.get("stopped_by")
            self.access.update(
                prompt=usage["prompt_tokens"],
                completion=usage["completion_tokens"],
                cached=usage["prompt_tokens_details"]["cached_tokens"],
                finish=f"{item.finish}:{why}" if why else item.finish,
            )


class DroppedTools:
    """One log line per server start (not per request: Open WebUI sends its tools with every message)
    for the first answered chat request whose tools (tool_choice auto) the chat template cannot render."""

    def __init__(self, worker):
        self.worker, self.logged = worker, False

    def note(self, req, rid: str) -> None:
        tools = getattr(req, "tools", None)
        session = getattr(self.worker, "session", None)
        if self.logged or not tools or req.tool_choice == "none" or session is None:
            return
        if session.templated and renders_tools(session.models.tokenizer):
            return
        self.logged = True
        why = "does not render tools" if session.templated else "is not used (none, or --no-chat-template)"
        notices.notice(
            f"specx serve: request {rid} sent {len(tools)} tools, dropped: this model's chat template "
            f'{why}, so the model never sees them and replies with text (tool_choice "required" or a '
            "named function is a 400); logged once, for the first such request"
        )


def event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def sse(job: Job, fmt: Format, first, clock: Clock, keepalive: float, on_done=lambda: None):
    """The SSE body from `first`, the report already taken (None: none yet); leaving it early (a
    disconnect) cancels the job. A keep-alive comment every `keepalive` seconds keeps proxies open."""
    ended = False
    try:
        for chunk in fmt.opening():
            yield event(chunk)
        item = first
        while True:
            if item is None:
                try:
                    item = await asyncio.wait_for(job.events.get(), keepalive)
                except asyncio.TimeoutError:
                    yield KEEPALIVE_COMMENT
                    continue
            clock.saw(item)
            if isinstance(item, Delta):
                yield event(fmt.delta(item))
            elif isinstance(item, Done):
                on_done()
                for chunk in fmt.closing(item):
                    yield event(chunk)
                break
            elif isinstance(item, Failed):  # after the 200 headers: counted and logged here, not by guards.Observe
                clock.metrics.refused(item.error.status, item.error.type)
                if item.error.status < 500:  # a 500 was logged by its error id
                    log_refusal(item.error.status, item.error.body()["error"], fmt.request_id, fmt.where)
                yield event(item.error.body())
                break
            item = None
        yield "data: [DONE]\n\n"
        ended = True
    finally:
        if not ended:  # the client left mid-stream: the job stops at its next target pass
            log_refusal(
                499, {"type": "cancelled", "message": "the client disconnected mid-stream"}, fmt.request_id, fmt.where
            )
        job.cancel()


# -- errors -----------------------------------------------------------------------------------------
def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        return JSONResponse(validation_body(exc.errors()), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            error_body(message, code=code), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )


def validation_body(errors) -> dict:
    """The first validation error as an OpenAI error (param = the field's dotted path)."""
    err = errors[0] if errors else {"msg": "invalid request", "loc": (), "type": None}
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", err.get("msg"))
        return error_body(f"malformed JSON body: {detail}", code="invalid_json")
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {err.get('msg')}" if param else f"request body: {err.get('msg')}"
    return error_body(message, param=param, code=err.get("type"))
