"""A multi-turn conversation over one DecodeState (KV caches reused across turns and requests).

Contract: `ChatSession` owns the conversation (messages, one `engine.DecodeState`, the sampling RNG,
an optional `budget.BudgetTuner`); `specx chat` and `specx serve` decode through it. Each turn
prefills only what the caches lack: with a chat template the whole conversation is rendered and the
caches are cropped to its longest common prefix with the committed ids; without one each turn
appends "User: …\nAssistant:"; with `code=True` (the demo pair) the message is code to continue.
A server renders whole conversations (`conversation_ids`), rewinds (`prefill_ids`) and streams
`decode` with per-request settings; `StopScanner` ends a reply at a stop string. Ctrl-C stops after
the current target pass (a second one at once, the caches cropped back) and keeps the partial reply.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import torch

from specexec_cli.core import kvcache
from specexec_cli.core.budget import tuner_for
from specexec_cli.core.engine import DecodeState, GenerationConfig, StepEvent
from specexec_cli.core.methods import generate
from specexec_cli.core.sampling import validate
from specexec_cli.core.stats import RunStats
from specexec_cli.errors import SpecxError, is_oom, write_output
from specexec_cli.session.interrupts import StopFlag, interrupt_guard
from specexec_cli.session.prompt_cache import common_prefix

SETTINGS = ("temperature", "top_p", "top_k", "budget", "max_new_tokens", "seed")


def rewind(st: DecodeState, keep: int) -> None:
    """Cut the committed ids to `keep` and both caches to at most that (also repairs a state
    interrupted mid-pass: rows beyond the recorded lengths are dropped)."""
    # Rows [0, keep) of either cache hold exactly ids[:keep]: the engine writes a pass's rows
    # (tree, then compaction) before it raises target_len/draft_len, and raises those before it
    # extends ids, so clamping the lengths to `keep` never keeps a row for an uncommitted token.
    del st.ids[keep:]
    st.target_len = min(st.target_len, keep)
    st.draft_len = min(st.draft_len, keep)
    kvcache.crop(st.target_cache, st.target_len)
    kvcache.crop(st.draft_cache, st.draft_len)


class ChatSession:
    def __init__(
        self,
        models,
        cfg: GenerationConfig,
        *,
        system: str | None = None,
        use_template: bool = True,
        tuner=None,
        profile: dict | None = None,
        config_record: Callable[[GenerationConfig], dict] = lambda cfg: {},
        code: bool = False,
        prompt_cache=None,
    ):
        self.models, self.cfg, self.system = models, cfg, system
        self.prompt_cache = prompt_cache  # a prompt_cache.PromptCache of other conversations, or None
        tok = models.tokenizer
        self.code = code  # each turn is code to continue: no chat format at all
        self.templated = bool(use_template and getattr(tok, "chat_template", None)) and not code
        self.profile, self.config_record = profile, config_record
        self.tuner = tuner  # a budget.BudgetTuner for --budget auto, else None
        self.flag = StopFlag()
        self.turn_stats: list[RunStats] = []
        self.clear()

    def clear(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.state = DecodeState()
        self.gen = torch.Generator().manual_seed(self.cfg.seed)

    # -- tokens for a new turn -------------------------------------------------------------------
    def _render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        tok = self.models.tokenizer
        text = render_template(tok, messages, tools)
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

    def conversation_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """A whole conversation as ids ready for the assistant's reply (template with `tools`, else
        `plain_prompt`)."""
        if self.templated:
            return self._render(messages, tools)
        return list(self.models.tokenizer(plain_prompt(messages, self.code))["input_ids"])

    def prefill_ids(self, full: list[int], state: DecodeState | None = None, save: bool = True) -> list[int]:
        """Rewind `state` (default: the session's) to its longest common prefix with `full`, after
        the prompt cache's `prepare`; returns the ids still to prefill (at least the last one)."""
        st = self.state if state is None else state
        if self.prompt_cache is not None:
            self.prompt_cache.prepare(st, full, self.models, save=save)
        keep = min(common_prefix(full, st.ids), len(full) - 1)
        if keep < len(st.ids):
            rewind(st, keep)
        return full[keep:]

    # -- one reply --------------------------------------------------------------------------------
    def decode(
        self, ids: list[int], cfg: GenerationConfig | None = None, gen: torch.Generator | None = None
    ) -> Iterator[StepEvent]:
        """The engine's events for a reply to `ids`; an error or interrupt mid-pass crops the caches
        back to the committed ids. ContextOverflow (state unchanged) when the prompt does not fit."""
        cfg, gen = cfg or self.cfg, gen if gen is not None else self.gen
        drive = self.tuner.drive if self.tuner is not None else generate
        events = drive(self.models, self.state, ids, cfg, gen)
        try:
            yield from events
        except GeneratorExit:  # closed between events: the caches are consistent
            raise
        except BaseException:
            rewind(self.state, len(self.state.ids))  # drop cache rows of the unfinished pass
            raise
        finally:
            events.close()

    def reply(self, text: str, write: Callable[[str], None], view=None) -> RunStats:
        """Stream the assistant's reply to `text` through `write`; ContextOverflow when it does not fit."""
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.prefill_ids(self._render(messages)) if self.templated else self._plain(text)
        stats = RunStats(config=self.config_record(self.cfg))
        out_ids: list[int] = []
        shown: list[str] = []  # text already written (the detokenizer may hold back a tail)
        stops = StopScanner(list(self.models.stop_strings))  # the checkpoint's own stop strings
        events = self.decode(ids)
        try:
            with interrupt_guard(self.flag):
                for ev in events:
                    out_ids.extend(ev.tokens)
                    text = stops.feed(ev.text)
                    if text:
                        write(text)
                        shown.append(text)
                    stats.add(ev)
                    self._show(stats, view)
                    if stops.stopped:
                        stats.finish = "stop"
                        break
                    if self.flag.stop and not ev.finish:
                        stats.finish = "interrupted"
                        break
        except KeyboardInterrupt:  # a second Ctrl-C (or the grace timer) landed mid-pass
            rewind(self.state, len(self.state.ids))  # drop uncommitted cache rows
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
        if stops.stopped:  # the reply is what was shown, up to the stop string
            reply = printed
        elif stats.finish not in ("interrupted", "oom") and (tail := stops.flush()):
            write(tail)
        if stats.finish in ("interrupted", "oom") and len(reply) > len(printed) and reply.startswith(printed):
            write(reply[len(printed) :])  # a stop mid-pass: show the held-back tail that is kept
        self.messages = messages + [{"role": "assistant", "content": reply}]
        self.turn_stats.append(stats)
        return stats

    def _show(self, stats: RunStats, view) -> None:
        if self.tuner is not None:
            stats.config.update(budget=self.tuner.shape.budget, max_depth=self.tuner.shape.max_depth)
        if view is not None:
            shape = self.tuner.shape if self.tuner is not None else None
            view.update(stats, {"budget": f"auto → {shape.budget}, depth {shape.max_depth}"} if shape else None)

    def turn_record(self, stats: RunStats) -> dict:
        rec = stats.to_json()
        rec.update(
            turn=len(self.turn_stats),
            prefill_tokens=stats.prompt_tokens,
            context_tokens=len(self.state.ids),
            finish_reason=stats.finish,
            host_rss_bytes=psutil.Process().memory_info().rss,
        )
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
                self.tuner = tuner_for(self.models, self.cfg.shape, self.profile)
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
        return dict(
            temperature=c.sampling.temperature,
            top_p=c.sampling.top_p,
            top_k=c.sampling.top_k,
            budget="auto" if self.tuner else c.shape.budget,
            max_new_tokens=c.max_new_tokens,
            seed=c.seed,
        )

    def save(self, path: str) -> str:
        data = dict(
            schema="specx-chat",
            version=1,
            system=self.system,
            templated=self.templated,
            settings=self.settings(),
            messages=self.messages,
            context_tokens=len(self.state.ids),
        )
        write_output(Path(path), json.dumps(data, indent=1, ensure_ascii=False) + "\n", "/save")
        return f"saved {sum(m['role'] != 'system' for m in self.messages)} messages to {path}"

    def summary(self) -> str:
        ts = self.turn_stats
        tokens = sum(s.new_tokens for s in ts)
        secs = sum(s.decode_seconds for s in ts)
        passes = sum(s.target_passes for s in ts)
        per_pass = sum(sum(s.pass_tokens) for s in ts) / passes if passes else 0.0
        return (
            f"chat: {len(ts)} turns, {tokens} tokens generated in {secs:.2f}s "
            f"({tokens / secs if secs else 0:.2f} tok/s), {per_pass:.2f} tokens/pass, "
            f"{sum(s.prompt_tokens for s in ts)} tokens prefilled, context {len(self.state.ids)}/{self.models.ctx_limit}"
        )


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


class TemplateError(SpecxError):
    """The chat template raised for this conversation (its message says why)."""


def fold_system(messages: list[dict]) -> list[dict]:
    """The conversation without system messages: their text opens the first user turn (as llama.cpp
    and ollama do for templates that reject the system role, e.g. Gemma-2's)."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    rest = [dict(m) for m in messages if m["role"] != "system"]
    first = next((m for m in rest if m["role"] == "user"), None)
    if first is None:
        return [{"role": "user", "content": system}, *rest]
    first["content"] = f"{system}\n\n{first['content']}" if first["content"] else system
    return rest


def render_template(tok, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The chat template's text for `messages` (and `tools`) plus the generation prompt. A template
    that raises is tried again with the system messages folded into the first user turn; if that
    raises too (or there is no system message), TemplateError carries the template's own message."""
    folded = [fold_system(messages)] if any(m["role"] == "system" for m in messages) else []
    for conversation in [messages, *folded]:
        try:
            return tok.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - jinja2 errors and the template's raise_exception()
            error = exc  # the last one: what is still wrong once the system role is gone
    raise TemplateError(f"the chat template refused this conversation: {error}") from None


def plain_prompt(messages: list[dict], code: bool) -> str:
    """A conversation without a chat template, as `ChatSession._plain` builds it turn by turn."""
    text = ""
    for msg in messages:
        role, content = msg["role"], msg["content"]
        if role == "assistant":
            text += content
        elif code:
            text += ("" if not text or text.endswith("\n") else "\n") + content + "\n"
        elif role == "system":
            text += f"{content}\n\n"
        else:
            text += ("\n" if text and not text.endswith("\n\n") else "") + f"User: {content}\nAssistant:"
    return text


class StopScanner:
    """Ends a reply at the first of `stops`: `feed` returns the text safe to show (a tail that may
    become a stop string is held back); `stopped` once one is found (never shown)."""

    def __init__(self, stops: list[str] | None = None):
        self.stops = [s for s in (stops or []) if s]
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        if self.stopped:
            return ""
        buf = self.pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.pending = True, ""
            return buf[:cut]
        hold = max((n for s in self.stops for n in range(1, len(s)) if buf.endswith(s[:n])), default=0)
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """The held-back tail once the reply ended without a stop string."""
        tail, self.pending = ("" if self.stopped else self.pending), ""
        return tail
