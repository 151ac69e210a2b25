"""Tool calls in generated text, read as the text arrives: one incremental parser for the JSON-based formats the
model families write (vLLM names them hermes, llama3_json, mistral, phi4_mini), and for the grammar-forced outputs
of `tool_choice: "required"` / a named function.

A `ToolCallStream` is fed the text of one choice piece by piece and returns events: `Content` (text that is not a
call), `CallStart` (a call's id and name, once its name is read and is one of the tools) and `ArgsPiece` (the next
piece of a call's arguments, their JSON text as the model wrote it). A stream sends these as OpenAI deltas; a full
response is the same events over the whole text, joined (`parse_all`), however the output ends: a call that went
out stands (a stream cannot take it back), its arguments as far as they were written, and `ok` (every call complete
JSON, nothing malformed) decides finish_reason "tool_calls". The model's own output with no call is content.

Content is the text before the first call: once a call went out, no text is content (text between or after calls, a
malformed or cut call after them), streamed and whole alike. vLLM's hermes parser answers whole so (its content is
the text before the first `<tool_call>`); its stream sent text after the calls, which a whole answer could only put
before them (a Responses answer's message item after its calls streamed, before them whole).

Formats (each from the model's own chat template and documentation):

- hermes (Qwen2, Qwen2.5, Qwen3, SmolLM3, Hermes): `<tool_call>{"name": N, "arguments": {...}}</tool_call>`,
  repeated; text before the first call is content.
- llama3_json (Llama 3.1 / 3.2 / 3.3): the whole output is `{"name": N, "parameters": {...}}` (or "arguments"),
  optionally after `<|python_tag|>`, calls separated by `;`; an output that starts otherwise is content.
- mistral (Mistral 7B v0.3 and its tokenizer generation): `[TOOL_CALLS] [{"name": N, "arguments": {...}}, ...]`.
- phi4_mini (Phi-4-mini): `functools[{"name": N, "arguments": {...}}, ...]`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Collection, Optional, Protocol, Union

_WS = " \t\r\n"


@dataclass(frozen=True)
class Format:
    """Where calls sit in the text and how a block of them is written."""

    name: str
    markers: tuple[str, ...]  # text that opens a block of calls; () : the output itself is the block
    open: str = ""  # after the marker ("[" for a JSON array)
    separator: str = ""  # between calls of one block ("" : one call per block)
    close: str = ""  # ends the block ("" : the end of the text)
    args_keys: tuple[str, ...] = ("arguments",)  # the call object's key for its arguments
    at_start_only: bool = False  # calls only when the output starts with them (after whitespace)
    python: bool = False  # a Python list of calls (server/pythonic_calls.py, which reads none of the fields above)


HERMES = Format("hermes", ("<tool_call>",), close="</tool_call>")
LLAMA3_JSON = Format("llama3_json", ("<|python_tag|>", "{"), separator=";", args_keys=("parameters", "arguments"),
                     at_start_only=True)  # fmt: skip
MISTRAL = Format("mistral", ("[TOOL_CALLS]",), open="[", separator=",", close="]")
PHI4_MINI = Format("phi4_mini", ("functools",), open="[", separator=",", close="]")
PYTHONIC = Format("pythonic", (), python=True)  # read by its own reader (call_stream): no JSON fields of its own
REQUIRED = Format("required", (), open="[", separator=",", close="]", args_keys=("parameters",))  # our grammar's form
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, PHI4_MINI, PYTHONIC)}
# vLLM's --tool-call-parser names -> the format (vLLM calls Phi-4-mini's parser phi4_mini_json)
PARSER_NAMES = {**FORMATS, "phi4_mini_json": PHI4_MINI}


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgsPiece:
    index: int
    text: str


Event = Union[Content, CallStart, ArgsPiece]


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""  # JSON text so far
    complete: bool = False

    @property
    def valid(self) -> bool:
        """Complete, and its arguments are a JSON object."""
        if not self.complete:
            return False
        try:
            return isinstance(json.loads(self.arguments, parse_constant=_not_json), dict)
        except ValueError:
            return False


def _not_json(name: str) -> None:
    """NaN, Infinity and -Infinity, which Python's json reads and JSON (RFC 8259) does not have."""
    raise ValueError(f"{name} is not JSON")


class _Malformed(Exception):
    """The text at the parser's position is not a call in the format."""


class _NeedMore(Exception):
    """The parser needs more text to decide."""


def new_call_id() -> str:
    """A tool call's id, as OpenAI writes them."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _string_end(buf: str, i: int) -> int:
    """Index just past the JSON string starting at buf[i] == '"'."""
    j = i + 1
    while j < len(buf):
        c = buf[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    raise _NeedMore


class _ValueScan:
    """Finds where one JSON value ends, resumable as text arrives (structure only; json.loads checks it after)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escape = False

    def run(self, buf: str, final: bool) -> Optional[int]:
        """The index just past the value, or None if the text so far does not finish it."""
        if self.pos == self.start and buf[self.start] not in "{[":
            if buf[self.start] == '"':
                return _string_end(buf, self.start)
            j = self.start  # a number, true, false or null: ends at a delimiter (or the end of the text)
            while j < len(buf) and buf[j] not in _WS + ",}]":
                j += 1
            if j == len(buf) and not final:
                return None
            return j
        j = self.pos
        while j < len(buf):
            c = buf[j]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = j + 1
                    return j + 1
            j += 1
        self.pos = j
        return None


class ToolCallStream:
    """One choice's text -> content and tool calls, fed piece by piece (`feed`, then `finish`)."""

    def __init__(self, fmt: Optional[Format], tools: Collection[str], named: Optional[str] = None) -> None:
        """`fmt` None with `named`: the whole text is the named function's arguments (tool_choice names it)."""
        self.fmt = fmt
        self.tools = set(tools)
        self.named = named
        self.buf = ""
        self.pos = 0  # text before pos has been turned into events
        self.calls: list[Call] = []
        self.malformed = False  # some text looked like a call and was not one: the rest is content (if no call is out)
        self.state = "start"
        self._block_start = 0  # where the current block of calls starts (its marker)
        self._obj: dict = {}
        self._held = ""  # whitespace between content and what follows it

    # ---- public -------------------------------------------------------------------------------
    def feed(self, text: str, final: bool = False) -> list[Event]:
        """Events for the text so far; `final`: no more text comes."""
        self.buf += text
        events: list[Event] = []
        try:
            while self._step(events, final):
                pass
        except _NeedMore:
            pass
        except _Malformed:
            self._fail()
            while self._step(events, final):
                pass
        return events

    def finish(self) -> list[Event]:
        """Events for what the text's end decides (held content, a last call without its closing text)."""
        events = self.feed("", final=True)
        if self.state not in ("text", "content", "after_block", "done", "done_text"):  # a call cut off
            # the calls so far stand and the cut text is no content: the grammar's call syntax never is, nor, once
            # a call went out, the cut rest of its JSON or of the next one's (a stream sent the call, then text
            # after it: the whole answer put that text first, and a client read the call's JSON as its content)
            if self._forced or self.calls:
                self.malformed, self.state, self._held = True, "done", ""
                return events
            self._fail()  # what of it did not go out as a call is content
            self._step(events, True)
        if self._held and not self.calls:
            events.append(Content(self._held))
        self._held = ""
        return events

    @property
    def _forced(self) -> bool:
        """The output is calls by the grammar (tool_choice "required" or a named function), not the model's free
        text: none of it is content."""
        return self.fmt is REQUIRED or (self.fmt is None and self.named is not None)

    @property
    def ok(self) -> bool:
        """The text was read whole as content and well-formed calls (at least one)."""
        return bool(self.calls) and not self.malformed and all(c.valid for c in self.calls)

    # ---- the machine --------------------------------------------------------------------------
    def _content(self, events: list[Event], text: str) -> None:
        if not text or self.calls:  # after a call no text is content
            return
        body = text.rstrip(_WS)
        if body:
            events.append(Content(self._held + body))
            self._held = ""
        self._held += text[len(body):]

    def _skip_ws(self) -> None:
        while self.pos < len(self.buf) and self.buf[self.pos] in _WS:
            self.pos += 1
        if self.pos == len(self.buf):
            raise _NeedMore

    def _expect(self, token: str) -> None:
        end = self.pos + len(token)
        if not token.startswith(self.buf[self.pos : end]):
            raise _Malformed
        if len(self.buf) < end:
            raise _NeedMore
        self.pos = end

    def _fail(self) -> None:
        """With no call out yet, the failing block (from its marker) is content, and so is the rest; after a call
        nothing is: the calls that went out stay."""
        self.malformed = True
        if not self.calls:
            self.pos = self._block_start
        self.state = "content"

    def _step(self, events: list[Event], final: bool) -> bool:
        """Advances one state; False when the text so far is used up."""
        state, fmt = self.state, self.fmt
        if state == "done":
            return False
        if state == "start":
            if self.named is not None:
                self.calls.append(Call(new_call_id(), self.named))
                events.append(CallStart(0, self.calls[0].id, self.named))
                self.state = "named"
            elif not fmt.markers:
                self._block_start, self.state = 0, "open"
            elif fmt.at_start_only:
                self.state = "lead"
            else:
                self.state = "text"
            return True
        if state == "named":
            piece = self.buf[self.pos :]
            if piece:
                self.calls[0].arguments += piece
                events.append(ArgsPiece(0, piece))
                self.pos = len(self.buf)
            if final:
                self.calls[0].complete = True
                self.state = "done"
            return False
        if state == "content":
            self._content(events, self.buf[self.pos :])
            self.pos = len(self.buf)
            return False
        if state == "lead":  # llama3_json: calls only at the start
            rest = self.buf[self.pos :].lstrip(_WS)
            for marker in fmt.markers:
                if rest.startswith(marker):
                    self._block_start = self.pos
                    self.pos = len(self.buf) - len(rest) + (0 if marker == "{" else len(marker))
                    self.state = "call"
                    return True
                if marker.startswith(rest) and not final:
                    raise _NeedMore
            self.state = "content"
            return True
        if state == "text":
            return self._text(events, final)
        if state == "open":
            self._skip_ws()
            self._expect(fmt.open)
            self.state = "call"
            return True
        if state == "call":
            self._skip_ws()
            self._expect("{")
            self._obj = {"name": None, "args": None, "key": None, "scan": None}
            self.state = "key"
            return True
        if state in ("key", "colon", "value", "after_value"):
            return self._object(events, final)
        if state == "after_call":
            return self._after_call(final)
        if state == "after_block":
            self.state = "text" if fmt.markers and not fmt.at_start_only else "done_text"
            return True
        if state == "done_text":  # after the last block of a format without markers: only whitespace may follow
            rest = self.buf[self.pos :]
            if rest.strip(_WS):
                raise _Malformed
            self.pos = len(self.buf)
            return False
        raise AssertionError(state)

    def _text(self, events: list[Event], final: bool) -> bool:
        rest = self.buf[self.pos :]
        found = [(rest.find(m), m) for m in self.fmt.markers if m in rest]
        if found:
            at, marker = min(found)
            self._content(events, rest[:at])
            # whitespace before a call is not content (unless the block fails: it starts the block's text)
            self._block_start = self.pos + at - len(self._held)
            self._held = ""
            self.pos += at + len(marker)
            self.state = "open"
            return True
        keep = max((k for m in self.fmt.markers for k in range(1, len(m)) if rest.endswith(m[:k])), default=0)
        if final and not self.calls:  # at the end a marker's start is text; after calls, a next call's cut start
            keep = 0
        self._content(events, rest[: len(rest) - keep])
        self.pos += len(rest) - keep
        return False

    def _object(self, events: list[Event], final: bool) -> bool:
        """One call object `{"name": ..., "arguments": {...}}`, keys in any order."""
        obj, buf = self._obj, self.buf
        if self.state == "key":
            self._skip_ws()
            if buf[self.pos] == "}" and obj["name"] is not None:
                self.pos += 1
                return self._end_call(events)
            if buf[self.pos] != '"':
                raise _Malformed
            end = _string_end(buf, self.pos)
            obj["key"] = json.loads(buf[self.pos : end])
            self.pos, self.state = end, "colon"
            return True
        if self.state == "colon":
            self._skip_ws()
            self._expect(":")
            self.state = "value"
            return True
        if self.state == "value":
            if obj["scan"] is None:
                self._skip_ws()
                obj["scan"] = _ValueScan(self.pos)
                if obj["key"] == "name":
                    if buf[self.pos] != '"':
                        raise _Malformed
                elif obj["key"] in self.fmt.args_keys and buf[self.pos] != "{":
                    raise _Malformed
            scan = obj["scan"]
            end = scan.run(buf, final)
            streaming = obj["key"] in self.fmt.args_keys and obj["name"] is not None
            if streaming:
                self._stream_args(events, buf[self.pos : end if end is not None else len(buf)])
            if end is None:
                self.pos = len(buf) if streaming else self.pos
                raise _NeedMore
            value = buf[scan.start : end]
            if obj["key"] == "name":
                name = json.loads(value)
                if name not in self.tools or obj["name"] is not None:
                    raise _Malformed
                obj["name"] = name
                self._stream_args(events, obj["args"] or "")  # the call starts; arguments written first go whole
            elif obj["key"] in self.fmt.args_keys:
                if obj["args"] is not None:
                    raise _Malformed
                obj["args"] = value
            self.pos, obj["scan"], self.state = end, None, "after_value"
            return True
        self._skip_ws()  # after_value
        c = buf[self.pos]
        if c == ",":
            self.pos, self.state = self.pos + 1, "key"
            return True
        if c == "}" and obj["name"] is not None:
            self.pos += 1
            return self._end_call(events)
        raise _Malformed

    def _stream_args(self, events: list[Event], piece: str) -> None:
        """Starts the current call (its name is known) if it has not started, then sends `piece` of its arguments."""
        if not self.calls or self.calls[-1].complete:
            self.calls.append(Call(new_call_id(), self._obj["name"]))
            events.append(CallStart(len(self.calls) - 1, self.calls[-1].id, self.calls[-1].name))
        if piece:
            self.calls[-1].arguments += piece
            events.append(ArgsPiece(len(self.calls) - 1, piece))

    def _end_call(self, events: list[Event]) -> bool:
        if self._obj["args"] is None:  # a call without arguments: an empty object
            self._obj["args"] = "{}"
            self._stream_args(events, "{}")
        elif not self.calls or self.calls[-1].complete:
            self._stream_args(events, self._obj["args"])
        self.calls[-1].complete = True
        self.state = "after_call"
        return True

    def _after_call(self, final: bool) -> bool:
        fmt = self.fmt
        try:
            self._skip_ws()
        except _NeedMore:
            if final and (not fmt.close or fmt.separator == ";"):  # a format ended by the end of the text
                self.state = "done"
            elif final:
                self.state = "after_block"  # lenient: a complete call without its closing text
            raise
        rest = self.buf[self.pos :]
        if fmt.separator and rest.startswith(fmt.separator):
            self.pos += len(fmt.separator)
            self.state = "call"
            return True
        if fmt.close:
            self._expect(fmt.close)
            self.state = "after_block"
            return True
        raise _Malformed


class CallReader(Protocol):
    """What reads one choice's calls as its text arrives: ToolCallStream, or the pythonic format's reader."""

    calls: list[Call]
    malformed: bool

    def feed(self, text: str, final: bool = False) -> list[Event]: ...

    def finish(self) -> list[Event]: ...

    @property
    def ok(self) -> bool: ...


def call_stream(fmt: Optional[Format], tools: Collection[str], named: Optional[str] = None) -> CallReader:
    """The incremental reader of `fmt` (ToolCallStream, or the pythonic format's reader, which has its interface)."""
    if fmt is not None and fmt.python:
        from trtpaged.server.pythonic_calls import PythonicCallStream

        return PythonicCallStream(tools)
    return ToolCallStream(fmt, tools, named)


def parse_all(fmt: Optional[Format], tools: Collection[str], text: str,
              named: Optional[str] = None) -> tuple[Optional[str], list[Call], bool]:  # fmt: skip
    """(content, calls, ok) of a whole output: what a stream of it sends, joined (a stream cannot take back a call
    it sent, so a call that went out stands in the whole answer too, its arguments as far as they were written,
    even when the rest does not read as calls); `ok`: the output read whole as content and well-formed calls."""
    stream = call_stream(fmt, tools, named)
    events = stream.feed(text) + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    return content or None, stream.calls, stream.ok
