"""Interactive and scripted multi-turn chat over one DecodeState (KV caches reused across turns).

Contract: `ChatSession` owns the conversation (messages, one `engine.DecodeState`, the sampling RNG
and an optional `budget.BudgetTuner`). Each turn prefills only tokens not already in the caches:
- with a chat template, the whole conversation is rendered and tokenized, and the suffix after the
  longest common prefix with the committed ids is prefilled; if the rendering diverges from the
  committed ids (re-tokenized reply, template quirks) the caches are cropped to the divergence
  point first, so only the tail is recomputed;
- without one, each turn appends "User: …\nAssistant:" (a trailing EOS is dropped first: it is
  never in either cache, so this is free);
- `code=True` (a code model such as the demo pair): each turn is code to continue — the message
  and a newline are appended to the conversation as they are, and the reply continues them.
`run_chat` is the read–eval loop (commands, multi-line input, Ctrl-C handling) and takes plain
callables for input, stdout text, stderr notices and the live view, so it imports neither typer
nor rich. Ctrl-C during a reply stops after the current target pass (a second Ctrl-C interrupts at
once; the caches are then cropped back to the committed ids) and keeps the partial reply.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Callable

import psutil
import torch

from specexec_cli import kvcache
from specexec_cli.engine import ContextOverflow, DecodeState, GenerationConfig
from specexec_cli.methods import generate
from specexec_cli.errors import SpecxError, is_oom, oom_error, write_output
from specexec_cli.interrupts import StopFlag, interrupt_guard
from specexec_cli.sampling import validate
from specexec_cli.stats import RunStats

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

SETTINGS = ("temperature", "top_p", "top_k", "budget", "max_new_tokens", "seed")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def rewind(st: DecodeState, keep: int) -> None:
    """Cut the committed ids to `keep` and both caches to at most that (invariants stay valid).

    Also repairs a state interrupted mid-pass: cache rows beyond the recorded lengths are dropped.
    """
    # Rows [0, keep) of either cache hold exactly ids[:keep]: the engine writes a pass's rows
    # (tree, then compaction) before it raises target_len/draft_len, and raises those before it
    # extends ids, so clamping the lengths to `keep` never keeps a row for an uncommitted token.
    del st.ids[keep:]
    st.target_len = min(st.target_len, keep)
    st.draft_len = min(st.draft_len, keep)
    kvcache.crop(st.target_cache, st.target_len)
    kvcache.crop(st.draft_cache, st.draft_len)


class ChatSession:
    """One conversation; see the module docstring for how turns reuse the caches."""

    def __init__(self, models, cfg: GenerationConfig, *, system: str | None = None, use_template: bool = True,
                 tuner=None, profile: dict | None = None,
                 config_record: Callable[[GenerationConfig], dict] = lambda cfg: {}, code: bool = False):
        self.models, self.cfg, self.system = models, cfg, system
        tok = models.tokenizer
        self.code = code  # each turn is code to continue: no chat format at all
        self.templated = bool(use_template and getattr(tok, "chat_template", None)) and not code
        self.profile, self.config_record = profile, config_record
        self.tuner = tuner  # a budget.BudgetTuner for --budget auto, else None
        self.flag = StopFlag()
        self.turn_stats: list[RunStats] = []
        self.clear()

    def _make_tuner(self):
        from specexec_cli.budget import make_tuner, weights_stream

        on_cuda = getattr(self.models.target, "device", torch.device("cpu")).type == "cuda"
        return make_tuner(self.profile, self.cfg.shape, on_cuda, weights_stream(self.models.target))

    def clear(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.state = DecodeState()
        self.gen = torch.Generator().manual_seed(self.cfg.seed)

    # -- tokens for a new turn -------------------------------------------------------------------
    def _render(self, messages: list[dict]) -> list[int]:
        tok = self.models.tokenizer
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def _plain(self, text: str) -> list[int]:
        st, tok = self.state, self.models.tokenizer
        if st.ids and st.ids[-1] in self.models.eos_ids:
            st.ids.pop()  # the last committed token is in neither cache: dropping it is free
        first = not st.ids
        if self.code:  # the message continues the code so far, on a line of its own
            sep = "" if first or self.models.tokenizer.decode(st.ids[-1:]).endswith("\n") else "\n"
            return list(tok(f"{sep}{text}\n", add_special_tokens=first)["input_ids"])
        head = f"{self.system}\n\n" if first and self.system else ("" if first else "\n")
        return list(tok(f"{head}User: {text}\nAssistant:", add_special_tokens=first)["input_ids"])

    def turn_ids(self, messages: list[dict], text: str) -> list[int]:
        """The ids to prefill for the new user turn (rewinding the state if the rendering diverged)."""
        if not self.templated:
            return self._plain(text)
        full = self._render(messages)
        keep = min(common_prefix(full, self.state.ids), len(full) - 1)
        if keep < len(self.state.ids):
            rewind(self.state, keep)
        return full[keep:]

    # -- one reply --------------------------------------------------------------------------------
    def _events(self, ids: list[int]):
        if self.tuner is not None:
            return self.tuner.drive(self.models, self.state, ids, self.cfg, self.gen)
        return generate(self.models, self.state, ids, self.cfg, self.gen)

    def reply(self, text: str, write: Callable[[str], None], view=None) -> RunStats:
        """Generate the assistant's reply to `text`, streaming it through `write`.

        Raises ContextOverflow (history unchanged) when the turn does not fit.
        """
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.turn_ids(messages, text)
        stats = RunStats(config=self.config_record(self.cfg))
        out_ids: list[int] = []
        shown: list[str] = []   # text already written (the detokenizer may hold back a tail)
        events = self._events(ids)
        try:
            with interrupt_guard(self.flag):
                for ev in events:
                    out_ids.extend(ev.tokens)
                    if ev.text:
                        write(ev.text)
                        shown.append(ev.text)
                    stats.add(ev)
                    self._show(stats, view)
                    if self.flag.stop and not ev.finish:
                        stats.finish = "interrupted"
                        break
        except KeyboardInterrupt:  # a second Ctrl-C (or the grace timer) landed mid-pass
            rewind(self.state, len(self.state.ids))   # drop uncommitted cache rows
            stats.finish = "interrupted"
        except RuntimeError as exc:  # device OOM mid-pass: keep what was generated, go on chatting
            if not is_oom(exc):
                raise
            rewind(self.state, len(self.state.ids))
            stats.finish = "oom"
        finally:
            events.close()
        reply = self.models.tokenizer.decode(out_ids, skip_special_tokens=True)
        printed = "".join(shown)
        if stats.finish in ("interrupted", "oom") and len(reply) > len(printed) and reply.startswith(printed):
            write(reply[len(printed):])   # a stop mid-pass: show the held-back tail that is kept
        self.messages = messages + [{"role": "assistant", "content": reply}]
        self.turn_stats.append(stats)
        return stats

    def _show(self, stats: RunStats, view) -> None:
        if self.tuner is not None:
            stats.config.update(budget=self.tuner.shape.budget, max_depth=self.tuner.shape.max_depth)
        if view is not None:
            extra = {"budget": f"auto → {self.tuner.shape.budget}, depth {self.tuner.shape.max_depth}"} if self.tuner else None
            view.update(stats, extra)

    def turn_record(self, stats: RunStats) -> dict:
        """The --stats-json line: run keys plus turn, prefill_tokens and context_tokens."""
        rec = stats.to_json()
        rec.update(turn=len(self.turn_stats), prefill_tokens=stats.prompt_tokens,
                   context_tokens=len(self.state.ids), finish_reason=stats.finish,
                   host_rss_bytes=psutil.Process().memory_info().rss)  # fmt: skip
        return rec

    # -- commands ---------------------------------------------------------------------------------
    def set_option(self, name: str, value: str) -> str:
        """Validate and apply `/set NAME VALUE`; returns a confirmation line."""
        name = name.replace("-", "_").lower()
        if name not in SETTINGS:
            raise SpecxError(f"/set: unknown setting {name!r}; one of {', '.join(SETTINGS)}")
        cfg = self.cfg
        if name == "budget":
            if value == "auto":
                self.tuner = self._make_tuner()
                return f"budget auto (now {self.tuner.shape.budget})"
            self.cfg, self.tuner = replace(cfg, shape=replace(cfg.shape, budget=_int(name, value, 1))), None
        elif name in ("temperature", "top_p", "top_k"):
            number = _int(name, value, 0) if name == "top_k" else _float(name, value)
            sampling = replace(cfg.sampling, **{name: number})
            try:
                validate(sampling)
            except ValueError as exc:
                raise SpecxError("/set " + str(exc).replace("--", "").replace("-", "_", 1)) from None
            self.cfg = replace(cfg, sampling=sampling)
        elif name == "max_new_tokens":
            self.cfg = replace(cfg, max_new_tokens=_int(name, value, 1))
        else:  # seed: restart the sampling stream
            self.cfg = replace(cfg, seed=_int(name, value, None))
            self.gen = torch.Generator().manual_seed(self.cfg.seed)
        return f"{name} = {value}"

    def settings(self) -> dict:
        c = self.cfg
        return dict(temperature=c.sampling.temperature, top_p=c.sampling.top_p, top_k=c.sampling.top_k,
                    budget="auto" if self.tuner else c.shape.budget, max_new_tokens=c.max_new_tokens, seed=c.seed)

    def save(self, path: str) -> str:
        data = dict(schema="specx-chat", version=1, system=self.system, templated=self.templated,
                    settings=self.settings(), messages=self.messages,
                    context_tokens=len(self.state.ids))  # fmt: skip
        write_output(Path(path), json.dumps(data, indent=1, ensure_ascii=False) + "\n", "/save")
        return f"saved {sum(m['role'] != 'system' for m in self.messages)} messages to {path}"

    def summary(self) -> str:
        ts = self.turn_stats
        tokens = sum(s.new_tokens for s in ts)
        secs = sum(s.decode_seconds for s in ts)
        passes = sum(s.target_passes for s in ts)
        per_pass = sum(sum(s.pass_tokens) for s in ts) / passes if passes else 0.0
        return (f"chat: {len(ts)} turns, {tokens} tokens generated in {secs:.2f}s "
                f"({tokens / secs if secs else 0:.2f} tok/s), {per_pass:.2f} tokens/pass, "
                f"{sum(s.prompt_tokens for s in ts)} tokens prefilled, context {len(self.state.ids)}/{self.models.ctx_limit}")


def _int(name: str, value: str, minimum: int | None) -> int:
    try:
        number = int(value)
    except ValueError:
        raise SpecxError(f"/set {name} needs an integer (got {value!r})") from None
    if minimum is not None and number < minimum:
        raise SpecxError(f"/set {name} must be >= {minimum} (got {number})")
    return number


def _float(name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise SpecxError(f"/set {name} needs a number (got {value!r})") from None


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
            return "\n".join(x for x in lines if x is not None).strip("\n")
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


def run_chat(session: ChatSession, read_line: Callable[[str], str], write: Callable[[str], None],
             info: Callable[[str], None], view_factory: Callable[[], object] = nullcontext,
             stats_json: Path | None = None, prompt: str = "") -> int:
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
