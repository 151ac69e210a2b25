"""uvicorn's httptools protocol with bounds on a request's head (request line and headers).

httptools buffers a header line until it ends, and uvicorn waits for a request's head without a clock: one
connection sending a 200 MB header line grew the server by 340 MB, one sending a byte a second (slowloris) or
nothing at all held its socket for as long as it liked, and enough of those take every file descriptor. Here a
head larger than `MAX_HEAD_BYTES` is answered 431, one with more than `MAX_HEADERS` headers too, and a head not
complete within `HEAD_TIMEOUT_S` of the connection opening (or of its previous answer's end) is answered 408
(a connection that sent nothing is just closed); each closes the connection. Bodies keep their own bounds
(`ServerOptions.max_body_bytes`, `body_timeout_s`), but one answered before it was read (a 401, a route that takes
none) is dropped by uvicorn as it comes: the connection is closed unless its rest arrives within `HEAD_TIMEOUT_S`
of the answer.

A request that asks to switch protocols (`Connection: Upgrade` with `Upgrade: h2c`, as `curl --http2` sends on
plain HTTP) is served over HTTP/1.1, as RFC 9110 lets a server do. httptools ends such a request at its head and
pauses, and uvicorn dropped the bytes past it: a POST was answered 400 "body: empty", and a next request on the
connection was never answered. Here a Content-Length body is read past the paused parser and handed to the app;
the answer closes the connection (the parser cannot go on). A chunked body with an Upgrade is answered 400.

An answer has a clock too. The transport keeps in memory whatever the client has not read yet (a whole body, or
a stream's chunks up to the transport's high-water mark), and uvicorn waits without a clock for the client to read:
60 connections that asked for 8 chat choices with 20 top log-probs each and read nothing held 590 MB for as long
as they stayed open (closing them does not end it: a close waits for the unsent bytes). Here a connection whose
unsent answer has not shrunk for `SEND_TIMEOUT_S` is aborted, which frees it (and ends a stream's request), as
nginx's `send_timeout` does; a client that reads, however slowly, is not cut.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 1 << 20  # bytes received while a head is incomplete (a read may hold some body bytes too)
MAX_HEADERS = 256
HEAD_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = 60.0  # seconds an answer's unsent bytes may wait without the client taking any
_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _HeadRefused(Exception):
    """Raised in a parser callback to stop the parser (httptools hands it on as a parser error, which uvicorn
    answers with `send_400_response`, where the refusal is sent instead)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class BoundedHeadProtocol(HttpToolsProtocol):
    """HttpToolsProtocol whose request heads are bounded in bytes, headers and time (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._num_headers = 0
        self._head_timer: Optional[asyncio.TimerHandle] = None
        self._refusal: Optional[_HeadRefused] = None  # raised in a parser callback, answered by send_400_response
        self._send_timer: Optional[asyncio.TimerHandle] = None  # armed while writing is paused
        self._unsent = 0  # the transport's buffered bytes when the send timer was last armed
        # after a head whose Upgrade is not taken: the bytes of its body still to come (0: all came)
        self._past_upgrade: Optional[int] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._stop_head_timer()
        self._stop_send_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm_send_timer()

    def resume_writing(self) -> None:
        self._stop_send_timer()
        super().resume_writing()

    def _arm_send_timer(self) -> None:
        self._stop_send_timer()
        self._unsent = self.transport.get_write_buffer_size()
        self._send_timer = self.loop.call_later(SEND_TIMEOUT_S, self._send_timed_out)

    def _stop_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timed_out(self) -> None:
        self._send_timer = None
        if self.transport.get_write_buffer_size() < self._unsent:  # the client took some: it gets another period
            self._arm_send_timer()
        else:  # a close would wait for the unsent bytes: abort drops them
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._past_upgrade is not None:
            self._take_past_upgrade(data)
            return
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"the request's head passed {MAX_HEAD_BYTES} bytes")
                return
        self._unset_keepalive_if_required()
        try:  # fed here rather than by uvicorn, which drops the bytes past a paused parser's offset
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade as exc:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            elif self._past_upgrade is not None:
                self._take_past_upgrade(data[exc.args[0]:])

    def _take_past_upgrade(self, data: bytes) -> None:
        """Hands `data` (bytes after the head of a request whose Upgrade is not taken) to the app as that request's
        body until its Content-Length is complete; bytes after it are dropped (the answer closes the connection)."""
        left = self._past_upgrade or 0
        if not left:
            return
        if data:
            self.on_body(data[:left])
        self._past_upgrade = max(0, left - len(data))
        if not self._past_upgrade:
            self._end_message()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > MAX_HEADERS:
            self._refusal = _HeadRefused(431, f"the request has more than {MAX_HEADERS} headers")
            raise self._refusal
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:
        if self._refusal is not None:
            self._refuse(self._refusal.status, self._refusal.message)
        else:
            super().send_400_response(msg)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self.parser.should_upgrade() and not self._should_upgrade():  # ended at its head: see the module's doc
            self.cycle.keep_alive = False
            self._past_upgrade = 0
            length = next((int(v) for k, v in self.headers if k == b"content-length" and v.isdigit()), 0)
            if any(k == b"transfer-encoding" for k, _ in self.headers):
                self._refuse(400, "Upgrade: not taken here, and a chunked body with it is not read; send the "
                                  "request without Upgrade (curl: --http1.1) or with a Content-Length")
                return
            if length:
                self._past_upgrade = length
                return
        self._end_message()

    def _end_message(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes, self._num_headers = True, 0, 0  # the next request's, if one comes
        if self._answered():  # answered before its body was read (a 401, a 404): the clock starts now
            self._start_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._answered():  # a pipelined request that uvicorn has just begun answering is running
            return
        if self._in_head:  # once the answer is out (a stream may run for minutes)
            self._start_head()
        elif self._head_timer is None:  # answered before its body was read (a 401, GET /health with a body): the
            # rest of the body, which uvicorn drops, must come within the head's time (every byte of it cancels
            # uvicorn's keep-alive timer, which the next answer alone would set again: one byte held the
            # connection for ever)
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._body_timed_out)

    def _body_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head and not self.transport.is_closing():  # its answer is out: nothing left to say
            self.transport.close()

    def _answered(self) -> bool:
        """Whether no request of this connection is being answered."""
        return self.cycle is None or self.cycle.response_complete

    def _start_head(self) -> None:
        self._in_head = True
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self._head_bytes:  # a head begun and not finished: answered
            self._refuse(408, f"the request's head did not arrive within {HEAD_TIMEOUT_S:g} s")
        else:  # nothing sent: closed as uvicorn closes an idle keep-alive connection
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answers `status` in plain text (as uvicorn answers a malformed request) and closes the connection."""
        if self.transport.is_closing():
            return
        body = message.encode("ascii")
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, _REASONS[status], len(body), body))
        self.transport.close()
