"""`specx serve`: an OpenAI-compatible HTTP server and a built-in chat page over one loaded model pair.

Contract: the package adds HTTP around `chat.ChatSession` and nothing else — no decoding logic of
its own. `models` holds the request models (pydantic) and the OpenAI response shapes; `worker` runs
requests one at a time, first come first served, on one thread that owns the session; `app` is the
FastAPI application (routes, errors, CORS); `guards` its middleware (Host check, auth, body
limit, error counting, 5xx by error id); `metrics` the Prometheus counters;
`server` binds the socket and runs uvicorn with a graceful SIGINT/SIGTERM stop; `page.html` is
the single-file offline chat page served at `/`. Only `server.run_server` is called by the CLI.
"""
