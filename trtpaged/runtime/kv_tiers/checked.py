"""A byte store (disk, Redis) as a block tier: blocks go in as self-checking entries (entry.py) and come back only
when the entry proves to be the block asked for, so a truncated, flipped or foreign entry is a miss, never wrong K/V."""

from __future__ import annotations

import logging
import threading
from typing import Optional

from trtpaged.runtime.kv_tiers.base import BlockRecord, ByteStore, TierCounters
from trtpaged.runtime.kv_tiers.entry import EntryMismatch, decode_entry, encode_entry, entry_bytes

log = logging.getLogger("trtpaged.runtime")


class EntryCodec:
    """One engine's entries: its fingerprint and block size. Shared by the checked tiers of a stack, it keeps the
    last entry it encoded, so a write-back to both disk and Redis hashes the block once."""

    def __init__(self, fingerprint: bytes, block_bytes: int, secret: Optional[bytes] = None) -> None:
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self._secret = secret  # entry.py: entries signed and checked with it (HMAC-SHA256)
        self._last: Optional[tuple[BlockRecord, bytes, bytes]] = None  # record, payload, entry
        self._lock = threading.Lock()

    def encode(self, record: BlockRecord, payload: bytes) -> bytes:
        with self._lock:
            last = self._last
            if last is not None and last[1] is payload and last[0] == record:
                return last[2]
        entry = encode_entry(self.fingerprint, record.parent, record.tokens, payload, self._secret)
        with self._lock:
            self._last = (record, payload, entry)
        return entry

    def decode(self, data: Optional[bytes], record: BlockRecord) -> bytes:
        """The payload of `data` if it is `record`'s block of this engine; raises EntryMismatch."""
        return decode_entry(data, self.fingerprint, record.parent, record.tokens, self.block_bytes, self._secret)


class CheckedTier:
    """`store` as a `KVTier` (base.py) whose entries are checked against the record on every read."""

    def __init__(self, store: ByteStore, codec: EntryCodec) -> None:
        self.store = store
        self.codec = codec

    @property
    def name(self) -> str:
        return self.store.name

    @property
    def counters(self) -> TierCounters:
        return self.store.counters

    @property
    def slow(self) -> bool:
        return self.store.slow

    def get_block(self, record: BlockRecord) -> Optional[bytes]:
        data = self.store.get(record.key, entry_bytes(len(record.tokens), self.codec.block_bytes))
        try:
            payload = self.codec.decode(data, record)
        except EntryMismatch as e:
            if e.reason != "missing":
                self.counters.invalid += 1
                if self.counters.invalid in (1, 10, 100) or self.counters.invalid % 1000 == 0:
                    log.warning("kv tier %s: an entry failed its checks (%s) and is removed; %d so far", self.name,
                                f"{e.reason}: {e.detail}" if e.detail else e.reason, self.counters.invalid)
                # a bad entry would stay a miss for ever: write-backs skip a key the store holds
                self.store.discard(record.key)
            return None
        self.counters.bytes_read += len(data)  # type: ignore[arg-type]
        return payload

    def has_block(self, record: BlockRecord) -> bool:
        """Whether the store holds an entry under the record's key (unchecked: nothing is read)."""
        return self.store.touch(record.key)

    def put_block(self, record: BlockRecord, payload: bytes) -> None:
        self.store.put(record.key, self.codec.encode(record, payload))

    def contains(self, key: bytes) -> bool:
        return self.store.contains(key)

    def close(self) -> None:
        self.store.close()
