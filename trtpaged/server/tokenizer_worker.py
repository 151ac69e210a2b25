"""The server's tokenizer threads: the front end's tokenizer work runs here, never on the engine thread.

While the engine thread tokenizes, no step runs and every stream stalls (a 200 KB prompt: ~0.2 s; a 4 MB
/tokenize body: seconds). So each lane below is a thread that owns its own copy of the engine's tokenizer,
loaded from the engine dir as `LLM` loads it: a fast tokenizer is not to be shared between threads
(transformers' encode sets the Rust tokenizer's truncation and padding when they differ from what it wants,
a mutable borrow that fails with "Already borrowed" while another thread is inside the same tokenizer).
transformers' fast `encode` goes through `tokenizers`' `encode_batch`, which releases the GIL while it
tokenizes (`Tokenizer.encode` does not): the engine thread steps meanwhile.

Four lanes, so that running requests never wait behind a new one's long prompt, nor a new one behind a
/tokenize:
- `prompts`: what a request needs before it can be queued (prompt token ids and chat templates), taken first
  come first served by `PROMPT_THREADS` threads, so that one long text does not hold
  up the short prompts behind it (with one thread, requests that arrived during a long prompt waited for it,
  and the engine, its streams done, sat idle); a short prompt may thus reach the engine before a long one that
  arrived earlier. A long job (more than `LONG_TEXT_CHARS` characters of text: a text that
  `truncate_prompt_tokens` lets in may be the whole 8 MB body, ~10 s and ~1.6 GB of tokenizing) runs on the first
  thread only, so the others are always left to the short ones (six such bodies held both threads, and every new
  request waited 24 s behind them). At most `max_waiting` jobs wait, long and short ones each (long ones waiting
  for the first thread never refuse a short one): beyond that `Overloaded` (a 503);
- `texts`: /tokenize and /detokenize, one thread, at most `max_waiting` waiting: a client's texts to count
  (up to the body limit: an 8 MB /tokenize takes seconds) never hold up a generation request's prompt (two such
  bodies on the prompts lane held every new request for their ~45 s);
- `outputs`: what requests already running need (token strings and bytes of log-probs, echo texts), unbounded,
  one thread;
- `grammars`: compiling a structured-output request's grammar before it is queued (xgrammar's compiler holds the
  vocabulary: these threads load no tokenizer), `GRAMMAR_THREADS` threads, at most `max_waiting` waiting, so
  that a burst of distinct schemas is refused with a 503 instead of queueing without bound.
After a job of more than `TRIM_AFTER_S` the lane's thread hands the C heap's free pages back to the system
(glibc's `malloc_trim`): the tokenizers' Rust code allocates with malloc, and an 8 MB /tokenize left the server's
RSS ~0.8 GB above its start, freed but kept by the allocator, until the process ended (one job's trim: 1062 ->
277 MB in a process that only tokenized).
A job whose awaiting task is cancelled before it begins is skipped: a client that disconnects while its request
waits here is noticed within a poll (`app.unless_disconnected`), which cancels that task.
The engine thread keeps what belongs to the engine: adding requests, its incremental detokenizer (stop
strings), and reading the vocabulary into the grammar compiler once (`GrammarCache.prepare`).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Optional, TypeVar

from trtpaged.server import thread_names
from trtpaged.server.engine_loop import Overloaded, ShuttingDown

T = TypeVar("T")
_STOP = object()
PROMPT_THREADS = 2  # the prompts lane's threads
LONG_TEXT_CHARS = 64 << 10  # a prompt job with more characters of text is long (tens of milliseconds to tokenize)
GRAMMAR_THREADS = 2  # the grammars lane's: a cached grammar is not held up behind one slow compile
TRIM_AFTER_S = 0.25  # a job that ran longer may have grown the heap by hundreds of megabytes


def _malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's malloc_trim, or None (another C library)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def release_free_heap() -> None:
    """Hands the C heap's free pages back to the system (no-op without glibc); ctypes releases the GIL meanwhile."""
    if _TRIM is not None:
        _TRIM(0)


class TokenizerLane:
    """`threads` threads, each with its own tokenizer, taking jobs `fn(tokenizer)` in the order they were sent;
    a job sent as long is taken by the first thread only. `waiting_for` names what the jobs wait for in the
    `Overloaded` message."""

    def __init__(self, name: str, max_waiting: Optional[int] = None, threads: int = 1,
                 waiting_for: str = "to be tokenized") -> None:
        self.name = name
        self.waiting_for = waiting_for
        self.max_waiting = max_waiting
        self.num_threads = threads
        self._jobs: deque[Any] = deque()  # (fn, future, long) in the order sent, then a _STOP per thread
        self._lock = threading.Lock()  # sending a job and stopping: no job is queued behind the stop
        self._sent = threading.Condition(self._lock)
        self._waiting = 0  # jobs sent and not yet taken by the thread
        self._waiting_long = 0  # of which long ones
        self._stopped = False
        self._threads: list[threading.Thread] = []

    def start(self, load: Callable[[], Any]) -> "TokenizerLane":
        """Starts the threads, each of which loads its own tokenizer with `load()`; returns once all loaded, or
        raises what `load` raised (the threads stopped)."""

        def run(loaded: Future, takes_long: bool) -> None:
            thread_names.name_this_thread(thread_names.TOKENIZER)
            try:
                tokenizer = load()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller of start
                loaded.set_exception(exc)
                return
            loaded.set_result(None)
            self._work(tokenizer, takes_long)

        loads: list[Future] = []
        for i in range(self.num_threads):
            loads.append(Future())
            self._threads.append(threading.Thread(target=run, args=(loads[-1], i == 0), name=self.name, daemon=True))
            self._threads[-1].start()
        try:
            for loaded in loads:
                loaded.result()
        except BaseException:
            self.shutdown()
            raise
        return self

    @property
    def num_waiting(self) -> int:
        """Jobs sent and not yet begun."""
        return self._waiting

    def send(self, fn: Callable[[Any], T], long: bool = False) -> "Future[T]":
        """Queues `fn(tokenizer)` (`long`: for the first thread only); raises `Overloaded` when `max_waiting` jobs
        of its kind (long or not) already wait, `ShuttingDown` once stopped."""
        future: Future = Future()
        with self._lock:
            if self._stopped:
                raise ShuttingDown("the server is shutting down")
            waiting = self._waiting_long if long else self._waiting - self._waiting_long
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise Overloaded(f"{waiting} requests are waiting {self.waiting_for} (max_waiting "
                                 f"{self.max_waiting}); retry later")  # fmt: skip
            self._waiting += 1
            self._waiting_long += long
            self._jobs.append((fn, future, long))
            self._sent.notify_all()
        return future

    async def run(self, fn: Callable[[Any], T], long: bool = False) -> T:
        """`fn(tokenizer)` on this lane's thread, awaited without blocking the event loop. A caller cancelled
        while its job waits leaves the job skipped, never run."""
        return await asyncio.wrap_future(self.send(fn, long))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the threads after their current jobs (waiting up to `timeout` s for each); jobs still queued end
        with ShuttingDown."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._jobs.extend(_STOP for _ in self._threads)
            self._sent.notify_all()
        for thread in self._threads:
            thread.join(timeout)

    def _take(self, takes_long: bool) -> Any:
        """The first job this thread may run (a long one only if `takes_long`), or _STOP; waits for one."""
        with self._sent:
            while True:
                for i, job in enumerate(self._jobs):
                    if takes_long or job is _STOP or not job[2]:
                        del self._jobs[i]
                        return job
                self._sent.wait()

    def _work(self, tokenizer: Any, takes_long: bool) -> None:
        while True:
            job = self._take(takes_long)
            if job is _STOP:
                return
            fn, future, long = job
            with self._lock:
                self._waiting -= 1
                self._waiting_long -= long
                stopped = self._stopped
            if not future.set_running_or_notify_cancel():
                continue  # its caller is gone (a client that disconnected): nothing to run or answer
            if stopped:
                future.set_exception(ShuttingDown("the server is shutting down"))
                continue
            start = time.monotonic()
            try:
                future.set_result(fn(tokenizer))
            except Exception as exc:  # noqa: BLE001 - the caller gets the error, the lane lives on
                future.set_exception(exc)
            if time.monotonic() - start > TRIM_AFTER_S:
                release_free_heap()


class TokenizerWorker:
    """The server's front-end lanes (see the module docstring): `prompts`, `outputs` and `grammars`."""

    def __init__(self, prompts: TokenizerLane, texts: TokenizerLane, outputs: TokenizerLane,
                 grammars: TokenizerLane) -> None:
        self.prompts = prompts
        self.texts = texts
        self.outputs = outputs
        self.grammars = grammars

    @property
    def lanes(self) -> tuple[TokenizerLane, ...]:
        return self.prompts, self.texts, self.outputs, self.grammars

    @classmethod
    def start(cls, load: Callable[[], Any], max_waiting: Optional[int] = None) -> "TokenizerWorker":
        """The lanes: `prompts`, `texts` and `outputs` each with its own tokenizer from `load()` (loaded on its
        own thread), `grammars` with none."""
        prompts = TokenizerLane("trtpaged-tokenizer-prompts", max_waiting, PROMPT_THREADS)
        texts = TokenizerLane("trtpaged-tokenizer-texts", max_waiting)
        outputs = TokenizerLane("trtpaged-tokenizer-outputs")  # one thread: GenerationService keeps one bytes reader
        grammars = TokenizerLane("trtpaged-grammars", max_waiting, GRAMMAR_THREADS, "for their grammar to compile")
        started: list[TokenizerLane] = []
        try:
            for lane, lane_load in ((prompts, load), (texts, load), (outputs, load), (grammars, lambda: None)):
                started.append(lane.start(lane_load))
        except BaseException:
            for lane in started:
                lane.shutdown()
            raise
        return cls(prompts, texts, outputs, grammars)

    async def prompt(self, fn: Callable[[Any], T], long: bool = False) -> T:
        """`fn(tokenizer)` for a request not yet queued (`long`: more than `LONG_TEXT_CHARS` characters of text); raises
        `Overloaded` when the lane is full."""
        return await self.prompts.run(fn, long)

    async def text(self, fn: Callable[[Any], T]) -> T:
        """`fn(tokenizer)` for /tokenize or /detokenize; raises `Overloaded` when the lane is full."""
        return await self.texts.run(fn)

    async def output(self, fn: Callable[[Any], T]) -> T:
        """`fn(tokenizer)` for a request already running."""
        return await self.outputs.run(fn)

    async def grammar(self, fn: Callable[[], T]) -> T:
        """`fn()` (a grammar compile) for a request not yet queued; raises `Overloaded` when the lane is full."""
        return await self.grammars.run(lambda _: fn())

    def shutdown(self, timeout: float = 10.0) -> None:
        for lane in self.lanes:
            lane.shutdown(timeout)
