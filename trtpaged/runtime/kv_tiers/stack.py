"""The tiers below the pool, top (fastest) to bottom, as one lookup and one write-back path.

Lookups go top-down and stop at the first verified entry; every tier asked and
not holding one counts a miss. Write-back puts an evicted block into every tier
that lacks it: inline for the host tier (a dict insert), through one background
writer thread for slow tiers (disk, network), so a step never waits on them. The
writer's queue is bounded; when it is full the write-back is dropped and counted
(a later eviction of the same prefix will offer it again).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from trtpaged.runtime.kv_tiers.base import KVTier
from trtpaged.runtime.kv_tiers.entry import EntryMismatch, decode_entry, encode_entry


@dataclass(frozen=True)
class BlockRecord:
    """What identifies a full block's content below the pool."""

    key: bytes
    parent: bytes
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class TierHit:
    """A verified block found in a tier for block `index` of a sequence; `payload` is its pool bytes."""

    index: int
    record: BlockRecord
    payload: bytes
    tier: str


class TierStack:
    def __init__(self, tiers: Sequence[KVTier], fingerprint: bytes, block_bytes: int, queue_size: int = 1024) -> None:
        if not tiers:
            raise ValueError("kv tiers: at least one tier")
        self.tiers = list(tiers)
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.load_seconds = 0.0
        self.num_loads = 0  # blocks restored into the pool from a tier
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._writer: Optional[threading.Thread] = None
        if any(t.slow for t in self.tiers):
            self._writer = threading.Thread(target=self._write_loop, name="trtpaged-kv-tier-writer", daemon=True)
            self._writer.start()

    # ---- lookups ------------------------------------------------------------------------------
    def lookup(self, record: BlockRecord) -> Optional[tuple[bytes, str]]:
        """(payload, tier name) of the block, verified against this engine and prefix, or None."""
        for tier in self.tiers:
            start = time.perf_counter()
            data = tier.get(record.key)
            try:
                payload = decode_entry(data, self.fingerprint, record.parent, record.tokens, self.block_bytes)
            except EntryMismatch as e:
                tier.counters.misses += 1
                if e.reason != "missing":
                    tier.counters.invalid += 1
                continue
            finally:
                tier.counters.load_seconds += time.perf_counter() - start
            tier.counters.hits += 1
            tier.counters.bytes_read += len(data)  # type: ignore[arg-type]
            return payload, tier.name
        return None

    # ---- write-back ---------------------------------------------------------------------------
    @property
    def has_persistent(self) -> bool:
        """A tier outlives this process (disk, a store): worth a write-back of the whole cache at close."""
        return any(t.slow for t in self.tiers)

    def save(self, records: Sequence[tuple[BlockRecord, bytes]], persistent_only: bool = False) -> None:
        """Offers evicted blocks' (record, payload) to every tier that lacks them (only the disk and remote
        tiers with `persistent_only`)."""
        slow_items = []
        for record, payload in records:
            entry = encode_entry(self.fingerprint, record.parent, record.tokens, payload)
            for tier in self.tiers:
                if not tier.slow and not persistent_only:
                    if not tier.contains(record.key):
                        tier.put(record.key, entry)
            slow_items.append((record.key, entry))
        if self._writer is None:
            return
        for item in slow_items:
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                for tier in self.tiers:
                    if tier.slow:
                        tier.counters.dropped += 1

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, entry = item
                for tier in self.tiers:
                    if tier.slow and not tier.contains(key):
                        tier.put(key, entry)
            except Exception:  # noqa: BLE001  (a tier bug must not kill the writer; counted)
                for tier in self.tiers:
                    if tier.slow:
                        tier.counters.errors += 1
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Waits until every queued write-back reached its tiers."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Finishes the queued write-backs, stops the writer and closes the tiers; idempotent."""
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
