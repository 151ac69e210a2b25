"""OpenAI's legacy function calling on chat completions (deprecated, still sent: openai-python's `functions=` and
`function_call=`, LiteLLM, older LangChain) as the tools it stands for.

`functions` are `tools`, `function_call` is `tool_choice` ("none", "auto" or `{"name": N}`, a named tool_choice),
a conversation's assistant `function_call` and `role: "function"` turns are `tool_calls` and tool messages. The
answer is the tools' answer renamed (server/responses.py): its first call as `message.function_call`
(`delta.function_call` in a stream), `finish_reason: "function_call"`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Union

from trtpaged.errors import respelled
from trtpaged.server.errors import ApiError
from trtpaged.server.schemas import ChatCompletionRequest, TokenizeChatRequest
from trtpaged.server.tools import NOT_AUTO

_FUNCTION_KEYS = {"name", "description", "parameters"}


@dataclass(frozen=True)
class ToolFields:
    """A chat request's tools, tool_choice and parallel_tool_calls, as given or as its legacy fields stand for."""

    tools: Optional[list[Any]]
    choice: Any
    parallel: bool
    functions: bool = False  # from `functions`: refusals name the legacy fields, the answer is `function_call`


def tool_fields(req: Union[ChatCompletionRequest, TokenizeChatRequest]) -> ToolFields:
    """The request's tool fields; its `functions` and `function_call` as tools and tool_choice (one call: the legacy
    answer carries one). Either form, not both: a 400 naming both fields."""
    given = {name: getattr(req, name, None) for name in ("tools", "tool_choice", "functions", "function_call")}
    if not req.functions and given["function_call"] in (None, "none"):  # null / [] / "none": nothing asked
        return ToolFields(req.tools, given["tool_choice"], getattr(req, "parallel_tool_calls", None) is not False)
    for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
        if given[legacy] is not None and given[current] is not None:
            raise ApiError(f"{legacy}: cannot be sent with {current} ({legacy} is the deprecated form of {current}); "
                           "send one of them", legacy)  # fmt: skip
    if not req.functions:
        raise ApiError("function_call: needs functions", "function_call")
    if given["tool_choice"] is not None:  # tools absent: tool_choice would choose among the functions
        raise ApiError("tool_choice: cannot be sent with functions; send function_call", "tool_choice")
    tools = []
    for i, fn in enumerate(req.functions):
        if not isinstance(fn, dict):
            raise ApiError(f"functions[{i}]: must be {{name, description?, parameters?}}, got {type(fn).__name__}",
                           "functions")  # fmt: skip
        extra = set(fn) - _FUNCTION_KEYS
        if extra:
            raise ApiError(f"functions[{i}]: unknown keys {sorted(extra)}", "functions")
        tools.append({"type": "function", "function": fn})
    return ToolFields(tools, _tool_choice(given["function_call"]), parallel=False, functions=True)


def _tool_choice(function_call: Any) -> Any:
    """`function_call` as a tool_choice: unset is "auto" (OpenAI's default with functions)."""
    if function_call is None or function_call in ("none", "auto"):
        return function_call or "auto"
    name = function_call.get("name") if isinstance(function_call, dict) and set(function_call) == {"name"} else None
    if not isinstance(name, str):
        raise ApiError(f"function_call: must be 'none', 'auto' or {{'name': ...}}, got {function_call!r:.80}",
                       "function_call")  # fmt: skip
    return {"type": "function", "function": {"name": name}}


# a tools refusal's wording -> the legacy fields' (outside the quoted values the client sent)
_SPELLINGS = ((re.compile(r"\btools(\[\d+\])\.function\b"), r"functions\1"), (re.compile(r"\btools\b"), "functions"),
              (re.compile(r"\btool_choice\b"), "function_call"), (re.compile(r"\btool\b"), "function"))  # fmt: skip


def renamed(error: ApiError) -> ApiError:
    """A refusal of the tools a legacy request stands for, naming its own fields (functions[0].name, not
    tools[0].function.name; function_call, not tool_choice)."""
    message = respelled(error.message.replace(NOT_AUTO, "'none' or {'name': ...}"), _SPELLINGS)
    param = {"tools": "functions", "tool_choice": "function_call"}.get(error.param or "", error.param)
    return ApiError(message, param, error.status, error.kind, error.code, error.headers)


def call_id(message_index: int) -> str:
    """The id of the call an assistant message's `function_call` becomes: the same in every request that sends the
    conversation (a stable prompt, for the prefix cache), and 9 alphanumerics (Mistral's templates require that)."""
    return f"fn{message_index:07d}"


def as_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation (protocol.chat_messages') with its legacy turns as tool turns: an assistant `function_call`
    becomes its one `tool_calls` entry, a `role: "function"` message a tool message answering the oldest call of its
    name not answered yet (its own id when none is)."""
    unanswered: dict[str, list[str]] = {}  # function name -> ids of its calls not answered yet, oldest first
    for m, message in enumerate(messages):
        call = message.pop("function_call", None)
        if call is not None:
            where = f"messages[{m}].function_call"
            if message["role"] != "assistant" or message.get("tool_calls"):
                raise ApiError(f"{where}: only an assistant message without tool_calls may carry one", "messages")
            if not (isinstance(call.get("name"), str) and isinstance(call.get("arguments"), str)) or len(call) != 2:
                raise ApiError(f"{where}: must be {{'name': string, 'arguments': string}}", "messages")
            message["tool_calls"] = [{"id": call_id(m), "type": "function", "function": dict(call)}]
            unanswered.setdefault(call["name"], []).append(call_id(m))
        elif message["role"] == "function":
            name = message.get("name")
            if not isinstance(name, str):
                raise ApiError(f"messages[{m}].name: required for a function message (the function's name)",
                               "messages")  # fmt: skip
            ids = unanswered.get(name)
            message.update(role="tool", tool_call_id=ids.pop(0) if ids else call_id(m))
            if message["content"] is None:
                message["content"] = ""
    return messages
