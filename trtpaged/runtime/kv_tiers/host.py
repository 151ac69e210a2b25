"""Host-memory tier: blocks in process memory, a byte budget apart from the KV pool, LRU eviction.

It holds each evicted block as (record, payload): the pool's own bytes and what identifies them
(chain key, parent key, token ids). A lookup is answered when the stored record equals the one asked
for, the exact-identity rule of a pool hit; no entry is encoded or checksummed, because the bytes never
leave this process (the disk and remote tiers, whose bytes can be truncated, flipped or written by
another engine, keep the self-checking entry format of entry.py). That saves a SHA-256 over the block
on every write-back (on the writer thread, which shares the CPU with the step) and on every hit (on the
step loop: the host tier is asked inline).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

from trtpaged.runtime.kv_tiers.base import BlockRecord, TierCounters
from trtpaged.runtime.kv_tiers.entry import entry_bytes


class HostMemoryTier:
    """An LRU store of blocks of at most `capacity_bytes` (each block counted as its encoded entry's size,
    `entry_bytes`, so a size means as many blocks here as on disk).

    On a CUDA device the pool's blocks are copied out through pinned staging rows (runners/base.py:
    BlockStaging); the entries themselves are ordinary memory.
    """

    slow = False

    def __init__(self, capacity_bytes: int, name: str = "host") -> None:
        if capacity_bytes < 1:
            raise ValueError(f"kv_tiers.host_memory: must be > 0 bytes, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.counters = TierCounters()
        self._blocks: OrderedDict[bytes, tuple[BlockRecord, bytes, int]] = OrderedDict()  # key -> record, bytes, size
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    @property
    def num_entries(self) -> int:
        return len(self._blocks)

    def get_block(self, record: BlockRecord) -> Optional[bytes]:
        """The payload stored for exactly `record` (key, parent and tokens), or None. A block under the same key
        with another parent or other tokens (a hash collision) is not it: None, counted `invalid`."""
        found = self._use(record)
        if found is None:
            return None
        self.counters.bytes_read += found[2]
        return found[1]

    def has_block(self, record: BlockRecord) -> bool:
        """Whether `get_block(record)` would answer, without counting a read."""
        return self._use(record) is not None

    def _use(self, record: BlockRecord) -> Optional[tuple[BlockRecord, bytes, int]]:
        """The entry of exactly `record`, now the most recently used, or None."""
        with self._lock:
            found = self._blocks.get(record.key)
            if found is None:
                return None
            if found[0] != record:
                self.counters.invalid += 1
                return None
            self._blocks.move_to_end(record.key)
            return found

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blocks

    def put_block(self, record: BlockRecord, payload: bytes) -> None:
        """Stores the block, evicting the least recently used ones its size requires."""
        size = entry_bytes(len(record.tokens), len(payload))
        if size > self.capacity_bytes:
            self.counters.dropped += 1
            return
        with self._lock:
            old = self._blocks.pop(record.key, None)
            if old is not None:
                self._bytes -= old[2]
            while self._blocks and self._bytes + size > self.capacity_bytes:
                _, (_, _, evicted) = self._blocks.popitem(last=False)
                self._bytes -= evicted
                self.counters.evictions += 1
            self._blocks[record.key] = (record, payload, size)
            self._bytes += size
            self.counters.puts += 1
            self.counters.bytes_written += size

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bytes = 0
