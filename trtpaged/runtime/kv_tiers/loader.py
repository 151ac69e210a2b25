"""Tier reads for waiting sequences on a background thread, so that the step loop never waits on one.

The scheduler asks for a waiting sequence's blocks after the pool's run (`TierLoader.submit`); a
loader thread looks them up in order, top tier first, until the first block no tier has, and keeps
the verified entries with the load (staging in host memory). The scheduler admits the sequence once
its load is `done` and copies the staged bytes into the blocks it allocates then. A load that is not
done by its deadline is given up (`expire`): the sequence runs with the blocks found so far and
recomputes the rest, so a slow or dead store costs at most the deadline, never a failed request.

On a model whose every layer has a sliding window, a load is given `dead` (`DeadBlocks`): the blocks wholly
before the window of the first token after the run are only probed (found, not read), since no layer reads them.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional, Sequence

from trtpaged.runtime.kv_tiers.base import BlockRecord, TierHit

# A run of n blocks found for a sequence (its prefix hits) -> how many of its leading blocks no layer reads when the
# sequence computes from the run's end (KVCacheManager.dead_blocks): those a load only probes.
DeadBlocks = Callable[[int], int]


def reads_from(first_index: int, whole_end: int, dead: Optional[DeadBlocks]) -> int:
    """Of a read of blocks from `first_index`, the first one it reads when it finds every one (those before it are only
    probed): `whole_end` is where the sequence's run of hits ends then."""
    return first_index if dead is None else max(first_index, dead(whole_end))


class TierLoad:
    """One sequence's read of blocks `first_index ..` (their `records`). `hits` grows on the loader
    thread, contiguous from `first_index`; the scheduler reads it once the load is `done` (or expired).

    With `dead`, a block is read only while it may lie in the window of the run's end (`reads`); a hit found
    before it has no payload. Once the run's end is known, the unread hits the window needs are read
    (`needs_read`, `settle`). `whole_end`: where the run ends when every record is found (after them, blocks the
    pool holds may follow); by default, after the last record."""

    def __init__(self, first_index: int, records: Sequence[BlockRecord], deadline: float = float("inf"),
                 dead: Optional[DeadBlocks] = None, whole_end: Optional[int] = None) -> None:  # fmt: skip
        self.first_index = first_index
        self.records = tuple(records)
        self.deadline = deadline
        self.dead = dead
        self.whole_end = first_index + len(self.records) if whole_end is None else whole_end
        self.submitted = time.monotonic()
        self.hits: list[TierHit] = []
        self.done = False  # every lookup it will make is made (or it was cancelled / expired)
        self.cancelled = False
        self.expired = False  # given up at its deadline: `hits` are what it found until then
        self.finished_at: Optional[float] = None
        self.is_retry = False  # the owner's second read for the same sequence
        self.counted = False  # the owner has counted it finished
        self.saves_seen = 0  # the stack's write-back count when it last looked in the memory tier
        self.resumed = False  # sent back to the loader once for blocks written back after it ran
        self._lock = threading.Lock()  # `hits` stops growing once the load is cancelled

    def cancel(self) -> None:
        """The sequence went away (admitted, aborted, preempted): `hits` grows no more."""
        with self._lock:
            self.cancelled = True

    def active(self) -> bool:
        """Its lookups may go on: not cancelled (nor expired: a load given up is final), and not past its deadline
        while it is pending (a finished load looks again inline, `TierStack.extend`)."""
        return not self.cancelled and (self.done or time.monotonic() < self.deadline)

    @property
    def first_read(self) -> int:
        """The first block the load reads when every one of its records is found (`reads_from`)."""
        return reads_from(self.first_index, self.whole_end, self.dead)

    def reads(self, index: int) -> bool:
        """Whether block `index` is read when found, rather than probed: it may lie in the window of the run's end."""
        return index >= self.first_read

    def needs_read(self) -> Optional[int]:
        """The position in `hits` of the first hit without a payload that the window of the run's end reads."""
        end = self.whole_end if len(self.hits) == len(self.records) else self.first_index + len(self.hits)
        live = 0 if self.dead is None else max(0, self.dead(end) - self.first_index)  # hits are contiguous
        return next((k for k in range(live, len(self.hits)) if self.hits[k].payload is None), None)

    def settle(self, k: int, found: Optional[tuple[bytes, str]]) -> bool:
        """Gives hit `k` the payload read for it, or ends the run there when it could not be read; False (nothing
        changed) once the load is cancelled."""
        with self._lock:
            if self.cancelled:
                return False
            if found is None:
                del self.hits[k:]
            else:
                hit = self.hits[k]
                self.hits[k] = TierHit(hit.index, hit.record, *found)
            return True

    def expire(self, now: float) -> bool:
        """Gives the load up if it is past its deadline and not done; True when it did. `hits` is final then."""
        with self._lock:
            if self.done or now < self.deadline:
                return False
            self.expired = self.cancelled = True
            self._finish(now)
            return True

    def add(self, hit: TierHit) -> bool:
        """Appends the hit found after the others; False (not added) once the load is cancelled."""
        with self._lock:
            if not self.cancelled:
                self.hits.append(hit)
            return not self.cancelled

    def _finish(self, now: float) -> None:
        self.finished_at = now
        self.done = True


class TierLoader:
    """`threads` background threads running `TierLoad`s in submission order, one load per thread at a time
    (loads of requests arriving together read in parallel: a store's round trips overlap; hashing and
    socket and file reads release the GIL).

    A store that blocks holds a thread up to its own operation timeout; the loads queued behind
    it expire at their deadlines meanwhile, so a waiting sequence never waits longer than `timeout_s`.
    """

    def __init__(self, work: Callable[[TierLoad], None], timeout_s: float = 2.0, threads: int = 4) -> None:
        """`work` makes a submitted load's lookups (`TierStack`'s), stopping once the load is not `active`."""
        if not timeout_s > 0:
            raise ValueError(f"kv_tiers.load_timeout_s: must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self._work = work
        self._jobs: queue.Queue[Optional[TierLoad]] = queue.Queue()
        self._finished = threading.Condition()
        self._threads = [threading.Thread(target=self._run, name=f"trtpaged-kv-tier-loader-{i}", daemon=True)
                         for i in range(threads)]  # fmt: skip
        for thread in self._threads:
            thread.start()

    def submit(self, load: TierLoad) -> TierLoad:
        """Queues the load's records after the hits it already has; its deadline is `timeout_s` from now."""
        load.deadline = time.monotonic() + self.timeout_s
        self._jobs.put(load)
        return load

    def wait(self, timeout: float) -> None:
        """Blocks until some load finishes or `timeout` seconds pass (for a step with nothing to compute)."""
        with self._finished:
            self._finished.wait(timeout)

    def close(self) -> None:
        """Stops the threads after the loads they are running; idempotent."""
        alive = [thread for thread in self._threads if thread.is_alive()]
        for _ in alive:
            self._jobs.put(None)
        for thread in alive:
            thread.join()

    def _run(self) -> None:
        while (load := self._jobs.get()) is not None:
            try:
                self._work(load)
            except Exception:  # noqa: BLE001  (a tier bug ends this load with what it found; lookups count errors)
                pass
            finally:
                with self._finished:
                    with load._lock:
                        if not load.done:
                            load._finish(time.monotonic())
                    self._finished.notify_all()
