"""POST /v1/messages: Anthropic's Messages API, served through the chat completions path (as vLLM serves it).

A request becomes a chat completions body: `system` as the first system message, each message's content blocks as
chat messages (`tool_use` as an assistant turn's tool calls, `tool_result` as tool messages, their text starting
"Error: " when `is_error` is true, `thinking` as the turn's reasoning), tools with their `input_schema` as function
tools, `tool_choice` in chat's spelling (any -> required), `thinking` as the template's enable_thinking (and a
thinking budget on a server with a reasoning parser). A last assistant message is continued (Anthropic's prefill).
server/messages_output.py turns the chat answer or stream back into a Message and Anthropic's stream events.

Top-level fields this server has no use for (Anthropic's platform settings, beta features a client such as Claude
Code sends) are accepted without effect, as vLLM's; inside the content, an unknown block type is a 400 naming it.
Text only: image and document blocks, and Anthropic's own server tools, are refused.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence, Union

from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from trtpaged.errors import RequestError, check_unicode, respelled
from trtpaged.server.errors import ApiError
from trtpaged.server.protocol import check_model, string_field, validated
from trtpaged.server.schemas import NullIsDefault
from trtpaged.server.tools import NOT_AUTO

log = logging.getLogger("trtpaged.server")

MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens
MAX_USER_ID_CHARS = 256  # Anthropic's longest metadata.user_id
# a tool_result with is_error: true is the tool message "Error: <its text>" (chat's tool message has no such flag, and
# no chat template reads one): the failure is in the text the model reads, under any template
TOOL_ERROR_PREFIX = "Error"
# the text that starts the system block Claude Code adds (its version and a hash of the conversation's first message),
# which Anthropic's API removes before the model reads the prompt, as vLLM does: kept, it made each conversation's
# prompt differ from its first tokens, so no two conversations shared a prefix block
ATTRIBUTION_BLOCK = "x-anthropic-billing-header"
# block types a message may hold, by role; an assistant's thinking is its reasoning, redacted thinking is dropped
_USER_BLOCKS = ("text", "tool_result")
_ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")
_MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")
# a chat field's name in a refusal -> the Messages field the client sent
_MESSAGES_NAMES = {"max_completion_tokens": "max_tokens", "max_tokens": "max_tokens", "stop": "stop_sequences",
                   "thinking_token_budget": "thinking",
                   "chat_template_kwargs": "thinking"}  # fmt: skip
# chat's spellings in a refusal's text -> the Messages API's, outside the quoted values the client sent
_CHAT_SPELLINGS = ((re.compile(r"\bmax_completion_tokens\b"), "max_tokens"), (re.compile(r"\bstop\b(?=:)"),
                   "stop_sequences"), (re.compile(r"\bthinking_token_budget\b"), "thinking.budget_tokens"),
                   (re.compile(r"\b(tools\[\d+\])\.function\.parameters\b"), r"\1.input_schema"),
                   (re.compile(r"\b(tools\[\d+\])\.function\."), r"\1."),
                   (re.compile(r", or set truncate_prompt_tokens"), ""))  # fmt: skip (a field this API has not)
_NOT_AUTO = "{'type': 'any'}, {'type': 'none'} or {'type': 'tool', 'name': ...}"  # chat's NOT_AUTO here
_CHAT_FORMAT = re.compile(r"\bresponse_format(\.json_schema)?\b")  # -> the field the request's format came in
_warned: set[str] = set()  # top-level fields without effect already named in the log
_MAX_WARNED = 256  # names remembered (then no more are logged)


class _Loose(NullIsDefault):
    model_config = ConfigDict(extra="allow")


class ThinkingConfig(_Loose):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[StrictInt] = None


class Metadata(_Loose):
    """A request's metadata: accepted without effect, but typed as Anthropic's (a client's mistake is told)."""

    user_id: Optional[StrictStr] = Field(None, max_length=MAX_USER_ID_CHARS)


class MessagesRequest(_Loose):
    """POST /v1/messages (and, less max_tokens, /v1/messages/count_tokens). Unknown top-level fields are kept
    (pydantic's extra) and named once in the log."""

    model: StrictStr
    messages: list[Any] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None  # required by /v1/messages, checked there
    system: Optional[Union[StrictStr, list[Any]]] = None
    stop_sequences: Optional[list[StrictStr]] = None
    stream: StrictBool = False
    temperature: Optional[Union[StrictFloat, StrictInt]] = None
    top_p: Optional[Union[StrictFloat, StrictInt]] = None
    top_k: Optional[StrictInt] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[ThinkingConfig] = None
    output_config: Optional[dict[str, Any]] = None  # {effort, format}
    output_format: Optional[dict[str, Any]] = None  # the structured-outputs beta's spelling of output_config.format
    metadata: Optional[Metadata] = None
    service_tier: Optional[StrictStr] = None  # accepted, without effect
    # vLLM's extras on this endpoint; seed as chat's (the same seed, the same sampled text)
    seed: Optional[StrictInt] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    cache_salt: Optional[StrictStr] = None


@dataclass
class MessagesCall:
    """One Messages request: what was asked (the answer names its model) and the chat body that serves it."""

    req: MessagesRequest
    chat_body: dict[str, Any]
    model: str
    format_field: str = "output_config.format"  # the field the output format came in (or the beta's output_format)


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def translate(body: Any, served: Sequence[str], reasoning: bool, count_only: bool = False) -> MessagesCall:
    """Validates a /v1/messages body and makes its chat completions body; ApiError naming the Messages field.
    `served`: the served model's names (answers carry the first); `reasoning`: the server splits reasoning off
    (a thinking budget needs to know where the thinking ends); `count_only`: a count_tokens body (no max_tokens)."""
    req = validated(MessagesRequest, body)
    check_model(req.model, served)
    if (req.model_extra or {}).get("thread") is not None:
        # the message-threads beta: the server would hold the conversation and a `continue` turn sends only its new
        # messages. Accepted without effect, each later turn would be answered without its history; refused with
        # the error_code the client reads to resend the whole conversation without `thread` (the SDK's tool runner)
        raise ApiError("thread: this server holds no conversation state (message threads); send the full "
                       "conversation without `thread`", "thread",
                       details={"error_code": "thread_unsupported_request"})  # fmt: skip
    unused = sorted(set(req.model_extra or {}) - _warned)
    if unused and len(_warned) < _MAX_WARNED:  # bounded: a client may send any number of distinct names
        _warned.update(unused[: _MAX_WARNED - len(_warned)])
        log.info("/v1/messages: fields without an effect on this server, accepted: %s", ", ".join(unused)[:300])
    if not count_only:
        if req.max_tokens is None:
            raise ApiError("max_tokens: required", "max_tokens")
        if req.max_tokens < 1:
            raise ApiError(f"max_tokens: must be >= 1, got {req.max_tokens}", "max_tokens")
    chat: dict[str, Any] = {"model": req.model, "messages": _messages(req.system, req.messages)}
    if req.max_tokens is not None:
        chat["max_completion_tokens"] = req.max_tokens
    for name in ("temperature", "top_p", "top_k", "seed", "cache_salt"):
        if getattr(req, name) is not None:
            chat[name] = getattr(req, name)
    if req.stop_sequences:
        chat["stop"] = req.stop_sequences
    if req.tools:
        chat["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat.update(_tool_choice(req.tool_choice, bool(req.tools)))
    kwargs: dict[str, Any] = {}
    if req.thinking is not None:
        kwargs.update(_thinking(req.thinking, req.max_tokens, reasoning, chat, count_only))
    config = req.output_config or {}
    effort = config.get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise ApiError(f"output_config.effort: must be a string (low, medium, high, ...), got {effort!r:.40}",
                           "output_config")  # fmt: skip
        chat["reasoning_effort"] = effort
    form = config.get("format") or req.output_format
    format_field = "output_config.format" if config.get("format") or req.output_format is None else "output_format"
    if form is not None:
        chat["response_format"] = _response_format(form, format_field)
    if req.chat_template_kwargs:
        kwargs.update(req.chat_template_kwargs)  # the request's own, over what thinking set
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    if chat["messages"][-1]["role"] == "assistant":  # Anthropic's prefill: the answer continues the last turn
        chat.update(continue_final_message=True, add_generation_prompt=False)
    if req.stream and not count_only:
        chat["stream"] = True
    return MessagesCall(req, chat, served[0], format_field)


def renamed(error: ApiError, call: Optional[MessagesCall] = None) -> ApiError:
    """A refusal of the chat body, naming the Messages fields instead of the chat ones they became; `call`: the
    request (its output format's field: output_config.format, or the beta's output_format)."""
    base = re.split(r"[.\[]", error.param or "", maxsplit=1)[0]
    form = call.format_field if call is not None else "output_config.format"
    message = respelled(error.message.replace(NOT_AUTO, _NOT_AUTO), ((_CHAT_FORMAT, form), *_CHAT_SPELLINGS))
    param = form.split(".")[0] if base == "response_format" else _MESSAGES_NAMES.get(base, error.param)
    return ApiError(message, param, error.status, error.kind, error.code, error.headers, error.details,
                    error.anthropic_status, error.overflow)  # fmt: skip


def _texts_of(blocks: Any, where: str, field_name: str, system: bool = False) -> list[str]:
    """The texts of a string or a list of text blocks (a system's, a tool result's content); of a `system` (the
    request's, or a system message in the conversation, as Claude Code sends both) without Claude Code's attribution
    block (ATTRIBUTION_BLOCK) and without empty blocks, as vLLM reads them."""
    if isinstance(blocks, str):
        return [_unicode(blocks, where, field_name)]
    if not isinstance(blocks, list):
        raise ApiError(f"{where}: must be a string or a list of text blocks", field_name)
    texts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _MEDIA_BLOCKS:
            raise ApiError(f"{where}[{j}].type: {kind} blocks are not supported: this server's models read text",
                           field_name)  # fmt: skip
        if kind != "text" or not isinstance(block.get("text"), str):
            raise ApiError(f"{where}[{j}]: must be a text block ({{'type': 'text', 'text': ...}})", field_name)
        if system and (not block["text"] or block["text"].startswith(ATTRIBUTION_BLOCK)):
            continue
        texts.append(_unicode(block["text"], f"{where}[{j}].text", field_name))
    return texts


def _text_parts(texts: list[str]) -> list[dict[str, str]]:
    """A message's text blocks as chat's text parts, which the chat template gets as vLLM gives them: joined by
    newlines, or as parts to a template that loops over them (runtime.llm's content format)."""
    return [{"type": "text", "text": text} for text in texts]


def _messages(system: Any, items: list[Any]) -> list[dict[str, Any]]:
    """`system`, then the conversation, as chat messages."""
    messages: list[dict[str, Any]] = []
    if system is not None:  # its blocks run together, as vLLM joins them (Anthropic does not say how it does)
        text = "".join(_texts_of(system, "system", "system", system=True))
        if text:
            messages.append({"role": "system", "content": text})
    for i, item in enumerate(items):
        where = f"messages[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"{where}: must be an object ({{role, content}})", "messages")
        role, content = item.get("role"), item.get("content")
        if role not in ("user", "assistant", "system"):  # system: inline, as Claude Code sends it (vLLM's)
            raise ApiError(f"{where}.role: must be 'user' or 'assistant', got {str(role)[:40]!r}", "messages")
        if isinstance(content, str):
            messages.append({"role": role, "content": _unicode(content, f"{where}.content", "messages")})
        elif not isinstance(content, list) or not content:
            raise ApiError(f"{where}.content: must be a string or a non-empty list of content blocks", "messages")
        elif role == "assistant":
            messages.append(_assistant(content, where))
        elif role == "system":
            messages.append({"role": "system", "content": _text_parts(_texts_of(content, f"{where}.content",
                                                                                "messages", system=True))})  # fmt: skip
        else:
            messages.extend(_user(content, where))
    if not any(m["role"] != "system" for m in messages):
        raise ApiError("messages: must hold at least one user or assistant message", "messages")
    return messages


def _block_kind(block: Any, where: str, allowed: tuple[str, ...], role: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in _MEDIA_BLOCKS:
        raise ApiError(f"{where}.type: {kind} blocks are not supported: this server's models read text", "messages")
    if kind not in allowed:
        raise ApiError(f"{where}.type: {str(kind)[:40]!r} is not a {role} content block this server takes "
                       f"({', '.join(allowed)})", "messages")  # fmt: skip
    return kind


def _string(block: dict[str, Any], key: str, where: str) -> str:
    return _unicode(string_field(block, key, where, "messages"), f"{where}.{key}", "messages")


def _unicode(text: str, where: str, field_name: str) -> str:
    """`text`, refused here when no tokenizer can take it (a lone surrogate): the chat path's refusal would name
    the chat message it became, another number (system comes first, a tool result is a message of its own)."""
    try:
        return check_unicode(where, text)
    except RequestError as exc:
        raise ApiError(str(exc), field_name) from None


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks: each tool result a tool message (a failed one's text marked, TOOL_ERROR_PREFIX), the text
    between them a user message, in order."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if _block_kind(block, at, _USER_BLOCKS, "user") == "text":
            texts.extend(filter(None, [_string(block, "text", at)]))  # an empty block no empty line (vLLM's)
            continue
        if texts:
            out.append({"role": "user", "content": _text_parts(texts)})
            texts = []
        content = block.get("content", "")
        text = "\n".join(_texts_of(content, f"{at}.content", "messages")) if content is not None else ""  # vLLM's
        failed = block.get("is_error")
        if failed is not None and not isinstance(failed, bool):
            raise ApiError(f"{at}.is_error: must be a boolean, got {type(failed).__name__}", "messages")
        if failed:  # the template has only the tool message's text to tell a failure by (as a model reads it)
            text = f"{TOOL_ERROR_PREFIX}: {text}" if text else TOOL_ERROR_PREFIX
        out.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at), "content": text})
    if texts or not out:
        out.append({"role": "user", "content": _text_parts(texts)})
    return out


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    """An assistant turn's blocks as one chat message: its text, its tool calls, its thinking as reasoning."""
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block_kind(block, at, _ASSISTANT_BLOCKS, "assistant")
        if kind == "text":
            texts.extend(filter(None, [_string(block, "text", at)]))  # an empty block no empty line (vLLM's)
        elif kind == "thinking":
            thoughts.append(_string(block, "thinking", at))
        elif kind == "tool_use":
            arguments = block.get("input")
            arguments = {} if arguments is None else arguments  # absent or null (vLLM's reading): no arguments
            if not isinstance(arguments, dict):
                raise ApiError(f"{at}.input: must be an object (the tool's arguments)", "messages")
            calls.append({"id": _string(block, "id", at), "type": "function",
                          "function": {"name": _string(block, "name", at), "arguments": json.dumps(arguments)}})
    message: dict[str, Any] = {"role": "assistant", "content": _text_parts(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning"] = "\n\n".join(thoughts)
    return message


def _tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise ApiError(f"{where}: must be an object ({{name, description, input_schema}})", "tools")
    kind = tool.get("type")
    if kind not in (None, "custom") or "input_schema" not in tool:
        raise ApiError(f"{where}: Anthropic's server tools ({str(kind)[:40]!r}) are not run by this server; give "
                       "a custom tool ({name, description, input_schema})", "tools")  # fmt: skip
    name, schema = tool.get("name"), tool["input_schema"]
    if not isinstance(name, str):
        raise ApiError(f"{where}.name: must be a string", "tools")
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ApiError(f"{where}.input_schema: must be a JSON schema of an object ({{'type': 'object', ...}})",
                       "tools")  # fmt: skip
    function: dict[str, Any] = {"name": name}
    description = tool.get("description")
    if description is not None:  # the model reads it: one of another type is refused, not dropped unread
        if not isinstance(description, str):
            raise ApiError(f"{where}.description: must be a string, got {type(description).__name__}", "tools")
        function["description"] = _unicode(description, f"{where}.description", "tools")
    # the schema as given (vLLM passes it on; pydantic's model_json_schema writes `type` last), so a template that
    # writes a tool as JSON gets the chat request's prompt; the function's keys are ordered by tools._definition
    function["parameters"] = schema if "type" in schema else {"type": "object", **schema}
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any], has_tools: bool) -> dict[str, Any]:
    """Anthropic's tool_choice as chat's: auto, any (required), tool (a named function), none."""
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if kind == "auto" or kind == "none":
        out["tool_choice"] = kind
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise ApiError("tool_choice.name: must name a tool", "tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise ApiError(f"tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got {str(kind)[:40]!r}",
                       "tool_choice")  # fmt: skip
    if not has_tools:
        if kind in ("any", "tool"):
            raise ApiError(f"tool_choice: {kind!r} needs tools", "tool_choice")
        return {}
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise ApiError("tool_choice.disable_parallel_tool_use: must be a boolean", "tool_choice")
        out["parallel_tool_calls"] = not parallel
    return out


def _thinking(thinking: ThinkingConfig, max_tokens: Optional[int], reasoning: bool, chat: dict[str, Any],
              count_only: bool) -> dict[str, Any]:  # fmt: skip
    """Anthropic's extended thinking: the chat template's enable_thinking (Qwen3's switch; other templates ignore
    it) and, on a server that knows where the thinking ends, its budget. Returns the template variables."""
    if thinking.type == "disabled":
        return {"enable_thinking": False}
    if thinking.type == "adaptive":
        return {}
    budget = thinking.budget_tokens
    if budget is None:
        raise ApiError("thinking.budget_tokens: required with type 'enabled'", "thinking")
    if budget < MIN_THINKING_BUDGET:
        raise ApiError(f"thinking.budget_tokens: must be >= {MIN_THINKING_BUDGET}, got {budget}", "thinking")
    if not count_only and max_tokens is not None and budget >= max_tokens:
        raise ApiError(f"thinking.budget_tokens: must be less than max_tokens ({max_tokens}), got {budget}",
                       "thinking")  # fmt: skip
    if reasoning and not count_only:
        chat["thinking_token_budget"] = budget
    return {"enable_thinking": True}


def _response_format(form: Any, where: str) -> dict[str, Any]:
    if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
        raise ApiError(f"{where}: must be {{'type': 'json_schema', 'schema': {{...}}}}", "output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}
