"""The terminal chat loop of `specx chat` over a `chat.ChatSession`: commands, multi-line input, turns.

Contract: `run_chat` takes plain callables for input, stdout text, stderr notices and the live view
(it imports neither typer nor rich); the session (chat.py) owns the conversation, caches and decoding.
Its readers are `read(prompt) -> str`, EOFError ending the chat: `terminal_reader()` (prompt_toolkit:
line editing, history in `paths.state_dir()/chat_history`, Ctrl-C clears the line, the prompt on
stderr when stdout is not a terminal) and `read_stdin_line` (one piped line per turn, no prompt).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from specexec_cli.core.state import ContextOverflow
from specexec_cli.errors import SpecxError, oom_error
from specexec_cli.session import paths
from specexec_cli.session.chat import ChatSession

HELP = """commands:
  /help                 this list
  /clear                forget the conversation (and the KV caches)
  /save FILE            write the conversation as JSON
  /set NAME VALUE       temperature, top_p, top_k, budget (N or auto), max_new_tokens, seed
  /stats                session totals
  /exit                 leave (also Ctrl-D)
  \"\"\" ... \"\"\"            multi-line message
Up/Down recall earlier messages. Ctrl-C stops a reply (the partial reply is kept);
Ctrl-C at the prompt clears the line."""


def read_message(read_line: Callable[[str], str], first: str) -> str:
    """A line, or a \"\"\"-fenced block spanning several lines (fences may carry text)."""
    if not first.lstrip().startswith('"""'):
        return first
    body = first.lstrip()[3:]
    if body.rstrip().endswith('"""') and body.strip():
        return body.rstrip()[:-3]
    lines = [body] if body else []
    while True:
        line = read_line("... ")
        if line.rstrip().endswith('"""'):
            lines.append(line.rstrip()[:-3])
            return "\n".join(lines).strip("\n")
        lines.append(line)


def command(session: ChatSession, line: str, info: Callable[[str], None]) -> bool:
    """Run a /command; returns False for /exit."""
    name, _, arg = line[1:].strip().partition(" ")
    arg = arg.strip()
    if name in ("exit", "quit"):
        return False
    if name == "help":
        info(HELP)
    elif name == "clear":
        session.clear()
        info("conversation cleared")
    elif name == "save" and arg:
        info(session.save(arg))
    elif name == "set" and len(arg.split()) == 2:
        info(session.set_option(*arg.split()))
    elif name == "set" and not arg:
        info(", ".join(f"{k} = {v}" for k, v in session.settings().items()))
    elif name == "stats":
        info(session.summary())
    elif name in ("save", "set"):
        info(f"usage: /{name} {'FILE' if name == 'save' else 'NAME VALUE'} (see /help)")
    else:
        info(f"unknown command /{name}; type /help for the list")
    return True


def run_chat(
    session: ChatSession,
    read_line: Callable[[str], str],
    write: Callable[[str], None],
    info: Callable[[str], None],
    view_factory: Callable[[], object] = nullcontext,
    stats_json: Path | None = None,
    prompt: str = "",
) -> int:
    """The chat loop. Returns the exit code (0); EOF, /exit and Ctrl-C at the prompt all end it."""
    try:
        while True:
            try:
                line = read_line(prompt)
            except (EOFError, KeyboardInterrupt):
                break
            if not line.strip():
                continue
            if line.startswith("/"):
                try:
                    if not command(session, line, info):
                        break
                except SpecxError as exc:
                    info(f"error: {exc}")
                continue
            try:
                text = read_message(read_line, line)
            except (EOFError, KeyboardInterrupt):
                break
            turn(session, text, write, info, view_factory, stats_json)
    finally:
        info(session.summary())
    return 0


def turn(session: ChatSession, text: str, write, info, view_factory, stats_json: Path | None) -> None:
    """One user turn: stream the reply, end it with a newline, log the stats line."""
    ended = [True]

    def out(chunk: str) -> None:
        write(chunk)
        ended[0] = chunk.endswith("\n")

    try:
        with view_factory() as view:
            stats = session.reply(text, out, view)
    except ContextOverflow as exc:
        info(f"error: the conversation no longer fits: {exc}. Type /clear to start a new one.")
        return
    if not ended[0] or not stats.token_ids:
        write("\n")
    if stats.finish == "interrupted":
        info("(reply stopped; the partial reply is kept)")
    elif stats.finish == "oom":
        err = oom_error(None, session.cfg.shape.budget, session.models.ctx_limit)
        info(f"error: {err} (the partial reply is kept; /set budget N lowers it here)")
    elif stats.finish == "context":
        info("the context window is full; type /clear to start a new conversation")
    if stats_json is not None:
        try:
            with open(stats_json, "a") as f:
                f.write(json.dumps(session.turn_record(stats)) + "\n")
        except OSError as exc:
            info(f"error: cannot append to {stats_json} ({exc.strerror})")


def read_stdin_line(prompt: str) -> str:
    """Scripted chat: one line of piped stdin per user turn; EOF ends the chat."""
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def terminal_reader() -> Callable[[str], str]:
    """A prompt_toolkit line reader with persistent history (in-memory if the file is unusable)."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.output import create_output

    path = paths.state_dir() / "chat_history"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
        history = FileHistory(str(path))
    except OSError:  # the state dir is not writable
        history = InMemoryHistory()
    output = None if sys.stdout.isatty() else create_output(stdout=sys.stderr)
    session = PromptSession(history=history, output=output, enable_history_search=False)

    def read(prompt: str) -> str:
        while True:
            try:
                return session.prompt(prompt)
            except KeyboardInterrupt:  # Ctrl-C at the prompt: drop the line, prompt again
                continue

    return read
