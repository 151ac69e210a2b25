"""The engine thread: the one owner of an `LLMEngine`. Request handlers reach it only through queues.

Handlers run on the asyncio event loop; they send commands (submit, abort, call) to
this thread and await the results, and receive outputs on an `asyncio.Queue` fed
with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence, TypeVar

from trtpaged.errors import FatalEngineError
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.outputs import RequestOutput
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.server.metrics import RequestPhases, ServerMetrics
from trtpaged.server import thread_names
from trtpaged.server.request_log import RequestLog

log = logging.getLogger("trtpaged.server")
T = TypeVar("T")


class EngineFailure(RuntimeError):
    """The engine raised during a step; the requests in flight end with it."""


class RequestFailure(EngineFailure):
    """The request's own settings stopped it inside a step (e.g. token filters that allow no token): a 400."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class ShuttingDown(RuntimeError):
    """The server is stopping: new requests are refused, and those still running at the deadline end with it."""


class Overloaded(RuntimeError):
    """The waiting queue is full (`max_waiting`): the request is refused before it is queued."""


class ClientGone(Exception):
    """The HTTP client closed its connection before its request finished."""


class RequestTimeout(Exception):
    """The request ran longer than the server's per-request timeout; it was aborted."""


@dataclass
class _Timing:
    arrival: float
    prompt_tokens: int = 0
    first_token: Optional[float] = None
    by_index: dict[int, int] = field(default_factory=dict)  # completion index -> its tokens so far
    reasons: dict[int, str] = field(default_factory=dict)  # completion index -> its finish reason, once it ended
    params: Optional[SamplingParams] = None
    step: int = 0  # engine steps run before the request was added
    scored_only: bool = False  # echo with max_tokens 0: the token sampled to score the prompt is dropped, not output
    prompt: Sequence[int] = ()  # the prompt's token ids (the request log's)
    group: Any = None  # the engine's SequenceGroup: its `times` (queued, first scheduled, first token), cache hit
    first_by_index: dict[int, float] = field(default_factory=dict)  # completion index -> when its first token came
    # completion index -> when its last token came and the engine's step count then
    last_by_index: dict[int, tuple[float, int]] = field(default_factory=dict)
    counted: set[int] = field(default_factory=set)  # completions whose end the metrics counted

    def generated(self) -> int:
        """Tokens generated so far, all completions together (what the client gets: none when scored_only)."""
        return 0 if self.scored_only else sum(self.by_index.values())

    def indices(self) -> list[int]:
        """Every completion's index, those that made no token (yet, or before an abort) too."""
        n = self.params.n if self.params is not None else 1
        return sorted(set(range(n)) | set(self.by_index))

    @property
    def cached_tokens(self) -> Optional[int]:
        """Prompt tokens the prefix cache held (None: never scheduled)."""
        return self.group.num_cached_tokens if self.group is not None else None


def _phases(timing: _Timing, last_token: Optional[float]) -> RequestPhases:
    """vLLM's request phases (vllm/v1/metrics/stats.py) from the engine's times of the request: queued until first
    scheduled, prefill until the first token, decode from it to `last_token` (None: the sample made none)."""
    times = timing.group.times if timing.group is not None else {}
    scheduled, first = times.get("scheduled"), times.get("first_token")
    queue = scheduled - times["queued"] if scheduled is not None and "queued" in times else None
    prefill = first - scheduled if first is not None and scheduled is not None else None
    decode = last_token - first if last_token is not None and first is not None else None
    inference = last_token - scheduled if last_token is not None and scheduled is not None else None
    return RequestPhases(queue, prefill, decode, inference)


class Subscription:
    """Outputs of one HTTP request's engine requests, in the order the engine produced them.

    The engine thread hands items over with `_put_all` (one event-loop wake-up per step for all
    subscriptions); a reader waits on one future, with a timer for its periodic checks, instead of
    `asyncio.wait_for`, which made a task, a future and a timer for every wait, i.e. every token.
    """

    def __init__(self, request_ids: list[str], loop: "EngineLoop", aio: asyncio.AbstractEventLoop) -> None:
        self.request_ids = request_ids
        self.loop = loop
        self.aio = aio
        self._items: deque[Any] = deque()
        self._waiter: Optional[asyncio.Future] = None

    def put(self, item: Any) -> None:
        """Called on the engine thread."""
        try:
            self.aio.call_soon_threadsafe(self._push, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _push(self, item: Any) -> None:
        """Called on the event loop."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _next(self, timeout_s: float) -> Any:
        """The next item, or None after `timeout_s` without one."""
        if not self._items:
            waiter = self._waiter = self.aio.create_future()
            timer = self.aio.call_later(timeout_s, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self._items:
                return None
        return self._items.popleft()

    async def outputs(
        self, disconnected: Callable[[], Awaitable[bool]], timeout_s: Optional[float] = None, poll_s: float = 0.25
    ) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutput snapshots until every request finished. Raises ClientGone when `disconnected()`
        turns true, RequestTimeout after `timeout_s`, and the engine's error when it failed; leaving early
        (an error, or the caller closing the generator) aborts what is left."""
        pending = set(self.request_ids)
        start = time.monotonic()
        next_check = start + poll_s
        deadline = start + timeout_s if timeout_s is not None else math.inf
        try:
            while pending:
                # a wait ends at the deadline, not at the next poll after it (was up to a poll late); outputs
                # already here are handed over first
                if not self._items and time.monotonic() > deadline:
                    raise RequestTimeout()
                item = await self._next(max(0.0, min(poll_s, deadline - time.monotonic())))
                now = time.monotonic()
                if now >= next_check:  # outputs may arrive every step: check on a clock
                    next_check = now + poll_s
                    if await disconnected():
                        raise ClientGone()
                    if item is None and not self.loop.alive:
                        raise EngineFailure("the engine loop stopped")
                if item is None:
                    continue
                if isinstance(item, BaseException):
                    pending.clear()  # the loop already ended them
                    raise item
                if item.finished:
                    pending.discard(item.request_id)
                yield item
        finally:
            if pending:
                self.loop.abort(sorted(pending))


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


# How long the engine thread waits, after handing a step's outputs over, for the event loop to run the readers
# they woke (`EngineLoop._wait_flushed`).
FLUSH_WAIT_S = 0.002


def _deliver(items: Sequence[tuple[Subscription, Any]]) -> list[threading.Event]:
    """Hands a step's outputs to their subscriptions: one wake-up of each event loop per step, not one per
    output. Returns an event per loop, set once that loop has run the readers the outputs woke."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Subscription, Any]]] = {}
    for sub, item in items:
        by_loop.setdefault(sub.aio, []).append((sub, item))
    flushed: list[threading.Event] = []
    for aio, batch in by_loop.items():
        done = threading.Event()
        try:
            aio.call_soon_threadsafe(_put_all, batch, done)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            continue
        flushed.append(done)
    return flushed


def _put_all(batch: Sequence[tuple[Subscription, Any]], done: threading.Event) -> None:
    for sub, item in batch:
        sub._push(item)
    asyncio.get_running_loop().call_soon(done.set)  # in the loop's next pass, after the readers just woken


class EngineLoop:
    """Runs `engine.step()` on a background thread while there is work.

    Commands are drained between steps, so requests that arrive while others run
    join the next step: continuous batching across HTTP requests. Everything that
    touches the engine or its tokenizer runs on this thread. `max_waiting` bounds the
    engine's waiting queue: a submit that would exceed it raises `Overloaded`.
    """

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting: Optional[int] = None,
                 request_log: Optional[RequestLog] = None) -> None:  # fmt: skip
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.request_log = request_log
        self._commands: "queue.Queue[tuple[str, Any, Optional[Future]]]" = queue.Queue()
        self._subs: dict[str, Subscription] = {}
        self._timing: dict[str, _Timing] = {}
        self._thread = threading.Thread(target=self._run, name="trtpaged-engine", daemon=True)
        self._stopped = threading.Event()
        self.fatal: Optional[str] = None  # why the engine cannot go on (FatalEngineError), once it happened
        self.flush_wait_s = FLUSH_WAIT_S
        self._flushing: list[threading.Event] = []  # the last step's hand-overs (see _wait_flushed)
        self.after_step: Optional[Callable[[], None]] = None  # run on this thread after each step (WorkerPins)

    @classmethod
    def start_loaded(cls, load: Callable[[], T], engine_of: Callable[[T], LLMEngine], metrics: ServerMetrics,
                     max_waiting: Optional[int] = None, request_log: Optional[RequestLog] = None,
                     ) -> tuple[T, "EngineLoop"]:  # fmt: skip
        """Runs `load()` on a new thread, then the loop on that same thread; returns (what load made, the loop)
        once loaded, or raises what `load` raised.

        The thread that steps the engine should be the only one that ever ran an OpenMP parallel region:
        libgomp counts the threads of every thread's pool, idle ones included, and once they outnumber the
        cores it cuts every barrier's spin to its "throttled" count (100 rounds with GOMP_SPINCOUNT set and
        OMP_WAIT_POLICY unset) before sleeping. Loading the weights on the main thread gave it a pool of
        its own, and the engine thread's workers slept at almost every barrier of a decode step (~420
        voluntary context switches a step instead of ~225 on a loaded 2-core machine).
        """
        loaded: Future = Future()

        def run() -> None:
            thread_names.name_this_thread(thread_names.ENGINE)  # before load: its OpenMP workers get the name
            try:
                made = load()
                loop = cls(engine_of(made), metrics, max_waiting, request_log)
                loop._thread = threading.current_thread()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller of start_loaded
                loaded.set_exception(exc)
                return
            loaded.set_result((made, loop))
            loop._run()

        threading.Thread(target=run, name="trtpaged-engine", daemon=True).start()
        return loaded.result()

    # ---- called from other threads ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    @property
    def thread_id(self) -> int:
        """The OS id of the thread that steps the engine (its OpenMP workers are the threads it started)."""
        return self._thread.native_id or 0

    @property
    def num_in_flight(self) -> int:
        """Engine requests submitted and not yet finished or aborted."""
        return len(self._subs)

    def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs `fn(engine)` on the engine thread between steps and returns its result (blocking)."""
        return self._send("call", fn).result()

    async def call_async(self, fn: Callable[[LLMEngine], T]) -> T:
        """`call` for the event loop: awaits the result without blocking other requests."""
        return await asyncio.wrap_future(self._send("call", fn))

    async def submit(self, requests: Sequence[tuple[str, list[int], SamplingParams]],
                     scored_only: bool = False, priority: int = 0,
                     starts_in_reasoning: Optional[bool] = None) -> Subscription:  # fmt: skip
        """Adds (request_id, prompt token ids, params) all or none, each with `priority` (and add_request's
        `starts_in_reasoning`); raises add_request's ValueError or Overloaded. `scored_only`: the requests only score
        their prompts (echo, max_tokens 0), and the one token each samples is dropped: the metrics count no output
        for them."""
        sub = Subscription([rid for rid, _, _ in requests], self, asyncio.get_running_loop())
        try:
            await asyncio.wrap_future(self._send("submit", (list(requests), sub, time.monotonic(), scored_only,
                                                            priority, starts_in_reasoning)))  # fmt: skip
        except asyncio.CancelledError:  # the caller is gone; if the engine thread had begun adding them, end them
            self.abort(sub.request_ids)
            raise
        return sub

    def abort(self, request_ids: Sequence[str]) -> None:
        """Aborts requests (fire and forget): their blocks return to the pool before the next step."""
        self._commands.put(("abort", list(request_ids), None))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the thread after the current step; requests in flight end with ShuttingDown."""
        self._commands.put(("stop", None, None))
        self._thread.join(timeout)

    def _send(self, kind: str, payload: Any) -> Future:
        if not self.alive:
            raise ShuttingDown("the engine loop is not running")
        future: Future = Future()
        self._commands.put((kind, payload, future))
        return future

    # ---- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if not self._stopped.is_set() and self.engine.has_unfinished():
                    self._step()
        finally:
            self._stopped.set()
            self._fail_all(ShuttingDown("the server is shutting down"), "abort")
            self._drain(block=False)  # answer callers still waiting on a future

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, kind: str, payload: Any, future: Optional[Future]) -> None:
        if future is not None and not future.set_running_or_notify_cancel():
            return  # its caller is gone (a cancelled await: a client that disconnected): nothing to run or answer
        if future is not None and self._stopped.is_set():
            future.set_exception(ShuttingDown("the server is shutting down"))
            return
        try:
            if kind == "call":
                future.set_result(payload(self.engine))  # type: ignore[union-attr]
            elif kind == "submit":
                self._add(*payload)
                future.set_result(None)  # type: ignore[union-attr]
            elif kind == "abort":
                for rid in payload:
                    self._abort(rid)
            elif kind == "stop":
                self._stopped.set()
        except Exception as exc:  # noqa: BLE001 - the caller gets the error, the loop lives on
            if future is not None:
                future.set_exception(exc)

    def _add(self, requests: list[tuple[str, list[int], SamplingParams]], sub: Subscription, arrival: float,
             scored_only: bool = False, priority: int = 0, starts_in_reasoning: Optional[bool] = None) -> None:
        if self.max_waiting is not None:
            # the batch's free places are taken at the next step: requests that fill them do not wait (was: a
            # burst to an idle server counted every request as waiting, and refused the ones beyond max_waiting)
            scheduler = self.engine.scheduler
            waiting = len(scheduler.waiting)
            placed = sum(len(group.seqs) for queue in (scheduler.running, scheduler.swapped) for group in queue)
            free = max(0, self.engine.config.max_batch_size - placed)
            if waiting + len(requests) > self.max_waiting + free:
                raise Overloaded(f"{waiting} requests are waiting (max_waiting {self.max_waiting}); retry later")
        added: list[str] = []
        try:
            for rid, prompt, params in requests:
                self.engine.add_request(prompt, params, rid, arrival_time=arrival, priority=priority,
                                        starts_in_reasoning=starts_in_reasoning)  # fmt: skip
                added.append(rid)
                self._subs[rid] = sub
                self._timing[rid] = _Timing(arrival, len(prompt), params=params, step=self.engine.num_steps,
                                            scored_only=scored_only, prompt=prompt,
                                            group=self.engine.groups.get(rid))  # fmt: skip
        except Exception:
            for rid in added:
                self.engine.abort(rid)
                self._forget(rid)
            raise

    def _abort(self, rid: str) -> None:
        if self.engine.abort(rid):
            timing = self._timing.get(rid)
            if timing is not None:
                self._ended_early(timing, "abort")
        self._forget(rid)

    def _ended_early(self, timing: _Timing, reason: str) -> None:
        """Metrics and the log line of a request ended before it finished (reason: abort or error)."""
        now = time.monotonic()
        self._observe_ended(timing, now, reason)
        if self.request_log is not None:
            self._log_finished(self.request_log, timing, now, reason)

    def _forget(self, rid: str) -> None:
        self._subs.pop(rid, None)
        self._timing.pop(rid, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except FatalEngineError as exc:  # no step can run any more: fail what is in flight and stop the loop
            log.error("engine failed: %s; ending the %d requests in flight", exc, len(self._subs))
            self.fatal = str(exc)
            self._fail_all(EngineFailure("the engine failed; see the server log"), "error")
            self._stopped.set()
            return
        except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
            log.exception("engine step failed; ending the %d requests in flight", len(self._subs))
            self._fail_all(EngineFailure(f"engine step failed ({type(exc).__name__}); see the server log"), "error")
            return
        if self.after_step is not None:
            self.after_step()
        now = time.monotonic()
        mine = [(sub, out) for out in outputs if (sub := self._subs.get(out.request_id)) is not None]
        # every output is counted before any is failed: a failure ends its HTTP request's other engine requests, and
        # one that finished in this same step (its output after the failed one's) went uncounted and unlogged
        for _, out in mine:
            self._observe(out, now)
        delivered: list[tuple[Subscription, RequestOutput]] = []
        for sub, out in mine:
            if self._subs.get(out.request_id) is not sub:
                continue  # ended with a failure of another prompt of its HTTP request
            if out.error is not None:  # this request alone failed in the step; the others go on
                self._fail_request(out.request_id, sub, out.error, out.error_field)
                continue
            delivered.append((sub, out))
            if out.finished:
                self._forget(out.request_id)
        self._wait_flushed(_deliver(delivered))

    def _wait_flushed(self, flushed: list[threading.Event]) -> None:
        """Waits up to `flush_wait_s` until the event loops have run the readers this step's outputs woke.

        The readers' Python (SSE chunks, socket writes) needs the GIL. Without the wait they took it at the
        engine's first release in the next step's serial Python (a torch call) and the engine waited for all of
        it there, and longer when the client woken by a write preempted the event loop's thread on its core while
        that thread held the GIL. Waiting here, the engine holds no GIL and its OpenMP workers are idle: the
        readers run at once, and the clients they wake parse on the idle core while the engine goes on with
        its serial work (docs/benchmarks.md, round 22). A loop still behind from an earlier step (busy with
        something else) is not waited on again until it caught up, so it delays one step, not every step."""
        if not flushed:
            return
        behind = any(not done.is_set() for done in self._flushing)
        self._flushing = flushed  # a loop runs its callbacks in order: these set means the earlier ones are
        if behind:
            return
        start = time.monotonic()
        for done in flushed:
            if not done.wait(max(0.0, start + self.flush_wait_s - time.monotonic())):
                break
        self.metrics.observe_handoff_wait(time.monotonic() - start)

    def _fail_request(self, rid: str, sub: Subscription, reason: str, field: Optional[str] = None) -> None:
        """Ends an HTTP request whose engine request `rid` failed (already finished and freed by the
        engine): its client gets a 500 or an error event, its other prompts' engine requests are aborted."""
        self._forget(rid)
        for other in sub.request_ids:
            if self._subs.get(other) is sub:
                self._abort(other)
        sub.put(RequestFailure(reason, field) if field
                else EngineFailure(f"the request failed in the engine: {reason}"))

    def _observe(self, out: RequestOutput, now: float) -> None:
        """Token timing metrics from one DELTA output (the server asks every request for DELTA outputs)."""
        timing = self._timing[out.request_id]
        made = 0
        for c in out.outputs:
            timing.by_index[c.index] = timing.by_index.get(c.index, 0) + len(c.token_ids)
            made += len(c.token_ids)
            if c.finish_reason:
                timing.reasons[c.index] = c.finish_reason
            if c.token_ids and not timing.scored_only:
                self._observe_sample_tokens(timing, c.index, len(c.token_ids), now)
        if made and not timing.scored_only:
            self.metrics.observe_generated(made)  # as they come, as vLLM counts them each step
            if timing.first_token is None:
                timing.first_token = now
        for c in out.outputs:
            if c.finish_reason and c.index not in timing.counted:
                self._observe_sample_end(timing, c.index, now, c.finish_reason)
        if out.finished:
            self._observe_ended(timing, now, "length")
            if self.request_log is not None:
                self._log_finished(self.request_log, timing, now)

    def _observe_sample_tokens(self, timing: _Timing, index: int, tokens: int, now: float) -> None:
        """A completion's new tokens: its first token's time and its prompt (vLLM times each sample's, an engine
        request of its own), or its inter-token gaps: tokens held back for one output (stream_interval) came from
        several steps, one gap per step that made a token, of their mean, as vLLM times each engine request's
        outputs (a step that makes several tokens, speculation's, is one gap; steps it sat out are none)."""
        last = timing.last_by_index.get(index)
        if last is None:
            timing.first_by_index[index] = now
            self.metrics.observe_first_token(now - timing.arrival, timing.prompt_tokens)
        else:
            gaps = max(1, min(tokens, self.engine.num_steps - last[1]))
            for _ in range(gaps):
                self.metrics.observe_token_gap((now - last[0]) / gaps)
        timing.last_by_index[index] = (now, self.engine.num_steps)

    def _observe_ended(self, timing: _Timing, now: float, ended: str) -> None:
        """Counts the end of a request's completions not counted yet (`ended`: the finish reason of those that have
        none: still running at an abort), then the request's own series."""
        for index in timing.indices():
            if index not in timing.counted:
                self._observe_sample_end(timing, index, now, timing.reasons.get(index) or ended)
        longest = 0 if timing.scored_only else max(timing.by_index.values(), default=0)
        self.metrics.observe_request(timing.params.n if timing.params is not None else 1, longest)

    def _observe_sample_end(self, timing: _Timing, index: int, now: float, reason: str) -> None:
        """One completion ended: vLLM v1 runs each of a request's n samples as an engine request of its own and counts
        each one's end, with its own finish reason (vllm/v1/engine/output_processor.py, _update_stats_from_finished)."""
        timing.counted.add(index)
        tokens = 0 if timing.scored_only else timing.by_index.get(index, 0)
        first = timing.first_by_index.get(index)
        if first is None:
            self.metrics.observe_prompt_without_token(timing.prompt_tokens)
        # no time per output token when every token came in one output (a beam search's answer): 0 s was wrong
        tpot = (now - first) / (tokens - 1) if first is not None and now > first and tokens > 1 else None
        if timing.scored_only:
            reason = "length"
        params = timing.params
        self.metrics.observe_finished(reason, timing.prompt_tokens, tokens, now - timing.arrival, tpot,
                                      _phases(timing, now if first is not None else None),
                                      params.max_tokens if params is not None else None)  # fmt: skip

    def _log_finished(self, request_log: RequestLog, timing: _Timing, now: float, ended: str = "length") -> None:
        """The request's log line; `ended`: the finish reason of its completions that have none (still running
        when it was aborted, or a last output without one)."""
        engine, params = self.engine, timing.params or SamplingParams()
        step_s = sum(engine.phase_seconds.values()) / engine.num_steps if engine.num_steps else None
        ttft = timing.first_token - timing.arrival if timing.first_token is not None else None
        # every completion, those that made no token before an abort too (diagnose checks there are n); a scored
        # prompt's one sampled token is dropped, as in its answer and the metrics
        indices = timing.indices()
        made = {} if timing.scored_only else timing.by_index
        reasons = {} if timing.scored_only else timing.reasons
        request_log.record_finished(timing.prompt, timing.cached_tokens,
                                    output_lens=[made.get(i, 0) for i in indices],
                                    finish_reasons=[reasons.get(i) or ended for i in indices],
                                    arrival_s=timing.arrival - request_log.started, ttft_s=ttft,
                                    latency_s=now - timing.arrival, n=params.n, beam_width=params.beam_width,
                                    steps=engine.num_steps - timing.step, step_time_s=step_s)  # fmt: skip

    def _fail_all(self, error: Exception, reason: str) -> None:
        for rid, sub in list(self._subs.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - state may be inconsistent after a failed step
                log.exception("abort of %s failed", rid)
            self._ended_early(self._timing[rid], reason)
            sub.put(error)
            self._forget(rid)
