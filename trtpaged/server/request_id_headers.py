"""ASGI middleware: every HTTP answer carries an X-Request-Id (and on Anthropic's routes a `request-id`), errors and
the routes that make no answer id included, so that a client's failed call can be found in the server's log and
its proxies' as a successful one can."""

from __future__ import annotations

import uuid
from typing import Awaitable, Callable, Optional

from trtpaged.server.errors import ApiError
from trtpaged.server.protocol import check_request_id


def caller_request_id(headers: list[tuple[bytes, bytes]]) -> Optional[str]:
    """The request's own X-Request-Id when it is one the server would take (printable, 1-256 characters; a
    generation request with another is refused naming it), else None."""
    for name, value in headers:
        if name.lower() == b"x-request-id":
            try:
                return check_request_id(value.decode("latin-1"), "X-Request-Id")
            except ApiError:
                return None
    return None


class RequestIdHeaders:
    """Adds to a response that has none: X-Request-Id, the caller's (as vLLM's --enable-request-id-headers echoes
    it) or a random one; on the paths `anthropic(path)` accepts, Anthropic's `request-id` (the anthropic client's
    `_request_id` and its errors' `request_id`). Answers that made their own (a generation's id) keep them."""

    def __init__(self, app: Callable[..., Awaitable[None]], anthropic: Callable[[dict], bool]) -> None:
        self.app, self.anthropic = app, anthropic

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = caller_request_id(scope.get("headers", []))

        async def send_with_ids(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {name.lower() for name, _ in headers}
                fresh = uuid.uuid4().hex
                if b"x-request-id" not in names:
                    headers.append((b"x-request-id", (given or fresh).encode()))
                if b"request-id" not in names and self.anthropic(scope):
                    headers.append((b"request-id", (given or "req_" + fresh).encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_ids)
