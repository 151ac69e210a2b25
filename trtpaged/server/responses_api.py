"""POST /v1/responses: OpenAI's Responses API, served through the chat completions path.

A request becomes a chat completions body (`instructions` as the first system message, `input` items as messages,
function tools and `text.format` in chat's spelling) and is submitted as one; server/responses_output.py turns its
answer or stream back into a Response object and the Responses API's typed stream events.

A server started with a Responses store (`serve --responses-store-size`, server/responses_store.py) keeps each
Response whose `store` is not false: `previous_response_id` continues one (its conversation, less its
instructions, comes before this request's input), and `background` runs a request while the client polls it (or
reads its stream, which it may read again from any event: server/event_logs.py).
Without one, `store` is answered false and `previous_response_id` is not found. `conversation` and `prompt` (stored
conversations and prompts) are refused. Text in, text and function calls out.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from trtpaged.errors import respelled
from trtpaged.server.errors import ApiError
from trtpaged.server.protocol import MAX_LOGPROBS, check_model, string_field, top_k, validated
from trtpaged.server.responses_store import Link, ResponsesStore, not_found
from trtpaged.server.schemas import GenerationFields, ResponsesRequest
from trtpaged.server.tools import NAMED_CHOICE

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include values that name outputs this server never makes (built-in tools, images, reasoning): nothing to add
_NOTHING_TO_INCLUDE = frozenset({
    "code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", "reasoning.encrypted_content", "web_search_call.results",
    "web_search_call.action.sources",
})  # fmt: skip
# chat fields that carry over under the same name and meaning (vLLM's sampling extras among them; moderation, which
# chat refuses unless null); `store` does not: the answer says false whatever was asked
_SAME_FIELDS = (*(name for name in GenerationFields.model_fields if name != "store"), "parallel_tool_calls",
                "moderation")  # fmt: skip
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
    items: list[Any] = field(default_factory=list)  # the request's own input, as items (what a store keeps)
    conversation: list[Any] = field(default_factory=list)  # a stored conversation's items, then `items`
    link: Optional[Link] = None  # the stored response it continues (previous_response_id)
    stored: bool = False  # kept by the server's Responses store (one is on, and `store` is not false)
    # the settings the request ran with, as the Response echoes them (temperature, top_p, max_output_tokens): the
    # request's own, else the model's recommended ones or the API's defaults; set once it is submitted
    used: dict[str, Any] = field(default_factory=dict)


def translate(body: Any, served: Sequence[str], store: Optional[ResponsesStore] = None,
              max_logprobs: int = MAX_LOGPROBS, vocab_size: Optional[int] = None) -> ResponsesCall:  # fmt: skip
    """Validates a /v1/responses body and makes its chat completions body; ApiError naming the Responses field.
    `served`: the served model's names (the first is the one answers carry); `store`: the server's Responses store,
    if it keeps them (previous_response_id reads it); `max_logprobs`, `vocab_size`: the server's bound on
    top_logprobs and the model's vocabulary (-1 asks for all of it)."""
    req = validated(ResponsesRequest, body)
    check_model(req.model, served)
    served_model = served[0]
    for name in ("conversation", "prompt"):
        if getattr(req, name) is not None:
            raise ApiError(f"{name}: this server stores no conversations or prompts; send the conversation in input"
                           + (" or continue a stored response (previous_response_id)" if store else ""), name)
    stored = store is not None and req.store is not False
    if req.background and not stored:
        raise ApiError("background: needs a stored response (store not false, on a server started with "
                       "--responses-store-size)", "background")  # fmt: skip
    _check_platform_options(req)
    history: list[Any] = []
    link = None
    if req.previous_response_id is not None:
        if store is None:  # vLLM's answer without a store: not found
            raise not_found(req.previous_response_id, "previous_response_id", stores=False)
        history, link = store.conversation(req.previous_response_id)
    if req.truncation not in (None, "disabled", "auto"):
        raise ApiError(f"truncation: must be 'auto' or 'disabled', got {req.truncation[:40]!r}", "truncation")
    if req.max_tool_calls is not None and req.max_tool_calls < 0:  # a cap on built-in tool calls: none are made here
        raise ApiError(f"max_tool_calls: must be >= 0, got {req.max_tool_calls}", "max_tool_calls")
    if req.stream_options is not None and not req.stream:
        raise ApiError("stream_options: only allowed with stream: true", "stream_options")
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    conversation = history + items
    chat: dict[str, Any] = {k: getattr(req, k) for k in _SAME_FIELDS if getattr(req, k) is not None}
    chat["messages"] = _messages(req.instructions, conversation, first=-len(history))
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    chat.update(_logprobs(req, max_logprobs, vocab_size))
    if req.tools:
        chat["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None and (req.tools or req.tool_choice not in ("auto", "none")):
        # "auto" and "none" without tools are the Responses API's defaults, which an echoed Response repeats
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    response_format = _response_format(req.text)
    if response_format is not None:
        chat["response_format"] = response_format
    if _continues(conversation):  # vLLM's: a partial assistant message last is continued, not answered
        chat.update(continue_final_message=True, add_generation_prompt=False)
    if req.reasoning is not None and req.reasoning.effort is not None:  # chat's field (a template variable)
        chat["reasoning_effort"] = req.reasoning.effort
    chat["stream"] = req.stream
    return ResponsesCall(req, chat, served_model, int(time.time()), items, conversation, link, stored)


def count_request(body: Any) -> Any:
    """A POST /v1/responses/input_tokens body (OpenAI's count of a Responses request's input tokens) as the
    /v1/responses body whose prompt it counts; `personality`, a model's style preset, is refused (the models here
    have none)."""
    if not isinstance(body, dict):
        return body  # translate names what is wrong
    body = dict(body)
    if body.pop("personality", None) is not None:
        raise ApiError("personality: this model has no style presets (leave it out for the model's own style)",
                       "personality")  # fmt: skip
    return body


def _check_platform_options(req: ResponsesRequest) -> None:
    """OpenAI's options for its own platform, taken when this server does what they ask (their shape is the
    schema's), refused naming the option otherwise."""
    window = req.background_options.completion_window if req.background_options else None
    if window in ("2h", "8h"):  # a deadline, which a background response run at once meets (the discount is billing)
        if not req.background or req.stream or req.service_tier not in (None, "auto", "default"):
            raise ApiError(f"background_options.completion_window: {window!r} needs background: true, standard "
                           "processing (service_tier auto or default) and stream false", "background_options")
    if req.prompt_cache_options and req.prompt_cache_options.prewarm:
        raise ApiError("prompt_cache_options.prewarm: every request here generates its answer (the prefix cache "
                       "keeps any prompt's full blocks as it is computed)", "prompt_cache_options")  # fmt: skip
    if req.access_programs and req.access_programs.cyber not in (None, "standard"):
        raise ApiError(f"access_programs.cyber: {req.access_programs.cyber!r} is not available here (the model has "
                       "no Cyber tier: every request is served under 'standard')", "access_programs")  # fmt: skip
    if req.context_management:
        raise ApiError("context_management: this server compacts no context (truncation: 'auto' drops a long "
                       "conversation's oldest turns instead)", "context_management")  # fmt: skip
    if req.image and req.image.context_compression == "enabled":
        raise ApiError("image.context_compression: 'enabled' needs image compression; this server reads no images "
                       "(text only)", "image")  # fmt: skip


def turn(call: ResponsesCall, output: list[Any]) -> list[dict[str, Any]]:
    """What a store keeps of a Response to continue it: its input items, then its `output` items, as prompt items
    (what `_messages` reads of each: roles and texts, calls and their outputs, reasoning text, a message's status;
    no log-probs, ids or unknown keys). Both were read by `_messages` already (its own output as input)."""
    kept: list[dict[str, Any]] = []
    for item in [*call.items, *output]:
        kind = item.get("type", "message")
        if kind == "message":
            message = {"type": "message", "role": item["role"], "content": _prompt_content(item["content"])}
            if isinstance(item.get("status"), str):  # a cut answer's: the next turn may continue it
                message["status"] = item["status"]
            kept.append(message)
        elif kind == "function_call":
            kept.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
        elif kind == "function_call_output":
            kept.append({"type": kind, "call_id": item["call_id"], "output": _prompt_content(item["output"])})
        elif kind == "reasoning":
            kept.append({"type": kind, "content": [{"type": "reasoning_text", "text": _reasoning_text(item, "")}]})
    return kept


def _prompt_content(content: Any) -> Any:
    if isinstance(content, str):
        return content
    return [{"type": p["type"], _TEXT_PARTS[p["type"]]: p[_TEXT_PARTS[p["type"]]]} for p in content]


def cut_points(call: ResponsesCall) -> list[int]:
    """Where `truncation: "auto"` may cut the conversation, oldest first: at each user message after its first
    item (the items before a cut are dropped, so that what is kept starts with a user turn)."""
    return [i for i, item in enumerate(call.conversation) if i > 0 and isinstance(item, dict)
            and item.get("type", "message") == "message" and item.get("role") == "user"]  # fmt: skip


def without_oldest(call: ResponsesCall, cut: int) -> dict[str, Any]:
    """The chat body of `call` with its conversation's items before `cut` dropped (`instructions` kept): OpenAI's
    `truncation: "auto"` for a conversation longer than the model's context."""
    return {**call.chat_body, "messages": _messages(call.req.instructions, call.conversation[cut:])}


def _continues(items: Any) -> bool:
    """Whether the input ends with an assistant message that is still being written (status in_progress or
    incomplete, as a Response cut by max_output_tokens leaves it): the answer continues it (vLLM's rule)."""
    last = items[-1] if isinstance(items, list) and items else None
    return (isinstance(last, dict) and last.get("type", "message") == "message" and last.get("role") == "assistant"
            and last.get("status") in ("in_progress", "incomplete"))  # fmt: skip


# chat's spellings in a refusal's text -> the Responses API's (a refusal of the chat body a Responses request became):
# field names, renamed outside the quoted values the client sent (chat's form of a named tool choice,
# tools.NAMED_CHOICE, is replaced by this API's before them)
_RESPONSES_SPELLINGS = (
    (re.compile(r"\b(tools\[\d+\])\.function\."), r"\1."),
    (re.compile(r"\bmessages(\[\d+\])?(\.\w+)?"), "input"),
    (re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format(\.json_schema)?\b"), "text.format"),
    (re.compile(r", or set truncate_prompt_tokens"), ""),  # no such field here
    (re.compile(r"\btool_choice\.allowed_tools\b"), "tool_choice"),  # the Responses API's allowed_tools is flat
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
    message = message.replace(NAMED_CHOICE, "{'type': 'function', 'name': ...}")
    return ApiError(respelled(message, _RESPONSES_SPELLINGS), name, error.status, error.kind, error.code,
                    error.headers)  # fmt: skip


def _messages(instructions: Optional[str], items: list[Any], first: int = 0) -> list[dict[str, Any]]:
    """instructions, then the conversation's `items` (a stored conversation's, then the request's input), as chat
    messages; `first`: the first item's number in refusals (the input's are numbered as the client sent them)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    thought: Optional[str] = None  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(items, start=first):
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
        elif kind == "reasoning":  # a reasoning model's earlier thinking: the template may show it (Qwen3's)
            text = _reasoning_text(item, where)
            thought = text if thought is None else f"{thought}\n\n{text}"  # several items: one turn's, in order
            continue
        else:
            raise ApiError(f"{where}.type: {str(kind)[:40]!r} is not supported by this server (message, "
                           "function_call, function_call_output, reasoning)", "input")  # fmt: skip
        if thought is not None and messages[-1]["role"] == "assistant":  # the turn the thinking led to
            last = messages[-1]
            last["reasoning"] = f"{last['reasoning']}\n\n{thought}" if last.get("reasoning") else thought
        thought = None
    if not any(m["role"] != "system" for m in messages):
        raise ApiError("input: must hold at least one message", "input")
    return messages


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text parts (vLLM's and this server's), else its summary's."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if not parts:
            continue
        if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == part_type for p in parts):
            raise ApiError(f"{where}.{key}: must be a list of {part_type} parts", "input")
        return "".join(_text(p, "text", f"{where}.{key}[{j}]") for j, p in enumerate(parts))
    return ""


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
    from trtpaged.runtime.llm import cache_breakpoint_error  # the runtime's import, kept off this module's import

    if not isinstance(parts, list):
        raise ApiError(f"{where}: must be a string or a list of content parts", "input")
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in _TEXT_PARTS:
            raise ApiError(f"{where}[{j}].type: {str(kind)[:40]!r} is not supported by this server (text only: "
                           f"{', '.join(_TEXT_PARTS)})", "input")  # fmt: skip
        problem = cache_breakpoint_error(part)  # a hint for OpenAI's prompt cache: checked, without effect here
        if problem is not None:
            raise ApiError(f"{where}[{j}].prompt_cache_breakpoint: {problem}", "input")
        out.append({"type": "text", "text": _text(part, _TEXT_PARTS[kind], f"{where}[{j}]")})
    return out


def _text(item: dict[str, Any], key: str, where: str) -> str:
    return string_field(item, key, where, "input")


def _logprobs(req: ResponsesRequest, max_logprobs: int, vocab_size: Optional[int]) -> dict[str, Any]:
    include = req.include or []
    for i, name in enumerate(include):
        if name != LOGPROBS_INCLUDE and name not in _NOTHING_TO_INCLUDE:
            raise ApiError(f"include[{i}]: {name[:60]!r} is not a value this server knows", "include")
    if req.top_logprobs is not None:  # in range with the include or without (was: any value taken and echoed)
        vocab = vocab_size if vocab_size is not None else max_logprobs + 1  # unknown: -1 is refused
        top_k(req.top_logprobs, "top_logprobs", max_logprobs, vocab)
    if LOGPROBS_INCLUDE not in include:  # top_logprobs alone asks for none (OpenAI's and vLLM's rule)
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
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":  # chat's spelling: its tools by function
        listed = choice.get("tools")
        tools = [_tool_choice(t) if isinstance(t, dict) and t.get("type") == "function" else t
                 for t in listed] if isinstance(listed, list) else listed  # fmt: skip
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": tools}}
    raise ApiError("tool_choice: must be 'none', 'auto', 'required', {'type': 'function', 'name': ...} or "
                   "{'type': 'allowed_tools', 'mode': ..., 'tools': [...]}", "tool_choice")  # fmt: skip


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
