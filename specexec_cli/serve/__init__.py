"""`specx serve`: an OpenAI-compatible HTTP server and a built-in chat page over one loaded model pair.

Contract: the package adds HTTP around `chat.ChatSession` and nothing else (no decoding logic of its
own); each module's docstring states its part, `page.html` is the offline chat page served at `/`.
Only `server.run_server` is called by the CLI.
"""
