"""The ASGI middleware of `specx serve`, and how a failure inside the server is logged.

Contract: each class wraps an ASGI app and answers its refusal itself in OpenAI's error shape:
`HostCheck` (403 for a Host that names neither loopback nor the bound --host: DNS-rebinding
protection), `BearerAuth` (401 without the key, but on OPEN_ROUTES), `BodyLimit` (413), and
`Observe`, the outermost: a request id (`x-request-id`), error responses counted by status and
type, one stderr line per refused or cancelled request (`log_refusal`), one access-log line per
request but QUIET_ROUTES' (`log_access`, with what app.Clock left in `scope["state"]["access"]`), and
an unhandled exception answered as a 500 carrying only an error id. `log_failure(exc, rid)` logs that
id and the exception in one line (the traceback with SPECX_DEBUG=1): the client never sees the
exception's text. `server_error(exc)` is the APIError of a failed generation (OOM: a 400).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import sys
import time
import traceback
import uuid

from specexec_cli.serve.models import APIError, error_body
from specexec_cli.session import notices


def log_failure(exc: BaseException, rid: str | None = None) -> str:
    """Log `exc` in one stderr line under a new error id, naming the request `rid` when known."""
    eid = uuid.uuid4().hex[:12]
    first = (str(exc).splitlines() or [""])[0]
    request = f" (request {rid})" if rid else ""
    notices.notice(f"specx serve: error {eid}{request}: {exc.__class__.__name__}: {first}")
    if os.environ.get("SPECX_DEBUG") == "1":
        traceback.print_exception(exc, file=sys.stderr)
    return eid


def log_refusal(status: int, error: dict, rid: str, where: str) -> None:
    """One stderr line for a request answered `status` (4xx; 499: the client left) with `error`."""
    kind = "/".join(str(part) for part in (error.get("type"), error.get("code")) if part)
    message = " ".join(str(error.get("message") or "").split())
    message = message if len(message) <= LOG_MESSAGE_CHARS else message[: LOG_MESSAGE_CHARS - 3] + "..."
    notices.notice(f"specx serve: {status} {kind} {where} request {rid}: {message}")


def log_access(status: int, where: str, rid: str, seconds: float, facts: dict) -> None:
    """The access-log line of a finished request (a generation's: with its tokens, finish and task)."""
    fields = [f"{k}={facts[k]}" for k in ("prompt", "cached", "completion") if facts.get(k) is not None]
    fields.append(f"seconds={seconds:.2f}")
    finish = facts.get("finish") or ("cancelled" if status == 499 and "prompt" in facts else None)
    fields += [f"finish={finish}"] if finish else []
    fields += [f"task={facts['task']}"] if facts.get("task") else []
    notices.notice(f"specx serve: {status} {where} request {rid}: {' '.join(fields)}")


def server_error(exc: BaseException, rid: str | None = None) -> APIError:
    """What a request whose generation raised `exc` is answered: device OOM is a 400 (SDKs do not
    retry it) that says what to lower; anything else a 500 that carries only the logged error id."""
    from specexec_cli.errors import is_oom

    if is_oom(exc):
        notices.notice(f"specx serve: out of device memory during a request ({exc.__class__.__name__})")
        return APIError(
            400,
            "out of device memory for this request: lower max_tokens or send a shorter prompt; "
            "or restart the server with a smaller --budget or --ctx",
            code="device_out_of_memory",
        )
    return internal_error(log_failure(exc, rid))


def internal_error(eid: str) -> APIError:
    message = f"internal server error (error id {eid}); the server's log has the details"
    return APIError(500, message, type="server_error", code="internal_error")


async def send_error(send, status: int, body: dict, headers: dict | None = None) -> None:
    raw = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": raw})


def host_name(header: str) -> str:
    """The name of a Host header without its port: "[::1]:80" → "::1", "LocalHost.:8000" → "localhost"."""
    header = header.strip().lower()
    if header.startswith("["):
        name = header[1 : header.find("]")] if "]" in header else header[1:]
    else:
        name = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    return name.rstrip(".")


def is_loopback_name(name: str) -> bool:
    """localhost, *.localhost (RFC 6761: browsers resolve it to loopback) or a loopback address."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class HostCheck:
    """403 for a Host header that is neither loopback nor the bound `host` (for a loopback bind without a key)."""

    def __init__(self, app, host: str):
        self.app, self.bound = app, host_name(host)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"host")
            name = host_name(given.decode("latin-1")) if given is not None else None
            if name is not None and not (is_loopback_name(name) or name == self.bound):
                message = (
                    f"Host {given.decode('latin-1')!r} is not an address of this server: it listens "
                    "on loopback only (DNS-rebinding protection); use http://127.0.0.1:<port>/, or "
                    "start it with --api-key"
                )
                return await send_error(send, 403, error_body(message, "permission_error", code="host_not_allowed"))
        await self.app(scope, receive, send)


LOG_MESSAGE_CHARS = 200  # a refusal's message is cut to this in its log line
OPEN_ROUTES = {"/health", "/"}  # no key needed: the health probe and the static chat page
QUIET_ROUTES = {"/health", "/metrics"}  # polled every few seconds: no access-log line (as llama-server)


class BearerAuth:
    """401 without `Authorization: Bearer <key>` on every route but OPEN_ROUTES (constant-time compare)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not (scope["path"] in OPEN_ROUTES and scope["method"] in ("GET", "HEAD")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            ok = hmac.compare_digest(token.strip(), self.key) and scheme.lower() == b"bearer"
            if not ok:
                message = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
                body = error_body(message, code="invalid_api_key")
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
            return await send_error(
                send, 413, error_body(f"request body is larger than {limit}", code="request_too_large")
            )
        unread = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def replay():
            return unread.pop() if unread else await receive()

        await self.app(scope, replay, send)


class Observe:
    """Outermost (module docstring); a 500 from a handler was logged by `log_failure` already."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        where = f"{scope['method']} {scope['path']}"
        seen = {"status": 0, "counted": False, "ended": False}

        async def watch(msg):
            if msg["type"] == "http.response.start":
                seen["status"] = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", rid.encode())]}
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                seen["ended"] = True
            status = seen["status"]
            if msg["type"] == "http.response.body" and status >= 400 and not seen["counted"]:
                seen["counted"] = True
                if status == 499:  # the client left: counted as cancelled, not as a refusal
                    log_refusal(499, {"type": "cancelled", "message": "the client disconnected"}, rid, where)
                else:
                    error = error_object(msg.get("body", b""))
                    kind = error.get("type")  # a plain name, else "unknown"
                    ok = isinstance(kind, str) and kind.replace("_", "").isalnum()
                    self.metrics.refused(status, kind if ok else "unknown")
                    if status < 500 or (status == 503 and scope["path"] != "/health"):  # a 500: log_failure
                        log_refusal(status, error, rid, where)
            await send(msg)

        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, watch)
        except Exception as exc:  # noqa: BLE001 - every route's failure ends here: logged, answered by id
            eid = log_failure(exc, rid)
            if not seen["status"]:
                await watch(
                    {"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"application/json")]}
                )
                await watch({"type": "http.response.body", "body": json.dumps(internal_error(eid).body()).encode()})
            elif not seen["ended"]:  # a stream that broke: end it (the client sees it stop, the log has why)
                seen["ended"] = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if scope["path"] not in QUIET_ROUTES:
                status = seen["status"] if seen["ended"] else 499  # a response that never ended: the client left
                log_access(status, where, rid, time.perf_counter() - t0, scope["state"].get("access") or {})


def error_object(raw: bytes) -> dict:
    """The `error` object of an OpenAI error body ({} when the body is not one)."""
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return {}
    return error if isinstance(error, dict) else {}
