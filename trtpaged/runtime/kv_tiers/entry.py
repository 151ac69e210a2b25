"""Tier keys and the self-checking entry format every tier stores.

A tier key names one full block's content for one engine: the SHA-256 chain
`key_j = sha256(fingerprint, key_{j-1}, tokens of block j)`, so it covers every
token before the block and the engine that computed it (key_{-1}: ROOT, or a key of
the sequence's cache salt, `root_key`). An entry carries, in front of the block's
bytes, everything needed to prove it is the block asked for: the engine fingerprint, the parent key,
the block's own token ids, the payload's length and SHA-256. `decode_entry` checks all of them; any mismatch
(a truncated file, a flipped bit, another engine's entry, a different prefix)
is a miss, never wrong K/V.

Those checks stop accidents, not a writer: whoever can write to the store can
compute a SHA-256 too. With a shared secret (`kv_tiers.secret_file`), the digest is
an HMAC-SHA256 of the whole entry under it, so an entry not written by a holder
of the secret fails its checks like a flipped bit.

    magic "TPKV1\\0\\0\\0" | fingerprint 32 | parent key 32 | n_tokens u32 | tokens int32 x n
    | payload length u64 | payload sha256 32 | payload
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import Any, Optional, Sequence

MAGIC = b"TPKV1\0\0\0"
DIGEST = 32
ROOT = bytes(DIGEST)  # the parent key of a sequence's first block
_HEAD = struct.Struct("<8s32s32sI")
_TAIL = struct.Struct("<Q32s")


class EntryMismatch(ValueError):
    """An entry that is not the block asked for; `reason` is one word for the counters."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


def engine_fingerprint(**fields: Any) -> bytes:
    """32 bytes that differ whenever a block's bytes could mean something else.

    Callers pass the model identity (manifest digest), dtype, KV dtype, block size,
    tensor-parallel rank and world size, and the block's shape in bytes.
    """
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).digest()


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def root_key(fingerprint: bytes, cache_salt: Optional[str] = None) -> bytes:
    """The parent key of a sequence's first block: ROOT, or for a salted sequence a key of its salt, so that a
    tier never hands a salted block to a sequence with another salt or none (every later key chains from it)."""
    if cache_salt is None:
        return ROOT
    return hashlib.sha256(fingerprint + b"cache_salt\0" + cache_salt.encode("utf-8")).digest()


def chain_key(fingerprint: bytes, parent: bytes, tokens: Sequence[int]) -> bytes:
    """The tier key of a block holding `tokens` after the block keyed `parent` (ROOT for the first)."""
    return hashlib.sha256(fingerprint + parent + _tokens_bytes(tokens)).digest()


def entry_bytes(block_size: int, payload_bytes: int) -> int:
    """The size of one entry of a block of `block_size` tokens and `payload_bytes` bytes."""
    return _HEAD.size + 4 * block_size + _TAIL.size + payload_bytes


def _digest(secret: Optional[bytes], head: bytes | memoryview, length: int, payload: bytes | memoryview) -> bytes:
    """The payload's SHA-256, or with a secret the HMAC-SHA256 of everything before the digest and the payload."""
    if secret is None:
        return hashlib.sha256(payload).digest()
    mac = hmac.new(secret, head, hashlib.sha256)
    mac.update(struct.pack("<Q", length))
    mac.update(payload)
    return mac.digest()


def encode_entry(fingerprint: bytes, parent: bytes, tokens: Sequence[int], payload: bytes,
                 secret: Optional[bytes] = None) -> bytes:  # fmt: skip
    head = _HEAD.pack(MAGIC, fingerprint, parent, len(tokens)) + _tokens_bytes(tokens)
    return head + _TAIL.pack(len(payload), _digest(secret, head, len(payload), payload)) + payload


def decode_entry(data: Optional[bytes], fingerprint: bytes, parent: bytes, tokens: Sequence[int],
                 payload_bytes: int, secret: Optional[bytes] = None) -> bytes:  # fmt: skip
    """The payload of an entry proven to be `tokens` after `parent` for this engine (and, with `secret`, written
    by a holder of it); raises EntryMismatch."""
    if data is None:
        raise EntryMismatch("missing")
    view = memoryview(data)
    if len(view) < _HEAD.size:
        raise EntryMismatch("truncated", f"{len(view)} bytes")
    magic, fp, par, n = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise EntryMismatch("corrupted", "bad magic")
    if fp != fingerprint:
        raise EntryMismatch("foreign", "written by another engine")
    if par != parent or n != len(tokens):
        raise EntryMismatch("corrupted", "another prefix")
    offset = _HEAD.size + 4 * n
    if len(view) < offset + _TAIL.size:
        raise EntryMismatch("truncated", f"{len(view)} bytes")
    if bytes(view[_HEAD.size:offset]) != _tokens_bytes(tokens):
        raise EntryMismatch("corrupted", "other tokens")
    length, digest = _TAIL.unpack_from(view, offset)
    payload = view[offset + _TAIL.size:]
    if length != payload_bytes:
        raise EntryMismatch("foreign", f"payload of {length} bytes, this engine's blocks are {payload_bytes}")
    if len(payload) != length:  # longer: bytes appended (a store's read stops one past the entry's size)
        raise EntryMismatch("truncated" if len(payload) < length else "corrupted",
                            f"payload {len(payload)}{'' if len(payload) < length else '+'} of {length} bytes")
    if not hmac.compare_digest(_digest(secret, view[:offset], length, payload), digest):
        raise EntryMismatch("corrupted", "payload checksum" if secret is None else "not signed with this secret")
    return bytes(payload)
