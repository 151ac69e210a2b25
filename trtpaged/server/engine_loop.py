"""The engine thread: the one owner of an `LLMEngine`. HTTP threads reach it only through queues."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.outputs import RequestOutput
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.server.metrics import ServerMetrics

log = logging.getLogger("trtpaged.server")
T = TypeVar("T")


class EngineFailure(RuntimeError):
    """The engine raised during a step (or is shutting down); the requests in flight end with it."""


class ClientGone(Exception):
    """The HTTP client closed its connection before its request finished."""


@dataclass
class _Timing:
    arrival: float
    prompt_tokens: int = 0
    first_token: Optional[float] = None


@dataclass
class Subscription:
    """Outputs of one HTTP request's engine requests, in the order the engine produced them."""

    request_ids: list[str]
    loop: "EngineLoop"
    queue: "queue.Queue[Any]" = field(default_factory=queue.Queue)

    def outputs(self, disconnected: Callable[[], bool], poll_s: float = 0.25) -> Iterator[RequestOutput]:
        """Yields RequestOutput snapshots until every request finished. Raises ClientGone when
        `disconnected()` turns true, EngineFailure when the engine failed; leaving early aborts the rest."""
        pending = set(self.request_ids)
        next_check = time.monotonic() + poll_s
        try:
            while pending:
                try:
                    item = self.queue.get(timeout=poll_s)
                except queue.Empty:
                    item = None
                if time.monotonic() >= next_check:  # outputs may arrive every step: check on a clock
                    next_check = time.monotonic() + poll_s
                    if disconnected():
                        raise ClientGone()
                    if not self.loop.alive and item is None:
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


class EngineLoop:
    """Runs `engine.step()` on a background thread while there is work.

    Commands (submit, abort, call) are drained between steps, so requests that
    arrive while others run join the next step: continuous batching across
    HTTP requests. Everything that touches the engine or its tokenizer runs on
    this thread.
    """

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: "queue.Queue[tuple[str, Any, Optional[Future]]]" = queue.Queue()
        self._subs: dict[str, Subscription] = {}
        self._timing: dict[str, _Timing] = {}
        self._thread = threading.Thread(target=self._run, name="trtpaged-engine", daemon=True)
        self._stopped = threading.Event()

    # ---- called from HTTP threads -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs `fn(engine)` on the engine thread between steps and returns its result (or raises its error)."""
        return self._wait(self._send("call", fn))

    def submit(self, requests: Sequence[tuple[str, list[int], SamplingParams]]) -> Subscription:
        """Adds (request_id, prompt token ids, params) all or none; raises add_request's ValueError."""
        sub = Subscription([rid for rid, _, _ in requests], self)
        self._wait(self._send("submit", (list(requests), sub, time.monotonic())))
        return sub

    def abort(self, request_ids: Sequence[str]) -> None:
        """Aborts requests (fire and forget): their blocks return to the pool before the next step."""
        self._commands.put(("abort", list(request_ids), None))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the thread after the current step; requests in flight end with EngineFailure."""
        self._commands.put(("stop", None, None))
        self._thread.join(timeout)

    def _send(self, kind: str, payload: Any) -> Future:
        if not self.alive:
            raise EngineFailure("the engine loop is not running")
        future: Future = Future()
        self._commands.put((kind, payload, future))
        return future

    def _wait(self, future: Future) -> Any:
        while True:
            try:
                return future.result(timeout=0.5)
            except FutureTimeout:
                if not self._thread.is_alive():
                    raise EngineFailure("the engine loop stopped") from None

    # ---- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if not self._stopped.is_set() and self.engine.has_unfinished():
                    self._step()
        finally:
            self._stopped.set()
            self._fail_all(EngineFailure("the server is shutting down"))
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
        if future is not None and self._stopped.is_set():
            future.set_exception(EngineFailure("the server is shutting down"))
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

    def _add(self, requests: list[tuple[str, list[int], SamplingParams]], sub: Subscription, arrival: float) -> None:
        added: list[str] = []
        try:
            for rid, prompt, params in requests:
                self.engine.add_request(prompt, params, rid)
                added.append(rid)
                self._subs[rid] = sub
                self._timing[rid] = _Timing(arrival, len(prompt))
        except Exception:
            for rid in added:
                self.engine.abort(rid)
                self._forget(rid)
            raise

    def _abort(self, rid: str) -> None:
        if self.engine.abort(rid):
            timing = self._timing.get(rid)
            if timing is not None:
                self.metrics.observe_finished("abort", timing.prompt_tokens, 0, time.monotonic() - timing.arrival, None)
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        self._subs.pop(rid, None)
        self._timing.pop(rid, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
            log.exception("engine step failed; ending the %d requests in flight", len(self._subs))
            self._fail_all(EngineFailure(f"engine step failed: {type(exc).__name__}: {exc}"))
            return
        now = time.monotonic()
        for out in outputs:
            sub = self._subs.get(out.request_id)
            if sub is None:
                continue
            self._observe(out, now)
            sub.queue.put(out)
            if out.finished:
                self._forget(out.request_id)

    def _observe(self, out: RequestOutput, now: float) -> None:
        timing = self._timing[out.request_id]
        num_tokens = [len(c.token_ids) for c in out.outputs]
        if timing.first_token is None and any(num_tokens):
            timing.first_token = now
            self.metrics.observe_first_token(now - timing.arrival)
        if out.finished:
            longest = max(num_tokens, default=0)
            tpot = (now - timing.first_token) / (longest - 1) if timing.first_token and longest > 1 else None
            reason = out.outputs[0].finish_reason if out.outputs else "length"
            self.metrics.observe_finished(reason or "length", timing.prompt_tokens, sum(num_tokens), now - timing.arrival, tpot)

    def _fail_all(self, error: EngineFailure) -> None:
        for rid, sub in list(self._subs.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - state may be inconsistent after a failed step
                log.exception("abort of %s failed", rid)
            self.metrics.observe_finished("error", self._timing[rid].prompt_tokens, 0, 0.0, None)
            sub.queue.put(error)
            self._forget(rid)
