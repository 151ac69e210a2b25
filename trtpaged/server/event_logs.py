"""The events of background Responses created with `stream: true`, kept so that a client can read the stream again
from any point (`GET /v1/responses/{id}?stream=true&starting_after=N`, OpenAI's and vLLM's): while the response runs,
and after it ended as long as the finished logs fit their byte bound (the oldest finished out first)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import AsyncIterator, Optional


class EventLog:
    """One stream's events as sent (Server-Sent Events, in sequence-number order); readers wait for more until it is
    closed. Used from the event loop's thread only."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.size = 0
        self.closed = False
        self._changed = asyncio.Event()

    def append(self, event: bytes) -> None:
        self.events.append(event)
        self.size += len(event)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()  # the readers waiting now wake; later ones wait on a new event
        self._changed = asyncio.Event()

    async def read(self, start: int) -> AsyncIterator[bytes]:
        """The events from number `start` on, as they come, until the log is closed."""
        i = start
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.closed:
                return
            await self._changed.wait()


class EventLogs:
    """The logs by response id: open ones (their responses run) and finished ones, at most `max_bytes` of the latter
    (the oldest out first)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._open: dict[str, EventLog] = {}
        self._finished: OrderedDict[str, EventLog] = OrderedDict()
        self.finished_size = 0

    def open(self, rid: str) -> EventLog:
        self.drop(rid)
        log = self._open[rid] = EventLog()
        return log

    def close(self, rid: str) -> None:
        """Ends `rid`'s log (its readers end after its last event) and keeps it within the finished bound."""
        log = self._open.pop(rid, None)
        if log is None:
            return
        log.close()
        self._finished[rid] = log
        self.finished_size += log.size
        while self.finished_size > self.max_bytes and self._finished:
            _, oldest = self._finished.popitem(last=False)
            self.finished_size -= oldest.size

    def open_size(self) -> int:
        """Bytes of the logs of responses still running (a new background stream waits while they fill the bound)."""
        return sum(log.size for log in self._open.values())

    def get(self, rid: str) -> Optional[EventLog]:
        return self._open.get(rid) or self._finished.get(rid)

    def drop(self, rid: str) -> None:
        """Forgets a finished log (its response was deleted)."""
        log = self._finished.pop(rid, None)
        if log is not None:
            self.finished_size -= log.size
