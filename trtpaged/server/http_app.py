"""HTTP plumbing: routing, JSON and Server-Sent-Event responses, errors as OpenAI error bodies."""

from __future__ import annotations

import json
import logging
import select
import socket
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import urlsplit

from trtpaged import __version__
from trtpaged.server.engine_loop import ClientGone, EngineFailure, EngineLoop
from trtpaged.server.generation import GenerationService, Summary
from trtpaged.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, ServerMetrics
from trtpaged.server.protocol import ApiError

log = logging.getLogger("trtpaged.server")
MAX_BODY_BYTES = 8 << 20
_GENERATION = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class HttpConnection:
    """One HTTP exchange as `generation.Connection`: JSON answers, or an event stream."""

    def __init__(self, handler: BaseHTTPRequestHandler) -> None:
        self.handler = handler
        self.streaming = False

    def disconnected(self) -> bool:
        """True once the client closed its socket (readable with nothing to read)."""
        sock = self.handler.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _write(self, data: bytes) -> None:
        try:
            self.handler.wfile.write(data)
            self.handler.wfile.flush()
        except (OSError, ValueError) as exc:
            raise ClientGone() from exc

    def send_json(self, status: int, body: Any) -> None:
        self.send_text(status, json.dumps(body), "application/json")

    def send_text(self, status: int, text: str, content_type: str) -> None:
        data = text.encode()
        h = self.handler
        h.send_response(status)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        self._write(data)

    def start_events(self) -> None:
        """Starts a Server-Sent-Events response; it ends when the connection closes."""
        h = self.handler
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True
        self.streaming = True
        self._write(b"")

    def send_event(self, data: Any) -> None:
        payload = data if isinstance(data, str) else json.dumps(data)
        self._write(f"data: {payload}\n\n".encode())

    def send_error(self, error: ApiError) -> None:
        """The error body, as JSON or (once a stream has started) as a last event."""
        if self.streaming:
            self.send_event(error.body())
            self.send_event("[DONE]")
        else:
            self.send_json(error.status, error.body())


@dataclass
class ModelCard:
    name: str
    root: str
    created: int
    max_seq_len: int


class OpenAIApp:
    """Routes requests to the generation service and the model, health and metrics endpoints."""

    def __init__(self, service: GenerationService, loop: EngineLoop, metrics: ServerMetrics, card: ModelCard) -> None:
        self.service, self.loop, self.metrics, self.card = service, loop, metrics, card
        self.routes: dict[str, tuple[str, Callable[[HttpConnection, Any], None]]] = {
            "/v1/models": ("GET", self._models),
            "/health": ("GET", self._health),
            "/metrics": ("GET", self._metrics),
            "/version": ("GET", lambda conn, _: conn.send_json(200, {"version": __version__})),
        }

    def handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        """Answers one request; nothing a client sends escapes as an exception."""
        start, conn, summary = time.monotonic(), HttpConnection(handler), Summary()
        path = urlsplit(handler.path).path.rstrip("/") or "/"
        status, note = 200, ""
        try:
            body = self._read_body(handler)
            if path in _GENERATION:
                if method != "POST":
                    raise ApiError(f"method: {path} takes POST, got {method}", "method", 405)
                self.service.handle(self._parse_json(body), _GENERATION[path], conn, summary)
            elif path in self.routes:
                allowed, fn = self.routes[path]
                if method != allowed:
                    raise ApiError(f"method: {path} takes {allowed}, got {method}", "method", 405)
                fn(conn, None)
            else:
                raise ApiError(f"path: no route {method} {path}", "path", 404, "not_found_error")
        except ApiError as exc:
            status, note = exc.status, exc.message
            self._try(conn.send_error, exc)
        except ClientGone:
            status, note = 499, "client disconnected; request aborted"
        except EngineFailure as exc:
            status, note = 500, str(exc)
            self._try(conn.send_error, ApiError(str(exc), None, 500, "server_error"))
        except Exception as exc:  # noqa: BLE001 - one request fails, the server stays up
            log.exception("%s %s failed", method, path)
            status, note = 500, f"{type(exc).__name__}: {exc}"
            self._try(conn.send_error, ApiError(f"internal error: {note}", None, 500, "server_error"))
        route = path if (path in _GENERATION or path in self.routes) else "other"
        self.metrics.observe_http(route, status)
        if path in _GENERATION or status >= 400:
            self._log(method, path, status, summary, note, time.monotonic() - start)

    # ---- plumbing ---------------------------------------------------------------------------------
    @staticmethod
    def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
        if "chunked" in (handler.headers.get("Transfer-Encoding") or "").lower():
            handler.close_connection = True
            raise ApiError("Content-Length: required (chunked request bodies are not supported)", "Content-Length", 411)
        try:
            length = int(handler.headers.get("Content-Length") or 0)
        except ValueError:
            handler.close_connection = True
            raise ApiError("Content-Length: must be an integer", "Content-Length") from None
        if length > MAX_BODY_BYTES:
            handler.close_connection = True
            raise ApiError(f"body: {length} bytes exceeds the limit ({MAX_BODY_BYTES})", "body", 413)
        return handler.rfile.read(length) if length > 0 else b""

    @staticmethod
    def _parse_json(raw: bytes) -> Any:
        try:
            return json.loads(raw, parse_constant=_reject_constant)
        except ValueError as exc:
            raise ApiError(f"body: malformed JSON: {exc}", "body") from None

    @staticmethod
    def _try(send: Callable[[ApiError], None], error: ApiError) -> None:
        try:
            send(error)
        except ClientGone:
            pass

    @staticmethod
    def _log(method: str, path: str, status: int, s: Summary, note: str, seconds: float) -> None:
        if status == 200:
            reasons = ",".join(sorted(set(s.finish_reasons))) or "-"
            log.info("%s %s 200 %s prompt=%d completion=%d finish=%s %.2fs", method, path, s.request_id,
                     s.prompt_tokens, s.completion_tokens, reasons, seconds)
        else:
            log.info("%s %s %d %s %.2fs", method, path, status, note, seconds)

    # ---- simple endpoints ---------------------------------------------------------------------
    def _models(self, conn: HttpConnection, _: Any) -> None:
        c = self.card
        model = {"id": c.name, "object": "model", "created": c.created, "owned_by": "trtpaged",
                 "root": c.root, "max_model_len": c.max_seq_len}
        conn.send_json(200, {"object": "list", "data": [model]})

    def _health(self, conn: HttpConnection, _: Any) -> None:
        alive = self.loop.alive
        conn.send_json(200 if alive else 503, {"status": "ok" if alive else "engine loop stopped"})

    def _metrics(self, conn: HttpConnection, _: Any) -> None:
        conn.send_text(200, self.metrics.render(self.loop.call(lambda e: e.stats())), METRICS_CONTENT_TYPE)


class RequestHandler(BaseHTTPRequestHandler):
    """Hands every request to the server's `OpenAIApp`; logging is the app's."""

    protocol_version = "HTTP/1.1"
    server_version = f"trtpaged/{__version__}"
    sys_version = ""
    server: "AppServer"

    def _dispatch(self) -> None:
        self.server.app.handle(self, self.command)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _dispatch

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class AppServer(ThreadingHTTPServer):
    """A threading HTTP server (one thread per connection) that carries the app."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], app: OpenAIApp) -> None:
        self.app = app
        super().__init__(address, RequestHandler)
