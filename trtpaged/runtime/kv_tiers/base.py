"""The tier interface: a store of whole blocks by record (`KVTier`), with its own bound and counters; the byte stores
below the checked tiers (`ByteStore`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Protocol


@dataclass
class TierCounters:
    """What one tier did; `stats()` exposes each as `kv_tier_<name>_<field>`."""

    hits: int = 0  # lookups answered with a verified entry
    probes: int = 0  # lookups answered without a read: the block lies before a sliding window (KVTier.has_block)
    misses: int = 0  # lookups without one (absent, invalid or store unreachable)
    invalid: int = 0  # of the misses: an entry was there but failed its checks (truncated, corrupted, foreign)
    errors: int = 0  # store operations that failed (timeouts, connection refused)
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    evictions: int = 0  # entries the tier dropped to stay within its size
    dropped: int = 0  # write-backs given up (the writer queue was full or the store failed)
    load_seconds: float = 0.0  # time spent reading entries for lookups

    def as_dict(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}_{f.name}": getattr(self, f.name) for f in fields(self)}


class KVTier(Protocol):
    """One level below the pool, holding whole blocks by their record. Operations never raise for a missing or
    unreachable block: `get_block` returns None, `put_block` reports failure through `counters`."""

    name: str
    counters: TierCounters
    slow: bool  # written from the background writer (disk, network) rather than inline

    def get_block(self, record: BlockRecord) -> Optional[bytes]:
        """The payload stored for exactly `record` (key, parent and tokens), or None. Something else stored under
        the key counts `invalid`; a hit counts its `bytes_read`. Hits and misses are the stack's to count."""
        ...

    def has_block(self, record: BlockRecord) -> bool:
        """Whether the tier holds an entry for `record`, without reading it (for a block no layer will read); the
        entry counts as recently used, as a read would make it. An entry that would fail its checks may answer
        True: its bytes are never used."""
        ...

    def put_block(self, record: BlockRecord, payload: bytes) -> None:
        """Stores the block, evicting what the tier's bound requires."""
        ...

    def contains(self, key: bytes) -> bool:
        ...

    def close(self) -> None:
        ...


class ByteStore(Protocol):
    """A keyed store of bytes that can come back truncated, flipped or written by another engine (a directory, a
    Redis server): a tier through `CheckedTier` (checked.py), which stores self-checking entries in it."""

    name: str
    counters: TierCounters
    slow: bool

    def get(self, key: bytes, max_bytes: Optional[int] = None) -> Optional[bytes]:
        """The stored bytes under `key`, or None. A store that can bound its read returns at most `max_bytes` + 1
        of them (an oversized entry is read no further than it takes to fail its checks). Never blocks on what
        another process put under the key."""
        ...

    def discard(self, key: bytes) -> None:
        """Removes what is stored under `key` (an entry that failed its checks), so a write-back can replace it."""
        ...

    def put(self, key: bytes, entry: bytes) -> None:
        """Stores `entry` under `key`, evicting what the store's bound requires."""
        ...

    def touch(self, key: bytes) -> bool:
        """Whether something is stored under `key`, marking it recently used; nothing is read."""
        ...

    def contains(self, key: bytes) -> bool:
        ...

    def close(self) -> None:
        ...


@dataclass(frozen=True)
class BlockRecord:
    """What identifies a full block's content below the pool."""

    key: bytes
    parent: bytes
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class TierHit:
    """A block found in a tier for block `index` of a sequence; `payload` is its pool bytes, verified, or None: found
    but not read (it lies wholly before the sequence's sliding window, `TierLoad.reads`)."""

    index: int
    record: BlockRecord
    payload: Optional[bytes]
    tier: str
