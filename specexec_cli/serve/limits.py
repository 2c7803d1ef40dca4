"""How long one reply of `specx serve` may run: the default cap, the caps of a chat front end's
background tasks, and the repetition guard.

Contract: `reply_limit(work, default, task_caps)` is (max new tokens or None, task or None): the
request's `max_tokens` wins, -1 (llama-server's and ollama's "no limit") is None, none given is
`default` (--max-new-tokens); with `task_caps` an Open WebUI background task (`task_of`) gets at most
TASK_CAPS[task], as those front ends send 1000 or no max_tokens for a reply of a few dozen tokens.
`guard_on(work, server)`: the request's `specx.repetition_guard`, else the server's switch, off for
a greedy request. `RepetitionGuard.feed(tokens)` is true once the reply's tail repeats one span;
`TaskAnswer.feed(text, tokens)` once a task's first JSON object has closed ("json_end") or none has
opened within OPEN_WITHIN tokens ("no_json"); the worker then ends the reply ("stop"). Open WebUI
reads a task's answer from its first "{" to its last "}", so neither loses it anything.
"""

from __future__ import annotations

from specexec_cli.serve.models import Work

# Open WebUI's default task templates (backend/open_webui/config.py) begin "### Task:" and paste the
# chat between <chat_history> tags; the first words of the task tell the kinds apart. Caps in tokens:
# a title or tag object is 10-30 tokens, 3-5 follow-up questions in JSON 60-150. Open WebUI's page
# shows Stop until the follow-ups (and, after the first reply, the tags) are done: on SmolLM2 at
# ~30 tokens/s 256 follow-up tokens and 96 of tags kept it busy 10 s after the reply (issue 56.5).
TASK_MARK, HISTORY_MARK = "### Task:", "<chat_history>"
TASKS = (  # (words the task's first line starts with, lowercased; the task's name), first match wins
    ("generate a concise", "title"),
    ("generate 1-3 broad tags", "tags"),
    ("suggest 3-5 relevant follow-up", "follow_ups"),
    ("predict 3-5 useful messages", "follow_ups"),  # Open WebUI 0.12's follow-up template
    ("analyze the chat history", "queries"),
    ("you are an autocompletion system", "autocomplete"),
    ("generate a detailed prompt", "image_prompt"),
)
# "task": a "### Task:" prompt of no known kind
TASK_CAPS = dict(title=64, tags=96, follow_ups=160, queries=128, autocomplete=64, image_prompt=256, task=256)

# The guard's rule: the reply's tail is one span of p tokens (1 <= p <= MAX_PERIOD) repeated, at
# least MIN_REPEATS copies in a row and at least MIN_RUN tokens in all (so a short span must repeat
# more: 8 copies of 8 tokens, 64 of one). A loop that long no longer ends on a small model's greedy or
# near-greedy decoding; a reply shorter than MIN_RUN tokens is never cut.
MAX_PERIOD, MIN_REPEATS, MIN_RUN = 256, 4, 64
OPEN_WITHIN = 48  # tokens: "Here are the follow-ups:\n```json\n{" is about 12


def task_of(work: Work) -> str | None:
    """The Open WebUI background task a chat request is (its last user message starts with
    "### Task:" and carries the pasted <chat_history>), or None."""
    if not work.messages:
        return None
    users = [m for m in work.messages if m.get("role") == "user"]
    text = str(users[-1].get("content") or "").lstrip() if users else ""
    if not text.startswith(TASK_MARK) or HISTORY_MARK not in text:
        return None
    first = " ".join(text[len(TASK_MARK) :].split("\n", 2)[:2]).strip().lower()
    return next((name for words, name in TASKS if first.startswith(words)), "task")


def reply_limit(work: Work, default: int | None, task_caps: bool = False) -> tuple[int | None, str | None]:
    asked = work.max_tokens
    limit = default if asked is None else None if asked == -1 else asked
    task = task_of(work) if task_caps else None
    if task is not None:
        cap = TASK_CAPS[task]
        limit = cap if limit is None else min(limit, cap)
    return limit, task


def guard_on(work: Work, server: bool) -> bool:
    if work.repetition_guard is not None:
        return work.repetition_guard
    from specexec_cli.core.sampling import GREEDY_BELOW

    greedy = work.temperature is not None and work.temperature < GREEDY_BELOW
    return server and not greedy


class RepetitionGuard:
    """Watches a reply's tokens for the guard's rule (above). `run[p]` counts the trailing tokens that
    equal the token p before them, so each new token costs MAX_PERIOD comparisons, whatever the
    reply's length."""

    def __init__(self):
        self.ids: list[int] = []
        self.run = [0] * (MAX_PERIOD + 1)
        # the run of period p that fires: the tail of run[p] + p tokens is max(MIN_REPEATS * p, MIN_RUN) long
        self.need = [0] + [max(MIN_REPEATS * p, MIN_RUN) - p for p in range(1, MAX_PERIOD + 1)]
        self.fired = False

    def feed(self, tokens) -> bool:
        """Add the reply's next tokens; True once (and after) its tail repeats as the rule says."""
        for token in tokens:
            self.ids.append(int(token))
            n = len(self.ids) - 1
            ids, run, need, last = self.ids, self.run, self.need, self.ids[n]
            for p in range(1, min(MAX_PERIOD, n) + 1):
                # the tail of run[p] + p tokens has period p: its first copy, then run[p] equal tokens
                run[p] = run[p] + 1 if ids[n - p] == last else 0
                if run[p] >= need[p]:
                    self.fired = True
        return self.fired


class TaskAnswer:
    """Watches a background task's reply text for the end of its first JSON object (braces counted
    outside JSON strings, escapes honoured); see the module docstring. `fired`: why it ended, or None."""

    def __init__(self):
        self.tokens, self.depth = 0, 0
        self.opened = self.in_string = self.escaped = False
        self.fired: str | None = None

    def feed(self, text: str, tokens: int) -> bool:
        """Add the reply's next text (and how many tokens it took); True once (and after) it is done."""
        self.tokens += tokens
        for ch in text:
            if self.fired:
                break
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
            elif ch == '"' and self.opened:
                self.in_string = True
            elif ch == "{":
                self.opened, self.depth = True, self.depth + 1
            elif ch == "}" and self.depth:
                self.depth -= 1
                self.fired = None if self.depth else "json_end"
        if self.fired is None and not self.opened and self.tokens >= OPEN_WITHIN:
            self.fired = "no_json"
        return self.fired is not None
