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
  arrived earlier. At most `max_waiting` jobs wait: beyond that `Overloaded` (a 503);
- `texts`: /tokenize and /detokenize, one thread, at most `max_waiting` waiting: a client's texts to count
  (up to the body limit: an 8 MB /tokenize takes seconds) never hold up a generation request's prompt (two such
  bodies on the prompts lane held every new request for their ~45 s);
- `outputs`: what requests already running need (token strings and bytes of log-probs, echo texts), unbounded,
  one thread;
- `grammars`: compiling a structured-output request's grammar before it is queued (xgrammar's compiler holds the
  vocabulary: these threads load no tokenizer), `GRAMMAR_THREADS` threads, at most `max_waiting` waiting, so
  that a burst of distinct schemas is refused with a 503 instead of queueing without bound.
A job whose awaiting task is cancelled before it begins is skipped: a client that disconnects while its request
waits here is noticed within a poll (`app.unless_disconnected`), which cancels that task.
The engine thread keeps what belongs to the engine: adding requests, its incremental detokenizer (stop
strings), and reading the vocabulary into the grammar compiler once (`GrammarCache.prepare`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, TypeVar

from trtpaged.server import thread_names
from trtpaged.server.engine_loop import Overloaded, ShuttingDown

T = TypeVar("T")
_STOP = object()
PROMPT_THREADS = 2  # the prompts lane's threads
GRAMMAR_THREADS = 2  # the grammars lane's: a cached grammar is not held up behind one slow compile


class TokenizerLane:
    """`threads` threads, each with its own tokenizer, taking jobs `fn(tokenizer)` in the order they were sent.
    `waiting_for` names what the jobs wait for in the `Overloaded` message."""

    def __init__(self, name: str, max_waiting: Optional[int] = None, threads: int = 1,
                 waiting_for: str = "to be tokenized") -> None:
        self.name = name
        self.waiting_for = waiting_for
        self.max_waiting = max_waiting
        self.num_threads = threads
        self._jobs: "queue.Queue[Any]" = queue.Queue()
        self._lock = threading.Lock()  # sending a job and stopping: no job is queued behind the stop
        self._waiting = 0  # jobs sent and not yet taken by the thread
        self._stopped = False
        self._threads: list[threading.Thread] = []

    def start(self, load: Callable[[], Any]) -> "TokenizerLane":
        """Starts the threads, each of which loads its own tokenizer with `load()`; returns once all loaded, or
        raises what `load` raised (the threads stopped)."""

        def run(loaded: Future) -> None:
            thread_names.name_this_thread(thread_names.TOKENIZER)
            try:
                tokenizer = load()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller of start
                loaded.set_exception(exc)
                return
            loaded.set_result(None)
            self._work(tokenizer)

        loads: list[Future] = []
        for _ in range(self.num_threads):
            loads.append(Future())
            self._threads.append(threading.Thread(target=run, args=(loads[-1],), name=self.name, daemon=True))
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

    def send(self, fn: Callable[[Any], T]) -> "Future[T]":
        """Queues `fn(tokenizer)`; raises `Overloaded` when `max_waiting` jobs already wait, `ShuttingDown`
        once stopped."""
        future: Future = Future()
        with self._lock:
            if self._stopped:
                raise ShuttingDown("the server is shutting down")
            if self.max_waiting is not None and self._waiting >= self.max_waiting:
                raise Overloaded(f"{self._waiting} requests are waiting {self.waiting_for} (max_waiting "
                                 f"{self.max_waiting}); retry later")  # fmt: skip
            self._waiting += 1
            self._jobs.put((fn, future))
        return future

    async def run(self, fn: Callable[[Any], T]) -> T:
        """`fn(tokenizer)` on this lane's thread, awaited without blocking the event loop. A caller cancelled
        while its job waits leaves the job skipped, never run."""
        return await asyncio.wrap_future(self.send(fn))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the threads after their current jobs (waiting up to `timeout` s for each); jobs still queued end
        with ShuttingDown."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            for _ in self._threads:
                self._jobs.put(_STOP)
        for thread in self._threads:
            thread.join(timeout)

    def _work(self, tokenizer: Any) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, future = job
            with self._lock:
                self._waiting -= 1
                stopped = self._stopped
            if not future.set_running_or_notify_cancel():
                continue  # its caller is gone (a client that disconnected): nothing to run or answer
            if stopped:
                future.set_exception(ShuttingDown("the server is shutting down"))
                continue
            try:
                future.set_result(fn(tokenizer))
            except Exception as exc:  # noqa: BLE001 - the caller gets the error, the lane lives on
                future.set_exception(exc)


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

    async def prompt(self, fn: Callable[[Any], T]) -> T:
        """`fn(tokenizer)` for a request not yet queued; raises `Overloaded` when the lane is full."""
        return await self.prompts.run(fn)

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
