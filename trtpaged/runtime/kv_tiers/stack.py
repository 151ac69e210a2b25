"""The tiers below the pool, top (fastest) to bottom, as one lookup and one write-back path.

Every tier holds whole blocks by record (base.py: `KVTier`); the disk and remote
ones check their entries themselves (checked.py), so the stack treats all alike.
Lookups go top-down and stop at the first tier holding the block; every tier asked
and not holding it counts a miss. With `background` (a serving engine), lookups run on
the loader's threads (loader.py) and write-backs on one writer thread: the step copies
an evicted block's bytes out of the pool and queues them; encoding entries (their
SHA-256) and every tier's put happen on the writer, so a step never waits on a
tier. The writer's queue is bounded; when it is full the write-back is dropped and
counted (a later eviction of the same prefix will offer it again). Without
`background` (the replays of `bench memory` / `diagnose`, which must be
deterministic) both happen inline.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Optional, Sequence

from trtpaged.runtime.kv_tiers.base import BlockRecord, KVTier, TierHit
from trtpaged.runtime.kv_tiers.entry import entry_bytes
from trtpaged.runtime.kv_tiers.loader import DeadBlocks, TierLoad, TierLoader

__all__ = ["BlockRecord", "TierHit", "TierStack"]


class TierStack:
    def __init__(self, tiers: Sequence[KVTier], fingerprint: bytes, queue_size: int = 1024, background: bool = True,
                 load_timeout_s: float = 2.0) -> None:  # fmt: skip
        """`fingerprint`: the engine's (entry.py), from which the blocks' tier keys are chained."""
        if not tiers:
            raise ValueError("kv tiers: at least one tier")
        self.tiers = list(tiers)
        self.fingerprint = fingerprint
        self.load_seconds = 0.0
        self.num_loads = 0  # blocks restored into the pool from a tier
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._writer: Optional[threading.Thread] = None
        self.loader: Optional[TierLoader] = None  # None: lookups run inline (`start_load` returns a finished load)
        # write-backs queued for the writer, by key: found by lookups before they reach their tiers
        self._unwritten: dict[bytes, tuple[BlockRecord, bytes]] = {}
        self.num_saves = 0  # write-backs offered so far (a finished load looks again only after new ones)
        if background:
            if any(t.slow for t in self.tiers):
                self.loader = TierLoader(self._load_slow, load_timeout_s)
            self._writer = threading.Thread(target=self._write_loop, name="trtpaged-kv-tier-writer", daemon=True)
            self._writer.start()

    # ---- lookups ------------------------------------------------------------------------------
    def lookup(self, record: BlockRecord, slow: Optional[bool] = None,
               read: bool = True) -> Optional[tuple[Optional[bytes], str]]:  # fmt: skip
        """(payload, tier name) of exactly this block (the tiers' `get_block` rule), or None. `slow`: ask only
        the slow tiers (True) or only the memory tier (False). A block whose write-back is still queued is
        found there (the pool's own bytes of that block), counted as a hit of the top tier. `read` False: only
        whether a tier holds it (`has_block`, counted as that tier's probe), the payload None."""
        queued = self._unwritten.get(record.key) if slow is not True else None
        if queued is not None and queued[0] == record:
            top = self.tiers[0]
            if not read:
                top.counters.probes += 1
                return None, top.name
            top.counters.hits += 1
            top.counters.bytes_read += entry_bytes(len(record.tokens), len(queued[1]))  # as the tiers count a hit
            return queued[1], top.name
        for tier in self.tiers:
            if slow is not None and tier.slow != slow:
                continue
            start = time.perf_counter()
            found = tier.get_block(record) if read else tier.has_block(record)
            tier.counters.load_seconds += time.perf_counter() - start
            if found is None or found is False:
                tier.counters.misses += 1
                continue
            if not read:
                tier.counters.probes += 1
                return None, tier.name
            tier.counters.hits += 1
            return found, tier.name  # type: ignore[return-value]
        return None

    def start_load(self, first_index: int, records: Sequence[BlockRecord], known: Sequence[TierHit] = (),
                   dead: Optional[DeadBlocks] = None, whole_end: Optional[int] = None) -> TierLoad:  # fmt: skip
        """Looks up `records` (blocks `first_index ..` of a sequence) in order until the first miss, after the
        leading ones `known` already holds (found by another sequence's load). The memory
        tier is asked now (a dict lookup and a record comparison, no I/O); what it lacks is read from the slow tiers
        (disk, Redis) on the loader with `background`, else now. A load with nothing left to read
        comes back done. `dead`, `whole_end`: the blocks before the window of the run's end are probed, not read
        (`TierLoad`)."""
        load = TierLoad(first_index, records, dead=dead, whole_end=whole_end)
        load.saves_seen = self.num_saves
        load.hits += known
        split = self.loader is not None  # memory tier now, slow tiers on the loader
        self._continue(load, slow=False if split else None)
        if split and (len(load.hits) < len(records) or load.needs_read() is not None):
            return self.loader.submit(load)  # type: ignore[union-attr]
        self._settle(load, slow=None)
        load.done = True
        load.finished_at = load.submitted
        return load

    def _continue(self, load: TierLoad, slow: Optional[bool]) -> None:
        """Looks up the load's records after its hits, in order, until one is missing (or the load stops): read
        where the block may lie in the window of the run's end, else probed (`TierLoad.reads`)."""
        for k in range(len(load.hits), len(load.records)):
            index, record = load.first_index + k, load.records[k]
            found = self.lookup(record, slow, read=load.reads(index)) if load.active() else None
            if found is None or not load.add(TierHit(index, record, *found)):
                return

    def _settle(self, load: TierLoad, slow: Optional[bool]) -> None:
        """Reads the probed hits that the window of the run's end reads (the run ended before its last record);
        one that cannot be read ends the run there, whose window then starts earlier."""
        while load.active() and (k := load.needs_read()) is not None:
            if not load.settle(k, self.lookup(load.hits[k].record, slow)):
                return

    def _load_slow(self, load: TierLoad) -> None:
        """A load's work on the loader: its records from the slow tiers, then the reads its window needs."""
        self._continue(load, slow=True)
        self._settle(load, slow=None)

    def extend(self, load: TierLoad) -> bool:
        """Adds to a finished load the blocks after its hits that reached the memory tier or the write-back
        queue since it last looked (blocks evicted while it ran). When one is missing there and there are slow
        tiers, the rest goes back to the loader once (the writer may have stored it on disk or in Redis
        meanwhile): True then, and the load is pending again."""
        if not load.done or load.saves_seen == self.num_saves or len(load.hits) == len(load.records):
            return False
        load.saves_seen = self.num_saves
        slow = False if self.loader is not None else None
        self._continue(load, slow)
        if len(load.hits) < len(load.records) and self.loader is not None and not load.resumed and not load.cancelled:
            load.resumed, load.done = True, False
            self.loader.submit(load)
            return True
        self._settle(load, slow)
        return False

    # ---- write-back ---------------------------------------------------------------------------
    @property
    def has_persistent(self) -> bool:
        """A tier outlives this process (disk, a store): worth a write-back of the whole cache at close."""
        return any(t.slow for t in self.tiers)

    def save(self, records: Sequence[tuple[BlockRecord, bytes]], persistent_only: bool = False) -> None:
        """Offers evicted blocks' (record, payload) to every tier that lacks them (only the disk and remote
        tiers with `persistent_only`): queued for the writer thread, or written now without `background`."""
        self.num_saves += len(records)
        for record, payload in records:
            if self._writer is None:
                self._write(record, payload, persistent_only)
                continue
            self._unwritten[record.key] = (record, payload)  # before the writer may take it
            try:
                self._queue.put_nowait((record, payload, persistent_only))
            except queue.Full:
                self._unwritten.pop(record.key, None)
                for tier in self._targets(persistent_only):
                    tier.counters.dropped += 1

    def drop(self, num_records: int, persistent_only: bool = False) -> None:
        """Counts write-backs given up before they were offered (their blocks could not be read)."""
        for tier in self._targets(persistent_only):
            tier.counters.dropped += num_records

    def _targets(self, persistent_only: bool) -> list[KVTier]:
        return [t for t in self.tiers if t.slow or not persistent_only]

    def _write(self, record: BlockRecord, payload: bytes, persistent_only: bool) -> None:
        """Writes a block back to each target tier that lacks it; a tier that raises counts an error and drops its
        own write, the tiers after it still get theirs."""
        for tier in self._targets(persistent_only):
            try:
                if not tier.contains(record.key):
                    tier.put_block(record, payload)
            except Exception:  # noqa: BLE001  (a tier bug must not kill the writer, nor cost the other tiers)
                tier.counters.errors += 1

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                if item is not None:
                    self._unwritten.pop(item[0].key, None)
                self._queue.task_done()

    def flush(self) -> None:
        """Waits until every queued write-back reached its tiers."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Finishes the queued write-backs, stops the loader and the writer and closes the tiers; idempotent."""
        if self.loader is not None:
            self.loader.close()
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        for tier in self.tiers:
            tier.close()

    # ---- statistics ---------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {"kv_tier_blocks_loaded": self.num_loads, "kv_tier_load_seconds": self.load_seconds}
        for tier in self.tiers:
            out.update(tier.counters.as_dict(f"kv_tier_{tier.name}"))
        return out
