"""The FastAPI application of `specx serve`: OpenAI routes, health, metrics, the page, errors, auth.

Contract: `create_app(worker, model_name, ...)` returns an ASGI app whose handlers never touch the
model: they validate (models.py), hand a `worker.Job` to the worker and await its reports, so the
event loop stays free while a request generates. Every error, including malformed JSON, wrong
types, unknown routes and internal failures, is answered in OpenAI's shape
`{"error": {message, type, param, code}}` with a 4xx (5xx only for a server-side failure).
Middleware, outermost first: CORS (only with `cors` origins), bearer auth (only with `api_key`;
every route but /health, constant-time compare), a request-body limit (413). Streaming is SSE:
`data: {json}` events (chat: the role first, then content deltas, then the finish_reason chunk,
the usage chunk when asked for) and `data: [DONE]`. A stream's client that goes away cancels its
job, which stops at the next target pass.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specexec_cli import __version__
from specexec_cli.serve import models as shapes
from specexec_cli.serve.models import APIError, ChatRequest, CompletionRequest, error_body
from specexec_cli.serve.worker import Delta, Done, Failed, Job

MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused with 413
POLL_SECONDS = 0.5  # how often a waiting non-streamed request checks that its client is still there


def create_app(worker, model_name: str, *, api_key: str | None = None, cors: list[str] | tuple = (),
               max_body: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="specx", version=__version__, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    page = resources.files("specexec_cli.serve").joinpath("page.html").read_text(encoding="utf-8")
    started = int(time.time())

    @app.get("/health")
    async def health():
        if worker.state == "ready":
            return {"status": "ok"}
        return JSONResponse({"status": worker.state if worker.state == "loading" else "error"}, status_code=503)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(model_name, started)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"model {model_id!r} not found; this server has {model_name!r}", param="model",
                           code="model_not_found")  # fmt: skip
        return model_card(model_name, started)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(worker.metrics.render(worker), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(page)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await answer(worker, Format(True, model_name, body), body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await answer(worker, Format(False, model_name, body), body, request)

    app.add_middleware(BodyLimit, limit=max_body)
    if api_key:
        app.add_middleware(BearerAuth, key=api_key)
    if cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["*"])  # fmt: skip
    return app


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "specx"}


class Format:
    """The response and chunk shapes of one request (chat or completions)."""

    def __init__(self, chat: bool, model: str, req):
        self.chat, self.model = chat, model
        self.rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.usage = bool(req.stream_options and req.stream_options.include_usage)

    def _chunk(self, content, finish=None, specx=None, usage=None, role=False):
        head = (self.rid, self.created, self.model)
        if not self.chat:
            return shapes.completion_chunk(*head, content, finish, specx, usage, self.usage)
        delta = None if content is None else ({"role": "assistant", "content": content} if role else
                                              {"content": content} if content or not finish else {})
        return shapes.chat_chunk(*head, delta, finish, specx, usage, self.usage)

    def opening(self) -> list[dict]:
        return [self._chunk("", role=True)] if self.chat else []

    def delta(self, item: Delta) -> dict:
        return self._chunk(item.text, specx={"spans": item.spans, **item.live})

    def closing(self, item: Done) -> list[dict]:
        finish = "length" if item.finish == "cancelled" else item.finish
        chunks = [self._chunk("", finish, item.specx)]
        if self.usage:
            chunks.append(self._chunk(None, usage=item.usage))
        return chunks

    def body(self, item: Done) -> dict:
        finish = "length" if item.finish == "cancelled" else item.finish
        build = shapes.chat_body if self.chat else shapes.completion_body
        return build(self.rid, self.created, self.model, item.text, finish, item.usage, item.specx)


async def answer(worker, fmt: Format, req, request: Request):
    """Queue the request, then stream its reports (SSE) or wait for the whole answer."""
    shapes.unsupported(req)
    job = Job(shapes.to_work(req), asyncio.get_running_loop(), "chat" if fmt.chat else "completions")
    worker.submit(job)
    first = await next_report(job, request)
    if first is None:
        return Response(status_code=499)  # the client left while queued
    if isinstance(first, Failed):
        raise first.error
    if req.stream:
        return StreamingResponse(sse(job, fmt), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
    while True:
        item = await next_report(job, request)
        if item is None:
            return Response(status_code=499)
        if isinstance(item, Failed):
            raise item.error
        if isinstance(item, Done):
            return JSONResponse(fmt.body(item))


async def next_report(job: Job, request: Request):
    """The job's next report; None (and the job cancelled) once the client has disconnected."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), POLL_SECONDS)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                return None


def event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def sse(job: Job, fmt: Format):
    """The SSE body; leaving it early (a disconnect) cancels the job at its next target pass."""
    try:
        for chunk in fmt.opening():
            yield event(chunk)
        while True:
            item = await job.events.get()
            if isinstance(item, Delta):
                yield event(fmt.delta(item))
            elif isinstance(item, Done):
                for chunk in fmt.closing(item):
                    yield event(chunk)
                break
            elif isinstance(item, Failed):
                yield event(item.error.body())
                break
        yield "data: [DONE]\n\n"
    finally:
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
        return JSONResponse(error_body(message, code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))  # fmt: skip

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {exc.__class__.__name__}", "server_error"), status_code=500)


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


async def send_error(send, status: int, body: dict, headers: dict | None = None) -> None:
    raw = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": raw})


class BearerAuth:
    """401 without `Authorization: Bearer <key>` on every route but /health (constant-time compare)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            ok = hmac.compare_digest(token.strip(), self.key) and scheme.lower() == b"bearer"
            if not ok:
                body = error_body("missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")  # fmt: skip
                return await send_error(send, 401, body, {"WWW-Authenticate": "Bearer"})
        await self.app(scope, receive, send)


class BodyLimit:
    """Read a request body up to `limit` bytes (413 past it), then hand it on."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        try:
            too_big = declared is not None and int(declared) > self.limit
        except ValueError:
            return await send_error(send, 400, error_body("invalid Content-Length header"))
        body = bytearray()
        while not too_big:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            too_big = len(body) > self.limit
            if not msg.get("more_body", False):
                break
        if too_big:
            limit = f"{self.limit >> 20} MiB" if self.limit >= 1 << 20 else f"{self.limit} bytes"
            return await send_error(send, 413, error_body(f"request body is larger than {limit}",
                                                          code="request_too_large"))  # fmt: skip
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)
