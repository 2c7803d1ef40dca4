"""Reading chat input: a line editor with persistent history on a terminal, plain lines when piped.

Contract: both readers are callables `read(prompt) -> str` for `chat_repl.run_chat`; EOFError ends the
chat. `terminal_reader()` uses prompt_toolkit: Emacs-style line editing, Up/Down recall from a
history file kept across sessions in `paths.state_dir()/chat_history`, Ctrl-C clears the line
and prompts again (never exits), Ctrl-D on an empty line raises EOFError. When stdout is not a
terminal (`specx chat > log`) the prompt is drawn on stderr so stdout holds only replies.
`read_stdin_line` is the piped-stdin reader: one line per turn, no prompt, no history.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from specexec_cli.session import paths


def read_stdin_line(prompt: str) -> str:
    """Scripted chat: one line of piped stdin per user turn; EOF ends the chat."""
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def history_file():
    """The history file (its directory created), or None when the state dir is not writable."""
    path = paths.state_dir() / "chat_history"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    except OSError:
        return None
    return path


def terminal_reader() -> Callable[[str], str]:
    """A prompt_toolkit line reader with persistent history (in-memory if the file is unusable)."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.output import create_output

    path = history_file()
    history = FileHistory(str(path)) if path is not None else InMemoryHistory()
    output = None if sys.stdout.isatty() else create_output(stdout=sys.stderr)
    session = PromptSession(history=history, output=output, enable_history_search=False)

    def read(prompt: str) -> str:
        while True:
            try:
                return session.prompt(prompt)
            except KeyboardInterrupt:  # Ctrl-C at the prompt: drop the line, prompt again
                continue

    return read
