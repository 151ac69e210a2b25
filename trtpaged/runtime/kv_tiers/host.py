"""Host-memory tier: entries in process memory, a byte budget apart from the KV pool, LRU eviction."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

from trtpaged.runtime.kv_tiers.base import TierCounters


class HostMemoryTier:
    """An LRU byte store of at most `capacity_bytes` (entries counted by their length).

    On a CUDA device the pool's blocks are copied out through pageable memory; pinned
    staging is not done yet (docs/kv_tiers.md).
    """

    slow = False

    def __init__(self, capacity_bytes: int, name: str = "host") -> None:
        if capacity_bytes < 1:
            raise ValueError(f"kv_tiers.host_memory: must be > 0 bytes, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.counters = TierCounters()
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def get(self, key: bytes) -> Optional[bytes]:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def put(self, key: bytes, entry: bytes) -> None:
        if len(entry) > self.capacity_bytes:
            self.counters.dropped += 1
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            while self._entries and self._bytes + len(entry) > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= len(evicted)
                self.counters.evictions += 1
            self._entries[key] = entry
            self._bytes += len(entry)
            self.counters.puts += 1
            self.counters.bytes_written += len(entry)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
