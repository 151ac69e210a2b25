"""Tool calls written as a Python list of calls (vLLM's `pythonic` parser: Llama 3.2's and Gemma 3's tool templates):
`[get_weather(city="Paris", unit="C"), add(a=2, b=40)]`, keyword arguments whose values are Python literals.

An output that starts with `[` (after whitespace) is read as calls, each sent as soon as its closing parenthesis
arrives; any other output is content. A call that does not read (positional arguments, a value that is not a
literal, a tool not offered) makes the rest content, as the JSON formats' reader does (tool_parsers.ToolCallStream,
whose interface and rules this reader has): once a call went out, no text is content (after the list, or the rest
of a list that stops reading as calls). JSON's true, false and null are read as Python's True, False and None (small
models mix them).
"""

from __future__ import annotations

import ast
import json
from typing import Any, Collection

from trtpaged.server.tool_parsers import ArgsPiece, Call, CallStart, Content, Event, new_call_id

_WS = " \t\r\n"
_JSON_NAMES = {"true": True, "false": False, "null": None}
_CLOSERS = {")": "(", "]": "[", "}": "{"}


class _NotACall(Exception):
    """The text is not a call in the pythonic format."""


class PythonicCallStream:
    """One choice's text -> content and tool calls, fed piece by piece (`feed`, then `finish`)."""

    def __init__(self, tools: Collection[str]) -> None:
        self.tools = set(tools)
        self.buf = ""
        self.sent = 0  # text before it went out as events
        self.pos = 0  # where the scan resumes
        self.calls: list[Call] = []
        self.malformed = False
        self.state = "start"  # start -> list -> after | content
        self._stack: list[str] = []  # open brackets inside the list
        self._quote = ""  # the open string's quote ('"', "'", '\"\"\"' or "'''"), "" outside strings
        self._escape = False
        self._call_start = -1  # where the call being read starts (-1: between calls)

    @property
    def ok(self) -> bool:
        """The text was read whole as content and well-formed calls (at least one)."""
        return bool(self.calls) and not self.malformed

    def feed(self, text: str, final: bool = False) -> list[Event]:
        """Events for the text so far; `final`: no more text comes."""
        self.buf += text
        events: list[Event] = []
        if self.state == "start":
            rest = self.buf.lstrip(_WS)
            if not rest:
                return events
            self.state = "list" if rest[0] == "[" else "content"
            self.pos = len(self.buf) - len(rest) + 1
        if self.state == "list":
            try:
                self._scan(events, final)
            except _NotACall:
                self.malformed, self.state = True, "content"
        rest = self.buf[self.sent :]
        # after the calls, whitespace waits for text to go with (a list and its trailing newline are no content)
        if rest and (self.state == "content" or (self.state == "after" and rest.strip(_WS))):
            self._send_rest(events)
        return events

    def finish(self) -> list[Event]:
        """Events for what the text's end decides: a list cut off before its `]` leaves what did not go out as a
        call as content."""
        events = self.feed("", final=True)
        if self.state == "list":
            self.malformed, self.state = True, "content"
            self._send_rest(events)
        elif self.state == "after":
            self.sent = len(self.buf)  # trailing whitespace
        elif self.state == "start" and self.buf:  # whitespace only
            events.append(Content(self.buf))
            self.sent = len(self.buf)
        return events

    def _send_rest(self, events: list[Event]) -> None:
        """The text not sent yet, as content unless a call went out (after a call no text is content)."""
        if self.sent < len(self.buf) and not self.calls:
            events.append(Content(self.buf[self.sent :]))
        self.sent = len(self.buf)

    def _scan(self, events: list[Event], final: bool) -> None:
        buf, i = self.buf, self.pos
        while i < len(buf):
            c = buf[i]
            if c in "\"'" and (not self._quote or len(self._quote) == 3) and len(buf) - i < 3 and not final:
                break  # a string's start (one quote or three) or a long string's end: the next two characters tell
            if self._quote:
                i = self._in_string(buf, i)
                continue
            if not self._stack:  # between the list's calls
                if c in _WS or c == ",":
                    if self._call_start >= 0:  # a name not followed at once by its '(' (as vLLM's regex reads it)
                        raise _NotACall
                    i += 1
                    continue
                if c == "]":
                    if self._call_start >= 0 or not self.calls:  # a name without its arguments; a list of no calls
                        raise _NotACall
                    self.state, self.sent = "after", i + 1
                    self.pos = i + 1
                    return
                if self._call_start < 0:
                    if not (c.isalpha() or c == "_"):
                        raise _NotACall
                    self._call_start = i
                while i < len(buf) and (buf[i].isalnum() or buf[i] in "_."):  # the function's name
                    i += 1
                if i == len(buf):
                    break
                if buf[i] != "(":
                    raise _NotACall
                self._stack.append("(")
                i += 1
                continue
            if c in "\"'":
                self._quote = buf[i : i + 3] if buf[i : i + 3] == c * 3 else c
                i += len(self._quote)
            elif c in "([{":
                self._stack.append(c)
                i += 1
            elif c in _CLOSERS:
                if self._stack.pop() != _CLOSERS[c]:
                    raise _NotACall
                i += 1
                if not self._stack:
                    self._emit(buf[self._call_start : i], events)
                    self._call_start, self.sent = -1, i
            else:
                i += 1
        self.pos = i

    def _in_string(self, buf: str, i: int) -> int:
        """The scan position after buf[i] inside a string (its end, an escape, or one character)."""
        if self._escape:
            self._escape = False
            return i + 1
        if buf[i] == "\\":
            self._escape = True
            return i + 1
        if buf.startswith(self._quote, i):
            end = i + len(self._quote)
            self._quote = ""
            return end
        if len(self._quote) == 1 and buf[i] == "\n":
            raise _NotACall  # a one-quote string does not span lines
        return i + 1

    def _emit(self, text: str, events: list[Event]) -> None:
        name, arguments = read_call(text, self.tools)
        index = len(self.calls)
        call = Call(new_call_id(), name, arguments, complete=True)
        self.calls.append(call)
        events += [CallStart(index, call.id, name), ArgsPiece(index, arguments)]


def read_call(text: str, tools: Collection[str]) -> tuple[str, str]:
    """(name, JSON arguments) of one call's text `name(key=value, ...)`; _NotACall when it is not one."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise _NotACall from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise _NotACall
    if node.func.id not in tools or any(k.arg is None for k in node.keywords):
        raise _NotACall
    arguments = {k.arg: _literal(k.value) for k in node.keywords}
    try:
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError):
        raise _NotACall from None


def _literal(node: ast.AST) -> Any:
    """A Python (or JSON) literal's value, as JSON can hold it."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        keys = [_literal(k) for k in node.keys]  # type: ignore[arg-type]
        if all(isinstance(k, str) for k in keys):
            return dict(zip(keys, (_literal(v) for v in node.values)))
    raise _NotACall
