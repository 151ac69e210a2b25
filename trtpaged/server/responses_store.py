"""Stored Responses (`serve --responses-store-size SIZE`): what GET /v1/responses/{id} returns, what a request's
`previous_response_id` continues, and where a `background` request's state is kept while it runs.

In memory, bounded in bytes: each entry is kept as JSON text (the bound counts what is kept), the least recently
used finished one out first; a background response still running is never evicted (running entries are the only
thing that can hold the store past its bound). An entry holds the Response (what GET returns) and its turn: its own
input and output items, with only what a prompt is made of (no log-probs, no unknown keys), linked to the response
it continued, not a copy of the conversation before it, so that a chain of turns takes memory in proportion to its
length. A link names the response's id and its serial: an id deleted (or evicted) and given to a new response
breaks the chains through the old one (404), instead of splicing the new one's turn into them.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from trtpaged.server.errors import ApiError

Link = tuple[str, int]  # a stored response: its id and its serial
MAX_CHAIN_BYTES = 8 << 20  # a conversation read back for previous_response_id: far past any model's context


@dataclass
class _Entry:
    serial: int
    body: bytes  # the Response object, JSON
    turn: bytes  # its input items, then its output items, as prompt items (JSON)
    previous: Optional[Link]  # the response it continued (previous_response_id)
    inputs: int = 0  # how many of the turn's items were its input (GET /v1/responses/{id}/input_items)

    @property
    def size(self) -> int:
        return len(self.body) + len(self.turn)


def not_found(rid: str, field: str = "response_id", stores: bool = True) -> ApiError:
    """The 404 for a response id that is not stored; `stores`: whether this server has a store at all."""
    why = (" (never stored, deleted, or evicted by the store's bound)" if stores
           else ": this server stores none (serve --responses-store-size)")  # fmt: skip
    return ApiError(f"{field}: no stored response {rid[:80]!r}{why}", field, 404, "not_found_error")


class ResponsesStore:
    """Responses by id, at most `max_bytes` of their JSON (least recently used out first). Held, never evicted: the
    background responses still running and those finished but not read yet (a poll must find the end, not a 404);
    a new background request waits (503) while held ones fill the bound. Used from the event loop's thread only."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"responses_store_size: must be >= 1 byte, got {max_bytes}")
        self.max_bytes = max_bytes
        self.size = 0
        self.held_size = 0  # of the running and unread entries
        self._finished: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._running: dict[str, _Entry] = {}  # background responses not finished
        self._unread: dict[str, _Entry] = {}  # background responses finished and not read yet
        self._claims: dict[str, int] = {}  # ids of responses being made -> the claim's token
        self._serials = itertools.count(1)

    def __len__(self) -> int:
        return len(self._finished) + len(self._running) + len(self._unread)

    def taken(self, rid: str) -> bool:
        return self._entry(rid) is not None or rid in self._claims

    def room_for_background(self) -> bool:
        """Whether held entries leave room for another background response."""
        return self.held_size < self.max_bytes

    def claim(self, rid: str, field: str) -> int:
        """Claims `rid` for a response about to be made; a 400 naming `field` (where the id came from) when a stored,
        running or claimed response has it: ids name one response each. Returns the claim's token (`release`)."""
        if self.taken(rid):
            raise ApiError(f"{field}: {rid[:80]!r} is already the id of a stored response; ids must be unique while "
                           "the server stores responses", field)  # fmt: skip
        token = next(self._serials)
        self._claims[rid] = token
        return token

    def release(self, rid: str, token: int) -> None:
        """Gives up claim `token` on `rid` (the request was refused, or its stream ended), unless another's by now."""
        if self._claims.get(rid) == token:
            del self._claims[rid]

    def put(self, rid: str, body: dict[str, Any], turn: list[Any], previous: Optional[Link], running: bool = False,
            unread: bool = False, inputs: int = 0) -> bool:  # fmt: skip
        """Stores (or replaces) the Response `body` and its `turn` (its prompt items, in and out; the first `inputs`
        of them its input): `running` (a background one not finished), `unread` (a background one finished, held
        until read), else finished, when the least recently used finished others go until the store is within its
        bound (this one stays). False, and nothing changed, when it alone is larger than the bound."""
        old = self._entry(rid)
        entry = _Entry(old.serial if old is not None else next(self._serials), _dumps(body), _dumps(turn), previous,
                       inputs)
        if entry.size > self.max_bytes:  # what was stored under `rid` stays
            return False
        if old is not None:
            self._remove(rid)
        self._claims.pop(rid, None)
        self.size += entry.size
        if running or unread:
            (self._running if running else self._unread)[rid] = entry
            self.held_size += entry.size
            return True
        self._finished[rid] = entry
        while self.size > self.max_bytes and len(self._finished) > 1:
            _, victim = self._finished.popitem(last=False)
            self.size -= victim.size
        return True

    def get(self, rid: str) -> Optional[dict[str, Any]]:
        """The stored Response `rid`, or None. A use: a finished one moves to the back of the eviction order (an
        unread one, read now, joins it there)."""
        entry = self._use(rid)
        return json.loads(entry.body) if entry is not None else None

    def touch(self, rid: str) -> bool:
        """A use of stored response `rid`, as `get`, without reading it back: whether it is stored."""
        return self._use(rid) is not None

    def input_items(self, rid: str) -> Optional[tuple[list[Any], int]]:
        """The input items of stored response `rid` (a use, as `get`) and its serial, or None."""
        entry = self._use(rid)
        return (json.loads(entry.turn)[: entry.inputs], entry.serial) if entry is not None else None

    def running(self, rid: str) -> bool:
        return rid in self._running

    def delete(self, rid: str) -> bool:
        """Deletes finished response `rid` (False: none such)."""
        if self._read(rid) is None:
            return False
        self._remove(rid)
        return True

    def _entry(self, rid: str) -> Optional[_Entry]:
        return self._finished.get(rid) or self._running.get(rid) or self._unread.get(rid)

    def _use(self, rid: str) -> Optional[_Entry]:
        """Entry `rid`, used: a running one as it is, a finished one as `_read` reads it."""
        return self._running.get(rid) or self._read(rid)

    def _read(self, rid: str) -> Optional[_Entry]:
        """Finished entry `rid`, moved to the back of the eviction order (an unread one is read now)."""
        entry = self._unread.pop(rid, None)
        if entry is not None:
            self.held_size -= entry.size
            self._finished[rid] = entry
            return entry
        entry = self._finished.get(rid)
        if entry is not None:
            self._finished.move_to_end(rid)
        return entry

    def _remove(self, rid: str) -> None:
        for held, entries in ((False, self._finished), (True, self._running), (True, self._unread)):
            entry = entries.pop(rid, None)
            if entry is not None:
                self.size -= entry.size
                self.held_size -= entry.size if held else 0

    def conversation(self, rid: str, field: str = "previous_response_id") -> tuple[list[Any], Link]:
        """The prompt items that led to and came out of response `rid`, oldest first (each response's turn, along
        the chain of previous_response_id links), and the link to `rid`. 404 naming `field` when `rid` or an older
        link of its chain is no longer stored; 400 while `rid` runs in the background."""
        if rid in self._running:
            raise ApiError(f"{field}: response {rid[:80]!r} is still running in the background; continue it once it "
                           "has finished", field)  # fmt: skip
        asked, head = rid, self._read(rid)
        if head is None:
            raise not_found(rid, field)
        turns: list[bytes] = []
        size, entry = 0, head
        while True:
            turns.append(entry.turn)
            size += len(entry.turn)
            if size > MAX_CHAIN_BYTES:
                raise ApiError(f"{field}: the conversation of {asked[:80]!r} is more than {MAX_CHAIN_BYTES} bytes of "
                               "items; send what the model should read in input", field)  # fmt: skip
            if entry.previous is None:
                break
            rid, serial = entry.previous
            entry = self._read(rid)  # a use of each link: a chain in use keeps its turns
            if entry is None or entry.serial != serial:  # deleted or evicted (and its id perhaps reused)
                raise ApiError(f"{field}: the conversation continues response {rid[:80]!r}, which is no longer stored "
                               "(deleted or evicted by the store's bound)", field, 404, "not_found_error")  # fmt: skip
        items: list[Any] = []
        for turn in reversed(turns):
            items += json.loads(turn)
        return items, (asked, head.serial)


def _dumps(value: Any) -> bytes:
    # ASCII JSON, as the answers are written: a lone surrogate a client sent is escaped, not a failed encode
    return json.dumps(value, separators=(",", ":")).encode()
