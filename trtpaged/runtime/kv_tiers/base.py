"""The tier interface: a byte store keyed by tier keys (entry.py), with its own bound and counters."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Protocol


@dataclass
class TierCounters:
    """What one tier did; `stats()` exposes each as `kv_tier_<name>_<field>`."""

    hits: int = 0  # lookups answered with a verified entry
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
    """One level below the pool. Operations never raise for a missing or unreachable entry:
    `get` returns None, `put` and `contains` report failure through `counters.errors`."""

    name: str
    counters: TierCounters
    slow: bool  # written from the background writer (disk, network) rather than inline

    def get(self, key: bytes) -> Optional[bytes]:
        """The stored entry under `key`, or None."""
        ...

    def put(self, key: bytes, entry: bytes) -> None:
        """Stores `entry` under `key`, evicting what the tier's bound requires."""
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
    """A verified block found in a tier for block `index` of a sequence; `payload` is its pool bytes."""

    index: int
    record: BlockRecord
    payload: bytes
    tier: str
