"""The answers of POST /v1/messages (server/messages_api.py translates the request): a finished chat answer as an
Anthropic Message, a chat stream as Anthropic's stream events (message_start, content blocks, message_delta,
message_stop), and errors in Anthropic's envelope."""

from __future__ import annotations

import json
from contextlib import aclosing

import pydantic_core
from typing import Any, AsyncIterator, Optional

from pydantic import BaseModel

from trtpaged.server.errors import ApiError
from trtpaged.server.messages_api import MessagesCall, renamed
from trtpaged.server.responses_output import cache_write_tokens, chat_events

# an HTTP status -> Anthropic's error type (its SDK picks the exception by status; clients read the type)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error",
                529: "overloaded_error"}  # fmt: skip


# the chat stream's error types -> their HTTP status (a failure after the stream began: an error event)
_CHAT_ERROR_STATUS = {"server_overloaded": 503, "timeout_error": 504, "invalid_request_error": 400}


def error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error envelope of a refusal or failure (the message names the field, as this server's do; a
    request longer than the model's context ends with Anthropic's sentence for it)."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    message = f"{error.message} {error.overflow.anthropic()}" if error.overflow is not None else error.message
    body: dict[str, Any] = {"type": kind, "message": message}
    if error.details:
        body["details"] = error.details
    return {"type": "error", "error": body}


def usage_of(prompt_tokens: int, output_tokens: int, cached_tokens: int, block_size: int) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt's tokens neither read from the prefix cache nor written to it
    (its full blocks not found there are written once computed; `block_size` 0: caching off)."""
    written = cache_write_tokens(prompt_tokens, cached_tokens, block_size)
    return {"input_tokens": prompt_tokens - cached_tokens - written, "output_tokens": output_tokens,
            "cache_creation_input_tokens": written, "cache_read_input_tokens": cached_tokens}  # fmt: skip


def stop_of(finish_reason: Optional[str], stop_reason: Any, called: bool) -> tuple[Optional[str], Optional[str]]:
    """(stop_reason, stop_sequence) of a chat choice's end: a stop string it met is a stop_sequence."""
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):  # before a call: a stop string met inside a call's arguments cut it short
        return "stop_sequence", stop_reason
    if called or finish_reason == "tool_calls":
        return "tool_use", None
    return ("end_turn", None) if finish_reason is not None else (None, None)


def tool_id(call_id: str) -> str:
    """A tool_use block's id from the chat call's ("call_X" -> "toolu_X")."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the tool_use block's input object: as much as reads of arguments cut by max_tokens (the
    anthropic client's reading of a stream's partial JSON, so that a whole answer and its stream agree); {} when they
    are no object."""
    try:
        value = pydantic_core.from_json(arguments, allow_partial=True) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _envelope(call: MessagesCall, mid: str, content: list[dict[str, Any]], stop: tuple[Optional[str], Optional[str]],
              usage: dict[str, int]) -> dict[str, Any]:  # fmt: skip
    return {"id": mid, "type": "message", "role": "assistant", "model": call.model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}  # fmt: skip


def message_body(call: MessagesCall, mid: str, chat_answer: BaseModel, usage: dict[str, int]) -> dict[str, Any]:
    """The Message `mid` of a finished chat answer (one choice): its thinking, its text, then its tool calls."""
    answer = chat_answer.model_dump(mode="json")
    (choice,) = answer["choices"]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for c in calls:
        fn = c["function"]
        content.append({"type": "tool_use", "id": tool_id(c["id"]), "name": fn["name"],
                        "input": tool_input(fn["arguments"])})  # fmt: skip
    return _envelope(call, mid, content, stop_of(choice["finish_reason"], choice.get("stop_reason"), bool(calls)),
                     usage)  # fmt: skip


def event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()


class EventStream:
    """Chat completion chunks (as the chat stream sends them) -> Anthropic's content block events: a block is
    opened when a delta of another kind (thinking, text, a new tool call) arrives, and the open one closed."""

    def __init__(self) -> None:
        self.index = -1  # the open block's index (-1: none yet)
        self.open: Optional[tuple[str, int]] = None  # (kind, the chat tool call's index for a tool_use block)
        self.called = False
        self.finish: tuple[Optional[str], Any] = (None, None)

    def _switch(self, kind: str, key: int, block: dict[str, Any]) -> list[bytes]:
        if self.open == (kind, key):
            return []
        out = self.close()
        self.index += 1
        self.open = (kind, key)
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                out += self._switch("thinking", 0, {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
            if delta.get("content"):
                out += self._switch("text", 0, {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for tc in delta.get("tool_calls") or []:
                fn = tc.get("function") or {}
                if tc.get("id"):
                    self.called = True
                    out += self._switch("tool_use", tc["index"], {"type": "tool_use", "id": tool_id(tc["id"]),
                                                                  "name": fn.get("name", ""), "input": {}})
                if fn.get("arguments") and self.open == ("tool_use", tc["index"]):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
            if choice.get("finish_reason") is not None:
                self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def end(self, usage: dict[str, int]) -> list[bytes]:
        reason, sequence = stop_of(self.finish[0], self.finish[1], self.called)
        return self.close() + [
            event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}),
            event("message_stop", {}),
        ]


async def stream(call: MessagesCall, mid: str, chat_stream: AsyncIterator[bytes], summary: Any, prompt_tokens: int,
                 block_size: int) -> AsyncIterator[bytes]:  # fmt: skip
    """The Messages stream of one chat stream; `summary` (the request's Summary) holds what the prefix cache held
    from the first output on (message_start goes with it) and the usage at the end; `prompt_tokens`: the prompt's
    length."""
    events = EventStream()
    failed = started = False

    def head() -> list[bytes]:
        """message_start, once: sent with the first output (then what the prefix cache held is known)."""
        nonlocal started
        if started:
            return []
        started = True
        usage = usage_of(prompt_tokens, 0, summary.cached_tokens, block_size)
        return [event("message_start", {"message": _envelope(call, mid, [], (None, None), usage)})]

    async with aclosing(chat_stream):  # a client gone closes this stream: the chat stream's close aborts the request
        async for raw in chat_stream:  # read to its end, a failure's too: the request is logged as it ended
            for payload in chat_events(raw):
                if failed:
                    continue
                if "error" in payload:  # Anthropic's mid-stream error: an error event, and the stream ends
                    failed = True
                    error = payload["error"]
                    status = _CHAT_ERROR_STATUS.get(error.get("type"), 500)
                    failure = renamed(ApiError(str(error.get("message", "")), error.get("param"), status))
                    for e in head():
                        yield e
                    yield event("error", {"error": error_body(failure)["error"]})
                    continue
                if not started and not _opening(payload):  # the chat stream's role chunk: before any output
                    continue
                for e in head() + events.chunk(payload):
                    yield e
    if not failed:
        usage = usage_of(summary.prompt_tokens, summary.completion_tokens, summary.cached_tokens, block_size)
        for e in head() + events.end(usage):
            yield e


def _opening(chunk: dict[str, Any]) -> bool:
    """Whether a chat chunk carries output (text, reasoning, calls, an end), unlike the role chunk sent first."""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning") or delta.get("tool_calls") or choice.get("finish_reason"):
            return True
    return False
