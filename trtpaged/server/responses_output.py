"""The answers of POST /v1/responses (server/responses_api.py translates the request): a finished chat answer
as a Response object, and a chat stream as the Responses API's typed stream events (`response.created` ...
`response.completed`, `.incomplete` or `.failed`)."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Optional

from pydantic import BaseModel

from trtpaged.server.responses_api import ResponsesCall

Keep = Callable[[dict[str, Any]], bool]  # stores a finished Response; False when it could not


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
        "id": rid, "object": "response", "created_at": call.created_at, "status": status,
        "background": bool(req.background),
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": call.used.get("max_output_tokens", req.max_output_tokens),
        "max_tool_calls": req.max_tool_calls,
        "model": call.model, "output": output,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id, "reasoning": _reasoning(req),
        "service_tier": req.service_tier or "auto", "store": call.stored,
        "temperature": call.used.get("temperature", req.temperature),
        "text": _text(req.text or {}),
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice, "tools": req.tools or [],
        "top_logprobs": req.top_logprobs or 0, "top_p": call.used.get("top_p", req.top_p),
        "truncation": req.truncation or "disabled",
        "usage": usage, "user": req.user, "metadata": req.metadata or {},
        "completed_at": int(time.time()) if status == "completed" else None,
        "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier,
        # the Response spells it with an underscore, whichever spelling the request took
        "prompt_cache_retention": req.prompt_cache_retention and req.prompt_cache_retention.replace("-", "_"),
    }  # fmt: skip


def _text(asked: dict[str, Any]) -> dict[str, Any]:
    """The request's text settings, as the Response echoes them: its format (text unless given), its verbosity."""
    text = {"format": asked.get("format") or {"type": "text"}}
    if asked.get("verbosity") is not None:
        text["verbosity"] = asked["verbosity"]
    return text


def _reasoning(req: Any) -> dict[str, Any]:
    """The request's reasoning settings, as the Response echoes them."""
    asked = req.reasoning
    if asked is None:
        return {"effort": None, "summary": None}
    return {"effort": asked.effort, "summary": asked.summary or asked.generate_summary}


def cache_write_tokens(prompt_tokens: int, cached_tokens: int, block_size: int) -> int:
    """The prompt's tokens the prefix cache keeps once computed: its full blocks not found there (`block_size` 0:
    caching off)."""
    return max(0, prompt_tokens // block_size * block_size - cached_tokens) if block_size else 0


def usage_of(prompt_tokens: int, output_tokens: int, cached_tokens: int, block_size: int,
             reasoning_tokens: int = 0) -> dict[str, Any]:  # fmt: skip
    """The Response's usage. `block_size`: the prefix cache's (0: caching off), whose full prompt blocks not found
    in the cache are written to it once computed (cache_write_tokens); `reasoning_tokens`: the output's reasoning
    (a server with a reasoning parser)."""
    written = cache_write_tokens(prompt_tokens, cached_tokens, block_size)
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": written},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}  # fmt: skip


_ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_item(item: dict[str, Any], key: str) -> dict[str, Any]:
    """A stored prompt item as the input_items list shows it: an id (a hash of `key`, the same at every read), a
    status (a message's own, else completed), a message's text as parts (input_text, or output_text for the
    assistant's, with no annotations) and a reasoning item's summary (none: its text is kept as its content), the
    fields OpenAI's listed item types require."""
    kind = item.get("type", "message")
    out = {"id": f"{_ITEM_PREFIXES.get(kind, 'item')}_{hashlib.blake2b(key.encode(), digest_size=16).hexdigest()}",
           **item}  # fmt: skip
    if kind == "message":
        part = "output_text" if item["role"] == "assistant" else "input_text"
        content = item["content"]
        parts = [{"type": part, "text": content}] if isinstance(content, str) else content
        out["content"] = [{**p, "annotations": []} if p["type"] == "output_text" else p for p in parts]
    elif kind == "reasoning":
        out.setdefault("summary", [])
    out.setdefault("status", "completed")
    return out


def _text_item(text: str, logprobs: Optional[list], status: str) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": _item_id("msg"), "type": "message", "status": status, "role": "assistant", "content": [part]}


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    """A reasoning model's thinking (a server with a reasoning parser), as vLLM writes it: its text, no summary."""
    return {"id": _item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None, "status": status}


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


def response_body(call: ResponsesCall, rid: str, chat_answer: BaseModel, usage: dict[str, Any],
                  reasoning_span: int = 0) -> dict[str, Any]:  # fmt: skip
    """The Response object `rid` of a finished chat answer (one choice): its reasoning, its text, then its calls;
    cut by max_output_tokens, the last item is incomplete; cut by a cancel (finish_reason "abort"), the Response is
    cancelled with the output so far, its last item incomplete (as a cancelled stream ends). `reasoning_span`: the
    answer's first tokens that were its reasoning's (their log-probs are not the message's)."""
    answer = chat_answer.model_dump(mode="json")
    (choice,) = answer["choices"]
    message = choice["message"]
    status = {"length": "incomplete", "abort": "cancelled"}.get(choice["finish_reason"], "completed")
    calls = message.get("tool_calls") or []
    output = [_reasoning_item(message["reasoning"], "completed")] if message.get("reasoning") else []
    # an empty answer is one empty message; a cancelled one that wrote nothing yet has none, as its stream
    if message.get("content") or not (calls or output or status == "cancelled"):
        text = message.get("content") or ""
        # the message's tokens follow the reasoning's (a reasoning item carries no log-probs)
        entries = ((choice.get("logprobs") or {}).get("content") or [])[reasoning_span:]
        logprobs = (_text_logprobs(entries, text) if calls else entries) if call.chat_body.get("logprobs") else None
        output.append(_text_item(text, logprobs, "completed"))
    for c in calls:
        output.append(_call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed"))
    if output:
        output[-1]["status"] = "completed" if status == "completed" else "incomplete"
    return envelope(call, rid, status, output, usage)


class EventStream:
    """Chat completion chunks (as the chat stream sends them) -> the Responses API's stream events. Items come one
    after another, each finished before the next is added, as OpenAI streams them."""

    def __init__(self, call: ResponsesCall, rid: str, keep: Optional[Keep] = None) -> None:
        """`keep`: stores the final Response (a server with a Responses store), False when it could not."""
        self.call, self.rid, self.keep = call, rid, keep
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items in output order, as they are so far
        self.open: Optional[int] = None  # the output index of the item being written, if any
        self.call_index: dict[int, int] = {}  # chat tool-call index -> output index
        self.finish_reason: Optional[str] = None
        self.want_logprobs = bool(call.chat_body.get("logprobs"))
        self.pending: list[dict[str, Any]] = []  # log-probs of tokens with no text yet (a cut character)
        self.queued = bool(call.req.background)  # a background response is queued until a step computed it

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        # ASCII JSON: a lone surrogate a client sent (echoed in the Response) is escaped, not a failed write
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def start(self) -> list[bytes]:
        """The stream's first events: response.created and .in_progress, or for a background response (queued
        until it runs, as GET says) response.created and .queued, .in_progress following once it runs (`begun`)."""
        if self.queued:
            head = envelope(self.call, self.rid, "queued", [])
            return [self.event("response.created", response=head), self.event("response.queued", response=head)]
        head = envelope(self.call, self.rid, "in_progress", [])
        return [self.event("response.created", response=head), self.event("response.in_progress", response=head)]

    def begun(self) -> list[bytes]:
        """response.in_progress of a queued background response, once, before its first output's events."""
        if not self.queued:
            return []
        self.queued = False
        return [self.event("response.in_progress", response=envelope(self.call, self.rid, "in_progress", []))]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        choices = chunk.get("choices") or ()
        events = self.begun() if any(_news(choice) for choice in choices) else []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._reasoning(delta["reasoning"])
            text = delta.get("content") or ""
            logprobs = ((choice.get("logprobs") or {}).get("content") or []) if self.want_logprobs else []
            if "reasoning" in delta:  # the reasoning's tokens (its tags' too): a reasoning item has no log-probs
                logprobs = []
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

    def _open_text(self) -> list[bytes]:
        """Adds an empty message item and its text part, unless a message is being written."""
        if self.open is not None and self.output[self.open]["type"] == "message":
            return []
        item = _text_item("", [] if self.want_logprobs else None, "in_progress")
        events = self._add(item, {**item, "content": []})
        events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.open,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[bytes]:
        events = self._open_text()
        item = self.output[self.open]
        part = item["content"][0]
        part["text"] += text
        if self.want_logprobs:
            part["logprobs"] += logprobs
        events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self.open,
                                 content_index=0, delta=text, logprobs=logprobs))  # fmt: skip
        return events

    def _reasoning(self, text: str) -> list[bytes]:
        """The next piece of the reasoning item (added, with its text part, at its first piece)."""
        events: list[bytes] = []
        if self.open is None or self.output[self.open]["type"] != "reasoning":
            item = _reasoning_item("", "in_progress")
            events += self._add(item, {**item, "content": []})
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.open,
                                     content_index=0, part={"type": "reasoning_text", "text": ""}))  # fmt: skip
        item = self.output[self.open]
        item["content"][0]["text"] += text
        events.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=self.open,
                                 content_index=0, delta=text))  # fmt: skip
        return events

    def _flush_pending(self) -> list[bytes]:
        """Tokens after the last text that wrote none (a stop string's, held back; a character cut by the end): the
        message's, as in the body, sent in a last delta without text so that the deltas' log-probs add up to the
        done event's."""
        if not (self.pending and self.open is not None and self.output[self.open]["type"] == "message"):
            return []
        events = self._text("", self.pending)
        self.pending = []
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
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=out,
                                     content_index=0, text=part["text"]))  # fmt: skip
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
        events = self.begun()  # it ran (an answer whose outputs made no event: an empty one)
        if not self.output:  # an empty answer is one empty message, as the non-streamed body has
            events += self._open_text()
        events += self._flush_pending()
        events += self._finish_open(status)
        events.append(self.event(f"response.{status}", response=self._kept(envelope(self.call, self.rid, status,
                                                                                    self.output, usage))))
        return events

    def _kept(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.keep is not None:
            body["store"] = self.keep(body)
        return body

    def failed(self, error: dict[str, Any], usage: Optional[dict[str, Any]] = None) -> list[bytes]:
        """A failure after the stream began (the engine failed, the request timed out): the item being written
        ends incomplete, then response.failed, with OpenAI's code for the server's failures (chat's error types
        are no Responses code) and `usage`, the tokens spent until then."""
        events = self._flush_pending()
        events += self._finish_open("incomplete")
        body = envelope(self.call, self.rid, "failed", self.output, usage,
                        error={"code": "server_error", "message": str(error.get("message", ""))})  # fmt: skip
        events.append(self.event("response.failed", response=self._kept(body)))
        return events

    def cancelled(self, usage: dict[str, Any]) -> list[bytes]:
        """A background stream cancelled (POST /v1/responses/{id}/cancel): the item being written ends incomplete,
        then response.incomplete (the Responses stream has no cancelled event; its response says status
        "cancelled", as GET then returns it) with the output so far and `usage`, the tokens spent until then."""
        events = self.start() if self.sequence == 0 else []  # cancelled before its first event
        events += self._flush_pending()
        events += self._finish_open("incomplete")
        body = envelope(self.call, self.rid, "cancelled", self.output, usage)
        events.append(self.event("response.incomplete", response=self._kept(body)))
        return events


def _news(choice: dict[str, Any]) -> bool:
    """Whether a chat chunk's choice carries an output (the role chunk that opens a stream carries none)."""
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning") or delta.get("tool_calls") or choice.get("logprobs")
                or choice.get("finish_reason"))  # fmt: skip


def chat_events(raw: bytes) -> list[Any]:
    """The JSON payloads of the chat stream's Server-Sent Events in `raw` ("[DONE]" left out)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: ") and block[6:] != "[DONE]":
            out.append(json.loads(block[6:]))
    return out


async def stream(call: ResponsesCall, rid: str, chat_stream: AsyncIterator[bytes], summary: Any,
                 block_size: int, keep: Optional[Keep] = None,
                 events: Optional[EventStream] = None) -> AsyncIterator[bytes]:  # fmt: skip
    """The Responses stream of one chat stream; `summary` (the request's Summary) holds the usage at its end;
    `block_size`: the prefix cache's (0: off); `keep` stores the final Response (EventStream's); `events`: the
    EventStream to write with (a caller that ends a cancelled stream reads its state), else a new one."""
    events = events if events is not None else EventStream(call, rid, keep)
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
                    spent = usage_of(summary.prompt_tokens, summary.completion_tokens, summary.cached_tokens,
                                     block_size, summary.reasoning_tokens)  # fmt: skip
                    for e in events.failed(payload["error"], spent):
                        yield e
                    continue
                for e in events.chunk(payload):
                    yield e
    if not failed:
        for e in events.finish(usage_of(summary.prompt_tokens, summary.completion_tokens, summary.cached_tokens,
                                        block_size, summary.reasoning_tokens)):  # fmt: skip
            yield e
