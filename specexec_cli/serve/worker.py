"""The worker of `specx serve`: loads the models, then serves requests, streamed ones first.

Contract: `Worker(load, max_queue, metrics)` owns the `chat.ChatSession`. `submit(job)` never
blocks: it queues the job or raises `APIError` (503 while loading or stopping, 429 with Retry-After
when `max_queue` requests already wait). Queued jobs are taken streamed first, then in order; where
the forest runs the method (core.forest.FOREST_METHODS) every job decodes through scheduler.py, else
one at a time with `ChatSession.decode`. `job.cancel()` frees a queued job's slot and stops a
running one after the current pass; `shutdown()` stops them all and refuses the queued ones (503).
A chat template that raises, or a grammar or logprobs on a method that cannot give them, is a 400
before the reply starts.
"""
from __future__ import annotations

import queue
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from collections.abc import Callable

from specexec_cli.serve.jobs import Delta, Done, Failed, Job, Started, spans
from specexec_cli.serve.limits import RepetitionGuard, TaskAnswer, guard_on, reply_limit, task_of
from specexec_cli.serve.models import APIError, Work
from specexec_cli.serve.reply import Piece, Reply
from specexec_cli.serve.shapes import usage_body

FINISH = {"eos": "stop", "length": "length", "context": "length", "grammar": "stop", "stop": "stop"}
PLAIN_STOPS = ["\nUser:"]  # the plain (no template) chat format: the model starting the next user turn
STOP = ((False, -1), None)  # the job queue's shutdown sentinel: ahead of every job
MAX_THREADS = 64  # job threads waiting in the scheduler past --parallel (the rest wait in the job queue)


@dataclass
class Worker:
    """See the module docstring. `load()` returns (ChatSession, default SamplingParams)."""

    load: Callable[[], tuple]
    max_queue: int
    metrics: object
    on_failed: Callable[[BaseException], None] = lambda exc: None
    on_ready: Callable[[], None] = lambda: None
    state: str = "loading"  # loading | ready | failed
    jobs: queue.PriorityQueue = field(default_factory=queue.PriorityQueue)  # (priority, Job | None)
    stopping: threading.Event = field(default_factory=threading.Event)
    pending: int = 0  # submitted and not finished (the running one included)
    job_seconds: float = 5.0  # running mean of a request's wall time (for Retry-After)
    max_new_tokens: int | None = None  # the max_tokens of requests that send none (None: to EOS or the context end)
    repetition_guard: bool = False  # limits.RepetitionGuard watches replies (server.py turns it on)
    task_caps: bool = False  # background tasks get limits.TASK_CAPS (server.py turns it on)
    parallel: int = 1  # --parallel: requests decoding at once (> 1: one forest pass for all, scheduler.py)
    running: int = 0  # requests generating now (admitted; a paused one too)
    submitted: int = 0  # jobs submitted so far (their order)

    def __post_init__(self):
        self.lock = threading.Lock()
        self.taking = threading.Lock()   # one job thread takes from the queue (and announces it) at a time
        self.thread = threading.Thread(target=self._main, name="specx-worker", daemon=True)
        self.session = self.defaults = self.scheduler = None

    def start(self) -> None:
        self.thread.start()

    def queue_depth(self) -> int:
        return max(0, self.pending - self.running)

    def submit(self, job: Job) -> None:
        if self.state != "ready" or self.stopping.is_set():
            raise APIError(503, "the model is still loading; retry shortly" if self.state == "loading" else
                           "the server is shutting down", type="server_error", code="unavailable",
                           headers={"Retry-After": "5"})
        with self.lock:
            if self.pending >= self.max_queue + self.parallel:   # all --parallel busy, max_queue waiting
                wait = max(1, round(self.job_seconds * self.pending))
                raise APIError(429, f"{self.pending - self.parallel} requests are already waiting (--max-queue "
                               f"{self.max_queue}); retry after {wait}s", type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": str(wait)})
            self.pending += 1
            self.submitted += 1
            job.seq = self.submitted
        job.on_cancel = lambda: self._cancel_queued(job)
        self.jobs.put(((not job.interactive, job.seq), job))

    def _cancel_queued(self, job: Job) -> None:
        with self.lock:
            if job.started:
                return   # running: it stops at the next pass boundary
        if self._release(job):
            self.metrics.request(job.endpoint, "cancelled")

    def _end(self, job: Job, event) -> None:
        """The job's last event, sent after its --max-queue slot is free: a client that sends its next
        request the moment this one ends must find the slot given back (no 429 on --max-queue 0)."""
        self._release(job)
        job.emit(event)

    def _release(self, job: Job) -> bool:
        """Give the job's --max-queue slot back (once); True the first time."""
        with self.lock:
            if job.released:
                return False
            job.released, self.pending = True, self.pending - 1
            return True

    def shutdown(self) -> None:
        """Stop the running generation at the next pass boundary and refuse what is queued."""
        self.stopping.set()
        self.jobs.put(STOP)

    # -- the thread ----------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.session, self.defaults = self.load()
        except BaseException as exc:  # noqa: BLE001 - reported by on_failed (one line, exit 2)
            self.state = "failed"
            self.on_failed(exc)
            return
        self.state = "ready"
        self.on_ready()
        from specexec_cli.core.forest import FOREST_METHODS

        threads = 1
        forest = getattr(self.session.models, "target", None) is not None and self._method() in FOREST_METHODS
        if self.parallel > 1 or forest:   # requests decode through one forest (scheduler.py)
            from specexec_cli.serve.scheduler import Scheduler

            self.scheduler = Scheduler(self.session, self.parallel, self.metrics)
            self.scheduler.thread.start()
            # a thread per request the queue admits: each one waits in the scheduler, which admits the
            # streamed ones first and pauses a non-streamed one for them (up to MAX_THREADS waiting)
            threads = self.parallel + min(self.max_queue, MAX_THREADS)
        helpers = [threading.Thread(target=self._jobs, name=f"specx-job-{i}", daemon=True)
                   for i in range(1, threads)]
        for t in helpers:
            t.start()
        self._jobs()
        for t in helpers:
            t.join()
        if self.scheduler is not None:
            self.scheduler.close()
        while not self.jobs.empty():  # refuse whatever queued behind the sentinel
            _, job = self.jobs.get()
            if job is not None:
                self._take(job)   # stopping: a 503

    def _method(self) -> str:
        """The method requests run with: the session's, or ar without a draft (core.methods.generate)."""
        return self.session.cfg.method if getattr(self.session.models, "draft", None) is not None else "ar"

    def _jobs(self) -> None:
        """One job thread, until the shutdown sentinel (passed on). A non-streamed job is announced to
        the scheduler as it is taken (one taker at a time): jobs prepared on other threads cannot overtake it."""
        while True:
            with self.taking:
                _, job = self.jobs.get()
                if job is not None and self.scheduler is not None and not job.interactive:
                    self.scheduler.expect(job.seq)
            if job is None:
                self.jobs.put(STOP)
                break
            try:
                self._take(job)
            finally:
                if self.scheduler is not None:
                    self.scheduler.forget(job.seq)

    def _take(self, job: Job) -> None:
        with self.lock:
            if job.released:   # cancelled while queued: its slot is already free
                return
            job.started = True
        if self.stopping.is_set():
            job.emit(Failed(APIError(503, "the server is shutting down", type="server_error", code="unavailable")))
            self._finished(job, "rejected", 0.0)
            return
        self._serve(job)

    def _finished(self, job: Job, outcome: str, seconds: float) -> None:
        if not self._release(job) and not job.started:
            return   # cancelled while queued: counted when its slot was given back
        with self.lock:
            if seconds:
                self.job_seconds = 0.8 * self.job_seconds + 0.2 * seconds
        self.metrics.request(job.endpoint, outcome)

    def _admitted(self, job: Job) -> None:
        """The job decodes from now on (it waited in the scheduler until here): counted as running."""
        with self.lock:
            job.admitted = True
            self.running += 1

    def _serve(self, job: Job) -> None:
        t0, outcome = time.perf_counter(), "ok"
        try:
            outcome = "cancelled" if job.cancelled.is_set() else self._generate(job)
        except Exception as exc:  # noqa: BLE001 - never a dead worker; OOM is a 400, else a logged 500 by id
            from specexec_cli.serve.guards import server_error

            self._end(job, Failed(exc if isinstance(exc, APIError) else server_error(exc, job.request_id)))
            outcome = "error"
        finally:
            with self.lock:
                self.running -= job.admitted
            self._finished(job, outcome, time.perf_counter() - t0)

    def _prompt(self, work: Work):
        """The prompt's ids and the request's structured.Plan (tools rendered, grammar)."""
        from specexec_cli.serve.structured import plan as plan_of
        from specexec_cli.session.chat import TemplateError
        from specexec_cli.session.prompts import encode_prompt

        session = self.session
        plan = plan_of(work, session.models.tokenizer, session.templated, getattr(session.models, "eos_ids", None))
        if work.messages is not None:
            messages = work.messages
            if session.system and not any(m["role"] == "system" for m in messages):  # specx serve --system
                messages = [{"role": "system", "content": session.system}, *messages]
            try:
                ids = session.conversation_ids(messages, tools=plan.tools) if plan.tools else \
                    session.conversation_ids(messages)
            except TemplateError as exc:
                raise APIError(400, str(exc), param="messages", code="chat_template_error") from None
            param = "messages"
        else:
            ids, param = encode_prompt(session.models.tokenizer, work.prompt, False), "prompt"
        if not ids:
            raise APIError(400, f"{param}: the prompt is empty (no tokens)", param=param)
        limit = session.models.ctx_limit
        if len(ids) + 1 > limit:
            raise APIError(400, f"the prompt is {len(ids)} tokens but the context holds {limit} (--ctx); "
                           "shorten it", param=param, code="context_length_exceeded")
        return ids, plan

    def _check_method(self, work: Work, plan) -> None:
        """A grammar or logprobs on a method that cannot give them: a 400 naming the fix, before the reply."""
        from specexec_cli.core.forest import FOREST_METHODS

        method = self._method()
        if method in FOREST_METHODS or (plan.grammar is None and work.logprobs is None):
            return
        param = "response_format" if work.response_format is not None else \
            "logprobs" if plan.grammar is None else "tool_choice"
        raise APIError(400, f"{param}: structured output, forced tool calls and logprobs need --method specexec or ar "
                       f"(this server runs --method {method}); restart it with --method specexec", param=param,
                       code="structured_output_unsupported")

    def _config(self, work: Work, prompt_tokens: int, plan, limit: int | None):
        import torch

        from specexec_cli.core.stats import RunStats
        from specexec_cli.session.gendefaults import merge
        from specexec_cli.session.options import config_record

        base = self.session.cfg
        seed = work.seed if work.seed is not None else secrets.randbits(63)
        room = self.session.models.ctx_limit - prompt_tokens   # no limit: to EOS or the context end
        limit = limit or room
        extra = {"grammar": plan.grammar} if plan.grammar is not None else {}
        if work.logprobs is not None:
            extra["logprobs"] = work.logprobs
        cfg = replace(base, sampling=merge(self.defaults, work.temperature, work.top_k, work.top_p),
                      max_new_tokens=max(1, limit), seed=seed, **extra)
        gen = torch.Generator().manual_seed(seed % 2**64)
        return cfg, gen, RunStats(config=config_record(cfg))

    def _open(self, job: Job, full: list[int], cfg, gen):
        """(events, tokens to prefill): the session's one state, or a slot of the forest (--parallel)."""
        session = self.session
        if self.scheduler is None:
            self._admitted(job)
            ids = session.prefill_ids(full)
            prefill = len(session.state.ids) + len(ids) - session.state.target_len
            return session.decode(ids, cfg, gen), prefill
        if session.tuner is not None:   # --budget auto: the tuned shape so far (the forest does not re-tune it)
            cfg = replace(cfg, shape=session.tuner.shape)
        stopped = lambda: job.cancelled.is_set() or self.stopping.is_set()  # noqa: E731
        from specexec_cli.serve.scheduler import Withdrawn

        try:
            opened = self.scheduler.open(full, cfg, gen, stopped, interactive=job.interactive, seq=job.seq,
                                         background=task_of(job.work) is not None)
        except Withdrawn:   # never decoded: the server stops (503, as a queued job) or the client left
            if self.stopping.is_set():
                raise APIError(503, "the server is shutting down", type="server_error", code="unavailable") from None
            opened = (ev for ev in ()), 0
        self._admitted(job)
        return opened

    def _generate(self, job: Job) -> str:
        session, work = self.session, job.work
        full, plan = self._prompt(work)
        self._check_method(work, plan)
        limit, task = reply_limit(work, self.max_new_tokens, self.task_caps)
        cfg, gen, stats = self._config(work, len(full), plan, limit)
        guard = RepetitionGuard() if guard_on(work, self.repetition_guard) else None
        answer = TaskAnswer() if task is not None and plan.grammar is None else None
        events, prefill = self._open(job, full, cfg, gen)
        job.emit(Started(prompt_tokens=len(full), cached_tokens=len(full) - prefill, task=task))
        plain = work.messages is not None and not session.templated and not session.code
        stops = (work.stops or list(session.models.stop_strings)) + (PLAIN_STOPS if plain else [])  # request's first
        reply = Reply(session.models.tokenizer, plan.stops(stops), plan.names, plan.forced, work.logprobs, plan.limit)
        finish = "length"
        try:
            for ev in events:
                stats.add(ev)
                piece = reply.feed(ev)
                self._emit(job, piece, stats)
                if reply.stop.stopped:
                    finish = "stop"
                elif ev.finish:
                    finish = FINISH.get(ev.finish, "length")
                elif guard is not None and guard.feed(ev.tokens):   # a loop that no longer ends
                    finish = "stop"
                elif answer is not None and answer.feed(piece.text if piece else "", len(ev.tokens)):
                    finish = "stop"   # a background task's JSON answer is complete, or never began
                elif job.cancelled.is_set():
                    finish = "cancelled"
                elif self.stopping.is_set():
                    finish = "length"
                else:
                    continue
                break
            else:   # the forest took it out before an event said so (scheduler.py: cancelled, stopping)
                finish = "cancelled" if job.cancelled.is_set() else finish
        finally:
            events.close()
        if session.tuner is not None:   # --budget auto: report the shape the tuner ran, not the flag's
            stats.config.update(budget=session.tuner.shape.budget, max_depth=session.tuner.shape.max_depth)
        last, calls = reply.finish()
        self._emit(job, last, stats)
        if calls and finish != "cancelled":
            calls, finish = calls if work.parallel_tool_calls else calls[:1], "tool_calls"
        usage = usage_body(len(full), stats.new_tokens if reply.used is None else reply.used, len(full) - prefill)
        self.metrics.finished(stats, len(full), len(full) - prefill)
        specx = stats.speculative()
        if guard is not None and guard.fired and finish == "stop":
            specx["stopped_by"] = "repetition"
        elif answer is not None and answer.fired and finish == "stop":
            specx["stopped_by"] = answer.fired
        self._end(job, Done("".join(reply.parts), finish, usage, specx, calls, reply.entries))
        return "cancelled" if finish == "cancelled" else "ok"

    @staticmethod
    def _emit(job: Job, piece: Piece | None, stats) -> None:
        if piece is None:
            return
        live = {"tokens_per_pass": round(stats.tokens_per_pass, 3), "target_passes": stats.target_passes,
                "tokens_per_second": round(stats.tokens_per_second, 2) if stats.target_passes else 0.0,
                "completion_tokens": stats.new_tokens}
        if piece.text or piece.logprobs or not piece.tool_calls:
            job.emit(Delta(piece.text, spans(piece.mask), live, piece.logprobs))
        for entry in piece.tool_calls or []:   # each in its own chunk, as OpenAI sends them
            job.emit(Delta("", [], live, None, [entry]))
