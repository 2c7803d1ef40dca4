"""Run `specx serve`: plan, bind, start uvicorn at once, load the models on the worker thread.

Contract: `run_server(flags, options)` returns the exit code. Flag and plan errors, and a port that
cannot be bound, raise `SpecxError` before anything binds (one line, exit 2). /health answers 503
"loading" while the worker loads; a failed load prints one line and exits 2. SIGINT/SIGTERM: /health
answers 503 "stopping", running generations end at their next target pass, queued ones are refused,
the worker joins, the models close, exit 0; stopped while loading, it exits 0 at once
(`stop_while_loading`). A request gets --max-new-tokens, limits.py's task caps and guard, and where it
sets no sampling --temperature/--top-k/--top-p, then the target's generation defaults (generation_config.json,
general.sampling.*), then llama-server's; the prompt cache is `cache_ram` bytes (None: from the plan; 0: none).
"""

from __future__ import annotations

import socket
import warnings
from dataclasses import dataclass, field

from specexec_cli.errors import SpecxError
from specexec_cli.session import notices


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    api_key: str | None = None
    max_queue: int = 8
    cors: list[str] = field(default_factory=list)
    system: str | None = None
    cache_ram: int | None = None  # prompt cache bytes (--cache-ram); None = from the plan, 0 = off
    max_new_tokens: int | None = None  # --max-new-tokens when given; None: the flag's default (serve_on)
    repetition_guard: bool = True  # the guard of limits.py watches replies (a request may switch it)
    task_caps: bool = True  # Open WebUI's title/tags/follow-up requests get limits.TASK_CAPS
    # --parallel: requests decoding at once; None = what the plan fits (scheduler.parallel_fit)
    parallel: int | None = None


def check_options(o: ServeOptions) -> None:
    if not 1 <= o.port <= 65535:
        raise SpecxError(f"--port must be in 1..65535 (got {o.port})")
    if o.max_queue < 0:
        raise SpecxError(f"--max-queue must be >= 0 (got {o.max_queue})")
    if o.parallel is not None and o.parallel < 1:
        raise SpecxError(f"--parallel must be >= 1 (got {o.parallel})")
    if o.max_new_tokens is not None and o.max_new_tokens < 1:
        raise SpecxError(f"--max-new-tokens must be >= 1 (got {o.max_new_tokens})")
    if o.api_key is not None and not o.api_key.strip():
        raise SpecxError("--api-key (or SPECX_API_KEY) is empty; pass a non-empty key or leave it unset")
    for origin in o.cors:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise SpecxError(f"--cors {origin!r}: pass an origin such as http://localhost:3000 (or *)")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or a one-line SpecxError (port in use, unknown host)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SpecxError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        hint = "; pass another --port" if exc.errno in (98, 48) else ""
        raise SpecxError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    sock.set_inheritable(True)
    return sock


def make_loader(flags, opts, plan, cfg, system, cache_ram: int | None = None):
    """The worker's load(): models, the budget tuner, the prompt cache and a ChatSession -> (session, defaults)."""

    def load():
        from specexec_cli.session.gendefaults import generation_of, merge, serve_sampling
        from specexec_cli.session.options import load_fitted
        from specexec_cli.session.prompt_cache import make_prompt_cache

        fitted = load_fitted(flags, opts, plan, cfg)
        session = fitted.chat_session(system, make_prompt_cache(fitted.models, plan, cache_ram))
        return session, merge(serve_sampling(generation_of(opts.target)), flags.temperature, flags.top_k, flags.top_p)

    return load


def run_server(flags, o: ServeOptions) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise SpecxError(f"specx serve needs {exc.name}: pip install 'fastapi>=0.115' 'uvicorn>=0.30'") from None
    check_options(o)
    from specexec_cli.session.options import show_plan

    opts, plan, cfg = flags.plan(flags.config())
    from specexec_cli.serve.scheduler import parallel_fit

    o.parallel, note = parallel_fit(plan, o.parallel, cfg.method)
    if note:
        notices.notice(note)
    if flags.dry_run:
        show_plan(plan, None)
        return 0
    from specexec_cli.serve.guards import is_loopback_name

    if not is_loopback_name(o.host.strip("[]").lower()) and not o.api_key:
        notices.notice(
            f"warning: listening on {o.host} without --api-key: anyone who can reach this "
            "port can use the model; pass --api-key KEY (or set SPECX_API_KEY)"
        )
    sock = bind(o.host, o.port)
    # library deprecation notices (one per forward call site) must not reach the server's terminal
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    return serve_on(sock, flags, o, opts, plan, cfg)


def serve_on(sock, flags, o: ServeOptions, opts, plan, cfg) -> int:
    import uvicorn

    from specexec_cli.serve.app import create_app
    from specexec_cli.serve.metrics import Metrics
    from specexec_cli.serve.names import aliases, model_id
    from specexec_cli.serve.worker import Worker

    target = opts.target  # the plan resolved it (or refused the run)
    auto = model_id(target.name, target.path)  # a name, never a path; the path (and --target) still answer
    name = o.model_name or auto
    worker = Worker(
        make_loader(flags, opts, plan, cfg, o.system, o.cache_ram),
        o.max_queue,
        Metrics(),
        max_new_tokens=o.max_new_tokens or flags.max_new_tokens,
        parallel=o.parallel or 1,
        repetition_guard=o.repetition_guard,
        task_caps=o.task_caps,
    )
    app = create_app(
        worker,
        name,
        api_key=o.api_key,
        cors=o.cors,
        host=o.host,
        aliases=aliases(target.name, target.path, name) | ({auto} - {name}),
    )
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30)
    server = graceful_server(config, worker)
    failure: list[str] = []

    def failed(exc: BaseException) -> None:
        known = isinstance(exc, (SpecxError, ValueError))
        failure.append(str(exc) if known else f"internal error while loading: {exc.__class__.__name__}: {exc}")
        server.should_exit = True

    def ready_notice() -> None:
        host = f"[{o.host}]" if ":" in o.host else o.host
        notices.notice(f"specx serve: {name} on http://{host}:{o.port} (OpenAI API at /v1, chat page at /)")

    worker.on_failed = failed
    worker.on_ready = ready_notice
    notices.notice(f"specx serve: loading {name} ...")
    worker.start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        close_session(worker)
    if failure:
        notices.error(failure[0])
    code = 2 if failure else 0
    if worker.thread.is_alive() and worker.state == "loading":  # stopped while loading: see stop_while_loading
        stop_while_loading(code)
    return code


def stop_while_loading(code: int) -> None:
    """End the process now: the load runs in torch and C code that has no stop point, and Python's own
    shutdown under a running load aborts the process ("terminate called ...", exit 134)."""
    import os
    import sys

    notices.notice("specx serve: stopped while the model was loading")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def close_session(worker) -> None:
    """Join the worker (it ends its reply at a pass boundary once stopping), then close the models."""
    worker.shutdown()
    if worker.thread.is_alive() and worker.state != "loading":
        worker.thread.join()
    session = getattr(worker, "session", None)
    if session is not None:
        from specexec_cli.session.loading import close_models

        close_models(session.models)


def graceful_server(config, worker):
    """uvicorn.Server whose SIGINT/SIGTERM also stop the worker at a pass boundary, and which exits
    normally afterwards instead of re-raising the signal (exit code 0)."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            worker.shutdown()
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return _Server(config)
