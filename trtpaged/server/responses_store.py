"""Stored Responses (`serve --responses-store-size SIZE`): what GET /v1/responses/{id} returns, what a request's
`previous_response_id` continues, and where a `background` request's state is kept while it runs.

In memory, bounded in bytes: each entry is kept as its JSON text (the bound counts what is kept), least recently
used first out; a background response still running is never evicted. An entry holds its own input items and a link
to the response it continued, not a copy of the conversation before it, so that a long chain of turns takes memory
in proportion to its length, not its square; a chain whose older link was evicted or deleted can no longer be
continued (404 naming the missing response).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from trtpaged.server.errors import ApiError


@dataclass
class _Entry:
    body: bytes  # the Response object, JSON
    items: bytes  # the request's own input items, JSON
    previous: Optional[str]  # the response it continued (previous_response_id)
    running: bool  # a background response not finished yet: kept whatever the bound

    @property
    def size(self) -> int:
        return len(self.body) + len(self.items) + len(self.previous or "")


def not_found(rid: str, field: str = "response_id") -> ApiError:
    return ApiError(f"{field}: no stored response {rid[:80]!r} (never stored, deleted, or evicted by the store's "
                    "bound)", field, 404, "not_found_error")  # fmt: skip


class ResponsesStore:
    """Responses by id, at most `max_bytes` of their JSON (oldest use first out). Used from the event loop's thread
    only."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"responses_store_size: must be >= 1 byte, got {max_bytes}")
        self.max_bytes = max_bytes
        self.size = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._reserved: set[str] = set()  # ids of responses being made, not stored yet

    def __len__(self) -> int:
        return len(self._entries)

    def reserve(self, rid: str, field: str) -> None:
        """Claims `rid` for a response about to be made; a 400 naming `field` (where the id came from) when a stored
        or running response has it: ids name one response each."""
        if rid in self._entries or rid in self._reserved:
            raise ApiError(f"{field}: {rid[:80]!r} is already the id of a stored response; ids must be unique while "
                           "the server stores responses", field)  # fmt: skip
        self._reserved.add(rid)

    def release(self, rid: str) -> None:
        """Gives up a reservation (the request was refused, or its Response is not to be stored)."""
        self._reserved.discard(rid)

    def put(self, rid: str, body: dict[str, Any], items: list[Any], previous: Optional[str],
            running: bool = False) -> bool:  # fmt: skip
        """Stores (or replaces) the Response `body` of input `items`; False when it alone is larger than the bound
        (then it is not stored, and nothing else is evicted)."""
        entry = _Entry(_dumps(body), _dumps(items), previous, running)
        old = self._entries.pop(rid, None)
        if old is not None:
            self.size -= old.size
        self._reserved.discard(rid)
        if entry.size > self.max_bytes:
            return False
        self._entries[rid] = entry
        self.size += entry.size
        for victim in [k for k, e in self._entries.items() if not e.running]:
            if self.size <= self.max_bytes:
                break
            self.size -= self._entries.pop(victim).size
        return rid in self._entries

    def get(self, rid: str) -> Optional[dict[str, Any]]:
        """The stored Response `rid` (a use: it moves to the back of the eviction order), or None."""
        entry = self._entries.get(rid)
        if entry is None:
            return None
        self._entries.move_to_end(rid)
        return json.loads(entry.body)

    def running(self, rid: str) -> bool:
        entry = self._entries.get(rid)
        return entry is not None and entry.running

    def delete(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        self.size -= entry.size
        return True

    def conversation(self, rid: str, field: str = "previous_response_id") -> list[Any]:
        """The items that led to and came out of response `rid`, oldest first: each response's input items, then
        its output items, along the chain of previous_response_id links. 404 naming `field` when `rid` or an older
        link of its chain is not stored."""
        chain: list[_Entry] = []
        seen: set[str] = set()
        at: Optional[str] = rid
        while at is not None:
            entry = self._entries.get(at)
            if entry is None or at in seen:
                if at == rid:
                    raise not_found(rid, field)
                raise ApiError(f"{field}: {rid[:80]!r} continues response {at[:80]!r}, which is no longer stored "
                               "(deleted or evicted by the store's bound)", field, 404, "not_found_error")  # fmt: skip
            if entry.running:
                raise ApiError(f"{field}: response {at[:80]!r} is still running in the background; continue it once "
                               "it has finished", field)  # fmt: skip
            seen.add(at)
            self._entries.move_to_end(at)
            chain.append(entry)
            at = entry.previous
        items: list[Any] = []
        for entry in reversed(chain):
            items += json.loads(entry.items)
            items += json.loads(entry.body)["output"]
        return items


def _dumps(value: Any) -> bytes:
    # ASCII JSON, as the answers are written: a lone surrogate a client sent is escaped, not a failed encode
    return json.dumps(value, separators=(",", ":")).encode()
