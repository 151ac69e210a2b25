"""POST /v1/responses: OpenAI's Responses API, served through the chat completions path.

A request becomes a chat completions body (`instructions` as the first system message, `input` items as messages,
function tools and `text.format` in chat's spelling), is submitted as one, and its answer or stream is turned back
into a Response object and the Responses API's typed stream events (`response.created` ... `response.completed`).

The server keeps no responses: `previous_response_id` and `conversation` are refused (send the whole conversation
in `input`), and `store` is accepted and answered false. Text in, text and function calls out.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from pydantic import BaseModel

from trtpaged.server.errors import ApiError
from trtpaged.server.protocol import check_model, validated
from trtpaged.server.schemas import ResponsesRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include values that name outputs this server never makes (built-in tools, images, reasoning): nothing to add
_NOTHING_TO_INCLUDE = frozenset({
    "code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", "reasoning.encrypted_content", "web_search_call.results",
    "web_search_call.action.sources",
})  # fmt: skip
# chat fields that carry over under the same name and meaning (vLLM's sampling extras among them)
_SAME_FIELDS = ("model", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "stop", "user", "metadata", "service_tier", "prompt_cache_key",
                "safety_identifier", "parallel_tool_calls", "cache_salt", "request_id", "structured_outputs")
# a chat field's name in a refusal -> the Responses field the client sent
_RESPONSES_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "max_tokens": "max_output_tokens", "response_format": "text.format", "logprobs": "include",
                    "top_logprobs": "top_logprobs"}  # fmt: skip
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


@dataclass
class ResponsesCall:
    """One Responses request: what was asked (echoed in the answer) and the chat body that serves it."""

    req: ResponsesRequest
    chat_body: dict[str, Any]
    model: str
    created_at: int


def translate(body: Any, served_model: str) -> ResponsesCall:
    """Validates a /v1/responses body and makes its chat completions body; ApiError naming the Responses field."""
    req = validated(ResponsesRequest, body)
    check_model(req.model, served_model)
    for name in ("previous_response_id", "conversation", "prompt"):
        if getattr(req, name) is not None:
            raise ApiError(f"{name}: this server stores no responses or prompts; send the whole conversation in "
                           "input", name)  # fmt: skip
    if req.background:
        raise ApiError("background: not supported by this server (responses are answered or streamed at once)",
                       "background")  # fmt: skip
    if req.truncation not in (None, "disabled"):
        raise ApiError("truncation: only 'disabled' is supported (an input too long for the model is refused)",
                       "truncation")  # fmt: skip
    if req.max_tool_calls is not None:
        raise ApiError("max_tool_calls: not supported by this server", "max_tool_calls")
    chat: dict[str, Any] = {k: getattr(req, k) for k in _SAME_FIELDS if getattr(req, k) is not None}
    chat["messages"] = _messages(req)
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    chat.update(_logprobs(req))
    if req.tools:
        chat["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    response_format = _response_format(req.text)
    if response_format is not None:
        chat["response_format"] = response_format
    chat["stream"] = req.stream
    return ResponsesCall(req, chat, served_model, int(time.time()))


# chat's spellings in a refusal's text -> the Responses API's (a refusal of the chat body a Responses request became)
_RESPONSES_SPELLINGS = (
    (re.compile(r"\{'type': 'function', 'function': \{'name': \.\.\.\}\}"), "{'type': 'function', 'name': ...}"),
    (re.compile(r"\b(tools\[\d+\])\.function\."), r"\1."),
    (re.compile(r"\bmessages(\[\d+\])?(\.\w+)?"), "input"),
    (re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format(\.json_schema)?\b"), "text.format"),
    (re.compile(r", or set truncate_prompt_tokens"), ""),  # no such field here
)


def renamed(error: ApiError, call: Optional[ResponsesCall] = None) -> ApiError:
    """A refusal of the chat body, naming the Responses fields instead of the chat ones they became (chat's message
    numbers are not the input's item numbers: a message is named `input`; the first is `instructions` when the
    request `call` had them)."""
    param = error.param or ""
    message = error.message
    if call is not None and call.req.instructions and re.match(r"messages\[0\](\.content)?$", param):
        return ApiError(re.sub(r"^messages\[0\](\.content)?", "instructions", message), "instructions", error.status,
                        error.kind, error.code, error.headers)  # fmt: skip
    base = re.split(r"[.\[]", param, maxsplit=1)[0]
    name = _RESPONSES_NAMES.get(base, param or None)
    for pattern, spelling in _RESPONSES_SPELLINGS:
        message = pattern.sub(spelling, message)
    return ApiError(message, name, error.status, error.kind, error.code, error.headers)


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """instructions, then the input items, as chat messages."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"{where}: must be an object (a message or a function call item)", "input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # one turn: the text an answer began with and its calls (parallel calls too) are one assistant
                # message, as the chat answer they came from was
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _parts(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where), "content": content})
        elif kind == "reasoning":
            continue  # a reasoning model's earlier thoughts: no model here reads them back
        else:
            raise ApiError(f"{where}.type: {str(kind)[:40]!r} is not supported by this server (message, "
                           "function_call, function_call_output, reasoning)", "input")  # fmt: skip
    if not any(m["role"] != "system" for m in messages):
        raise ApiError("input: must hold at least one message", "input")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise ApiError(f"{where}.role: must be one of {', '.join(_ROLES)}, got {str(role)[:40]!r}", "input")
    content = item.get("content")
    if not isinstance(content, str):
        content = _parts(content, f"{where}.content")
    return {"role": _ROLES[role], "content": content}


def _parts(parts: Any, where: str) -> list[dict[str, str]]:
    """Content parts as chat's text parts; any other kind (images, files, audio) is refused."""
    if not isinstance(parts, list):
        raise ApiError(f"{where}: must be a string or a list of content parts", "input")
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in _TEXT_PARTS:
            raise ApiError(f"{where}[{j}].type: {str(kind)[:40]!r} is not supported by this server (text only: "
                           f"{', '.join(_TEXT_PARTS)})", "input")  # fmt: skip
        out.append({"type": "text", "text": _text(part, _TEXT_PARTS[kind], f"{where}[{j}]")})
    return out


def _text(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(f"{where}.{key}: must be a string, got {type(value).__name__}", "input")
    return value


def _logprobs(req: ResponsesRequest) -> dict[str, Any]:
    include = req.include or []
    for i, name in enumerate(include):
        if name != LOGPROBS_INCLUDE and name not in _NOTHING_TO_INCLUDE:
            raise ApiError(f"include[{i}]: {name[:60]!r} is not a value this server knows", "include")
    if LOGPROBS_INCLUDE not in include and not req.top_logprobs:
        return {}
    return {"logprobs": True, "top_logprobs": req.top_logprobs or 0}


_TOOL_KEYS = ("name", "description", "parameters", "strict")


def _tool(i: int, tool: Any) -> dict[str, Any]:
    """A Responses function tool ({type, name, parameters, ...}) in chat's nested form."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise ApiError(f"tools[{i}].type: {str(kind)[:40]!r} is not supported by this server (function tools "
                       "only)", "tools")  # fmt: skip
    extra = sorted(set(tool) - {"type", *_TOOL_KEYS})
    if extra:
        raise ApiError(f"tools[{i}].{extra[0]}: unknown field of a function tool", "tools")
    return {"type": "function", "function": {k: tool[k] for k in _TOOL_KEYS if tool.get(k) is not None}}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError("tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                   "tool_choice")  # fmt: skip


_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"},
                "json_schema": {"type", "name", "schema", "description", "strict"}}  # fmt: skip
_VERBOSITY = (None, "low", "medium", "high")


def _response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """text.format as chat's response_format (None: plain text); text.verbosity is checked, without effect."""
    if not text:
        return None
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise ApiError(f"text.{extra[0]}: unknown field", "text")
    if text.get("verbosity") not in _VERBOSITY:
        raise ApiError(f"text.verbosity: must be low, medium or high, got {str(text['verbosity'])[:40]!r}", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(kind, str) or kind not in _FORMAT_KEYS:
        raise ApiError(f"text.format.type: must be text, json_object or json_schema, got {str(kind)[:40]!r}", "text")
    extra = sorted(set(fmt) - _FORMAT_KEYS[kind])
    if extra:
        raise ApiError(f"text.format.{extra[0]}: not a field of a {kind} format", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
        raise ApiError("text.format: a json_schema format needs a name (a string) and a schema (an object)", "text")
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


# ---- answers ------------------------------------------------------------------------------------
def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_id(chat_id: str) -> str:
    """The Response's id from its chat answer's ("chatcmpl-X" -> "resp_X")."""
    return "resp_" + chat_id.removeprefix("chatcmpl-")


def envelope(call: ResponsesCall, rid: str, status: str, output: list[dict[str, Any]],
             usage: Optional[dict[str, Any]] = None,
             error: Optional[dict[str, Any]] = None) -> dict[str, Any]:  # fmt: skip
    """The Response object: its state, output items, usage, and the request's settings as OpenAI echoes them."""
    req = call.req
    return {
        "id": rid, "object": "response", "created_at": call.created_at, "status": status, "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
        "model": call.model, "output": output,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
        "temperature": req.temperature, "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice, "tools": req.tools or [],
        "top_logprobs": req.top_logprobs or 0, "top_p": req.top_p, "truncation": "disabled",
        "usage": usage, "user": req.user, "metadata": req.metadata or {},
    }  # fmt: skip


def usage_of(prompt_tokens: int, output_tokens: int, cached_tokens: int, block_size: int) -> dict[str, Any]:
    """The Response's usage. `block_size`: the prefix cache's (0: caching off), whose full prompt blocks not found
    in the cache are written to it once computed (cache_write_tokens)."""
    written = max(0, prompt_tokens // block_size * block_size - cached_tokens) if block_size else 0
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": written},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}  # fmt: skip


def _text_item(text: str, logprobs: Optional[list], status: str) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": _item_id("msg"), "type": "message", "status": status, "role": "assistant", "content": [part]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": _item_id("fc"), "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}  # fmt: skip


def _text_logprobs(entries: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The log-prob entries of the tokens that wrote `text`, an answer's text before its calls: those that begin
    within its bytes (the calls' tokens follow; function_call items carry no log-probs)."""
    size, seen, kept = len(text.encode("utf-8", "surrogatepass")), 0, []
    for entry in entries:
        if seen >= size:
            break
        kept.append(entry)
        seen += len(entry.get("bytes") or b"")
    return kept


def response_body(call: ResponsesCall, chat_answer: BaseModel, usage: dict[str, Any]) -> dict[str, Any]:
    """The Response object of a finished chat answer (one choice): its text, then its calls; cut by
    max_output_tokens, the last item is incomplete."""
    answer = chat_answer.model_dump(mode="json")
    (choice,) = answer["choices"]
    message = choice["message"]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    calls = message.get("tool_calls") or []
    output = []
    if message.get("content") or not calls:
        text = message.get("content") or ""
        entries = (choice.get("logprobs") or {}).get("content") or []
        logprobs = (_text_logprobs(entries, text) if calls else entries) if call.chat_body.get("logprobs") else None
        output.append(_text_item(text, logprobs, "completed"))
    for c in calls:
        output.append(_call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed"))
    output[-1]["status"] = status
    return envelope(call, response_id(answer["id"]), status, output, usage)


class EventStream:
    """Chat completion chunks (as the chat stream sends them) -> the Responses API's stream events. Items come one
    after another, each finished before the next is added, as OpenAI streams them."""

    def __init__(self, call: ResponsesCall, rid: str) -> None:
        self.call, self.rid = call, rid
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items in output order, as they are so far
        self.open: Optional[int] = None  # the output index of the item being written, if any
        self.call_index: dict[int, int] = {}  # chat tool-call index -> output index
        self.finish_reason: Optional[str] = None
        self.want_logprobs = bool(call.chat_body.get("logprobs"))
        self.pending: list[dict[str, Any]] = []  # log-probs of tokens with no text yet (a cut character)

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        # ASCII JSON: a lone surrogate a client sent (echoed in the Response) is escaped, not a failed write
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def start(self) -> list[bytes]:
        head = envelope(self.call, self.rid, "in_progress", [])
        return [self.event("response.created", response=head), self.event("response.in_progress", response=head)]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            logprobs = ((choice.get("logprobs") or {}).get("content") or []) if self.want_logprobs else []
            if text:
                events += self._text(text, self.pending + logprobs)
                self.pending = []
            elif logprobs and not self.call_index:  # a call's tokens carry none (its item has no log-probs)
                self.pending += logprobs
            for tc in delta.get("tool_calls") or ():
                events += self._call(tc)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _add(self, item: dict[str, Any], shown: dict[str, Any]) -> list[bytes]:
        """Finishes the item being written, then adds `item` (`shown`: as the added event shows it)."""
        events = self._finish_open("completed")
        self.open = len(self.output)
        self.output.append(item)
        events.append(self.event("response.output_item.added", output_index=self.open, item=shown))
        return events

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[bytes]:
        events = []
        if self.open is None or self.output[self.open]["type"] != "message":
            item = _text_item("", [] if self.want_logprobs else None, "in_progress")
            events += self._add(item, {**item, "content": []})
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.open,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        item = self.output[self.open]
        part = item["content"][0]
        part["text"] += text
        if self.want_logprobs:
            part["logprobs"] += logprobs
        events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self.open,
                                 content_index=0, delta=text, logprobs=logprobs))  # fmt: skip
        return events

    def _call(self, tc: dict[str, Any]) -> list[bytes]:
        events = []
        index = tc.get("index", 0)
        fn = tc.get("function") or {}
        if index not in self.call_index:
            self.pending = []  # tokens before the call that wrote no text: the call's own
            item = _call_item(tc.get("id") or _item_id("call"), fn.get("name") or "", "", "in_progress")
            events += self._add(item, dict(item))
            self.call_index[index] = self.open
        out = self.call_index[index]
        item = self.output[out]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=out,
                                     delta=fn["arguments"]))  # fmt: skip
        return events

    def _finish_open(self, status: str) -> list[bytes]:
        """The done events of the item being written, with its final status."""
        if self.open is None:
            return []
        out, item = self.open, self.output[self.open]
        self.open = None
        item["status"] = status
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=out,
                                     content_index=0, text=part["text"], logprobs=part.get("logprobs") or []))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=out,
                                     content_index=0, part=part))  # fmt: skip
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=out,
                                     name=item["name"], arguments=item["arguments"]))  # fmt: skip
        events.append(self.event("response.output_item.done", output_index=out, item=item))
        return events

    def finish(self, usage: dict[str, Any]) -> list[bytes]:
        """The last item's done events (incomplete when cut at max_output_tokens), then response.completed or
        response.incomplete."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        events: list[bytes] = []
        if not self.output:  # an empty answer is one empty message, as the non-streamed body has
            item = _text_item("", [] if self.want_logprobs else None, "in_progress")
            events += self._add(item, {**item, "content": []})
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.open,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        if self.pending and self.open is not None and self.output[self.open]["type"] == "message":
            # tokens after the last text that wrote none (a stop string's, held back): the message's, as in the
            # body, sent in a last delta without text so that the deltas' log-probs add up to the done event's
            events += self._text("", self.pending)
            self.pending = []
        events += self._finish_open(status)
        events.append(self.event(f"response.{status}", response=envelope(self.call, self.rid, status, self.output,
                                                                         usage)))  # fmt: skip
        return events

    def failed(self, error: dict[str, Any]) -> list[bytes]:
        """A failure after the stream began (the engine failed, the request timed out): the item being written
        ends incomplete, then response.failed, with OpenAI's code for the server's failures (chat's error types
        are no Responses code)."""
        events = self._finish_open("incomplete")
        body = envelope(self.call, self.rid, "failed", self.output,
                        error={"code": "server_error", "message": str(error.get("message", ""))})  # fmt: skip
        events.append(self.event("response.failed", response=body))
        return events


def chat_events(raw: bytes) -> list[Any]:
    """The JSON payloads of the chat stream's Server-Sent Events in `raw` ("[DONE]" left out)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: ") and block[6:] != "[DONE]":
            out.append(json.loads(block[6:]))
    return out


async def stream(call: ResponsesCall, rid: str, chat_stream: AsyncIterator[bytes], summary: Any,
                 block_size: int) -> AsyncIterator[bytes]:  # fmt: skip
    """The Responses stream of one chat stream; `summary` (the request's Summary) holds the usage at its end;
    `block_size`: the prefix cache's (0: off)."""
    events = EventStream(call, rid)
    failed = False
    async with aclosing(chat_stream):  # a client gone closes this stream: the chat stream's close aborts the request
        for e in events.start():
            yield e
        async for raw in chat_stream:  # read to its end, a failure's too: the request is logged as it ended
            for payload in chat_events(raw):
                if failed:
                    continue
                if "error" in payload:
                    failed = True
                    for e in events.failed(payload["error"]):
                        yield e
                    continue
                for e in events.chunk(payload):
                    yield e
    if not failed:
        for e in events.finish(usage_of(summary.prompt_tokens, summary.completion_tokens, summary.cached_tokens,
                                        block_size)):  # fmt: skip
            yield e
