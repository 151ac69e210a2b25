"""OpenAI's batch file format (vLLM's `run-batch`): requests as JSON Lines, each answered through a running server.

An input line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}`; its output
line is `{"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"}, "error":
null}`, the body being what the server answered (an error body too, with its status). A line that is not such a
request (not JSON, no custom_id, a custom_id seen before, another method or route, a stream) gets `response: null`
and `error: {"code", "message"}`. Outputs are written in the input's order.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import httpx

from trtpaged import json_input
from trtpaged.json_input import LongNumber, RepeatedField

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
MAX_CUSTOM_ID_CHARS = 512


@dataclass
class BatchLine:
    """One input line: the request to send, or why it cannot be sent."""

    number: int  # 1-based, for messages
    custom_id: Optional[str]
    url: Optional[str] = None
    body: Optional[dict[str, Any]] = None
    error: Optional[str] = None  # a line that is no request: the reason (its code is "invalid_request")


def parse_lines(lines: list[str]) -> list[BatchLine]:
    """The input file's non-blank lines as requests, each checked on its own (a bad line does not stop the rest)."""
    parsed: list[BatchLine] = []
    seen: set[str] = set()
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        parsed.append(_line(number, text, seen))
    return parsed


def _line(number: int, text: str, seen: set[str]) -> BatchLine:
    try:
        item = json_input.loads(text)  # strict as a served body is: a field given twice, NaN and Infinity are refused
    except (RepeatedField, LongNumber) as exc:  # JSON, but not what is read: each names its place
        return BatchLine(number, None, error=f"line {number}: {exc}")
    except RecursionError:
        return BatchLine(number, None, error=f"line {number}: JSON nested too deeply")
    except ValueError as exc:
        return BatchLine(number, None, error=f"line {number}: not JSON ({exc})")
    if not isinstance(item, dict):
        return BatchLine(number, None, error=f"line {number}: must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        return BatchLine(number, None, error=f"line {number}: custom_id must be a string of 1 to "
                                             f"{MAX_CUSTOM_ID_CHARS} characters")  # fmt: skip
    line = BatchLine(number, custom_id)
    if custom_id in seen:
        line.error = f"custom_id: {custom_id[:80]!r} is used by an earlier line (each must be unique)"
        return line
    seen.add(custom_id)
    method, url, body = item.get("method", "POST"), item.get("url"), item.get("body")
    if method != "POST":
        line.error = f"method: must be POST, got {str(method)[:20]!r}"
    elif url not in ROUTES:
        line.error = f"url: must be one of {', '.join(ROUTES)}, got {str(url)[:80]!r}"
    elif not isinstance(body, dict):
        line.error = "body: must be a JSON object (the request's body)"
    elif body.get("stream"):
        line.error = "body.stream: a batch request is answered whole; leave stream out"
    else:
        line.url, line.body = url, body
    return line


def _output(line: BatchLine, response: Optional[dict[str, Any]], error: Optional[dict[str, Any]]) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": response,
            "error": error}  # fmt: skip


async def _answer(client: httpx.AsyncClient, line: BatchLine, gate: asyncio.Semaphore) -> dict[str, Any]:
    if line.error is not None:
        return _output(line, None, {"code": "invalid_request", "message": line.error})
    async with gate:
        try:
            # ASCII JSON (httpx's json= writes UTF-8, and a lone surrogate a line escaped, "\ud800", failed to encode:
            # a traceback that lost the whole file); the server reads the escape as the same request would be read
            reply = await client.post(line.url, content=json.dumps(line.body).encode("ascii"),
                                      headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:  # the server went away: this line failed, not the file
            return _output(line, None, {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"})
    try:
        body = reply.json()
    except ValueError:
        body = {"error": {"message": reply.text[:2000], "type": "server_error"}}
    request_id = reply.headers.get("x-request-id") or (body.get("id") if isinstance(body, dict) else None)
    return _output(line, {"status_code": reply.status_code, "request_id": request_id, "body": body}, None)


async def run(lines: list[BatchLine], url: str, concurrency: int, headers: Optional[dict[str, str]] = None,
              done: Optional[Callable[[], None]] = None) -> list[dict[str, Any]]:  # fmt: skip
    """Each line's output, in order: its request sent to the server at `url`, at most `concurrency` at a time;
    `done` is called as each line is answered (a progress bar)."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits, headers=headers) as client:
        async def one(line: BatchLine) -> dict[str, Any]:
            out = await _answer(client, line, gate)
            if done is not None:
                done()
            return out

        return list(await asyncio.gather(*(one(line) for line in lines)))
