"""A time limit on Python code running in the calling thread: the chat template's rendering (the runtime's, and
the build's check of the template; a module of its own so that both layers use it).

A chat template is code from the engine dir (jinja2, compiled to Python by transformers and run in jinja2's
sandbox, which bars file and attribute access but not loops): `{% for i in range(100000) %}` nested twice runs
for hours and grows the rendered text without bound, holding the thread that renders it (a server's prompts lane).
`run_with_deadline` raises `DeadlineExceeded` in that thread once the time is up, by CPython's asynchronous
exception (`PyThreadState_SetAsyncExc`), which the interpreter raises between two bytecodes: a loop in the template
stops within milliseconds of the deadline. One long call into C (a power of huge numbers, a string repeated a
billion times) is not interrupted; the exception is raised when it returns.
"""

from __future__ import annotations

import ctypes
import heapq
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")
CHAT_TEMPLATE_SECONDS = 10.0  # the most one rendering of a chat template may take (a real one takes milliseconds)


class DeadlineExceeded(Exception):
    """The code given to `run_with_deadline` ran past its time and was stopped."""


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Sets (or with None, clears) the exception pending for the thread `thread_id`."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


class _Call:
    """One watched call. Its lock is a plain (C) lock: entering it runs no Python code, so the stop cannot be raised
    in the caller's thread while it holds the lock, which would leave it held."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self.thread_id = deadline, threading.get_ident()
        self.lock = threading.Lock()
        self.finished = self.stopped = False

    def __lt__(self, other: "_Call") -> bool:
        return self.deadline < other.deadline


class _Watchdog:
    """One daemon thread for every deadline (a thread per call cost ~150 us to start): it sleeps until the
    nearest deadline and stops the call it belongs to, if that call is still running."""

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._calls: list[_Call] = []  # a heap by deadline; finished calls stay until their deadline, then go
        self._thread: threading.Thread | None = None

    def watch(self, seconds: float) -> _Call:
        """Starts watching the calling thread until `done`."""
        call = _Call(time.monotonic() + seconds)
        with self._wake:
            heapq.heappush(self._calls, call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trtpaged-deadline", daemon=True)
                self._thread.start()
            if self._calls[0] is call:
                self._wake.notify()
        return call

    @staticmethod
    def done(call: _Call) -> None:
        """`call` returned (or raised): it is not stopped after this, and a stop still pending for its thread is
        cleared, so that it cannot land in the caller (it may land in here, before the lock: see
        `run_with_deadline`). Idempotent."""
        with call.lock:
            call.finished = True
            if call.stopped:
                _raise_in(call.thread_id, None)

    def _run(self) -> None:
        with self._wake:
            while True:
                now = time.monotonic()
                while self._calls and self._calls[0].deadline <= now:
                    call = heapq.heappop(self._calls)
                    with call.lock:
                        if not call.finished:
                            call.stopped = True
                            _raise_in(call.thread_id, DeadlineExceeded)
                self._wake.wait(self._calls[0].deadline - now if self._calls else None)


_WATCHDOG = _Watchdog()


def run_with_deadline(fn: Callable[[], T], seconds: float) -> T:
    """`fn()`'s result, or DeadlineExceeded raised inside `fn` once it has run `seconds`. `fn` must let an
    exception pass through it (as any code does unless it catches `Exception` and goes on looping)."""
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    call = _WATCHDOG.watch(seconds)
    try:
        result = fn()
    except BaseException:
        _WATCHDOG.done(call)
        raise
    while True:  # fn returned: a stop that lands now, before `done` has cleared it, is not the caller's
        try:
            _WATCHDOG.done(call)  # (the watchdog stops a call once, so this runs at most twice)
            return result
        except DeadlineExceeded:
            continue
