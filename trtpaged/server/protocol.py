"""A validated OpenAI request body -> prompts and SamplingParams fields (`GenerationRequest`).

Types and shape come from the pydantic schemas; the rules between fields that the
schemas cannot say (beam search spelling, logprobs, unsupported features) are here;
value ranges are the runtime's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, TypeVar, Union

from pydantic import BaseModel, ValidationError

from trtpaged.errors import RequestError
from trtpaged.server import constraints
from trtpaged.server.tools import AutoTools, ToolChoice, shown_tools, tool_choice
from trtpaged.server.errors import ApiError, from_runtime_error, from_validation_error
from trtpaged.server.legacy_functions import ToolFields, as_tool_messages, renamed, tool_fields
from trtpaged.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, TokenizeChatRequest

MAX_LOGPROBS = 20  # top log-probs per token a request may ask for (OpenAI's limit; the server's max_logprobs default)
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "n", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                    "spaces_between_special_tokens", "length_penalty", "min_tokens", "cache_salt",
                    "thinking_token_budget")  # fmt: skip
# a request's own chat template (real ones: 1-20 KB). Each distinct one is compiled (about 2 s of CPU for a 256 KiB
# template of short expressions) and kept in transformers' cache of 128 templates (megabytes each at this bound)
MAX_REQUEST_TEMPLATE_CHARS = 64 << 10
MAX_REQUEST_ID_CHARS = 256  # a caller's request id (the body's request_id or the X-Request-Id header)
_ASKS_NOTHING = (None, False, "", [], {}, "none")
_VLLM_ASKS_NOTHING = (None, "", [], {})
# Fields asking for what this server lacks: field -> (the values by which it asks for nothing, why it is refused
# with any other). OpenAI's moderation is refused unless null; vLLM's fields have no counterpart here.
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    **{name: (_ASKS_NOTHING, "not supported by this server")
       for name in ("suffix", "audio", "web_search_options")},
    "moderation": ((None,), "this server runs no moderation model on the input or output"),
    "guided_whitespace_pattern": (_VLLM_ASKS_NOTHING, "JSON grammars keep xgrammar's own whitespace rule here"),
    "logits_processors": (_VLLM_ASKS_NOTHING, "no custom logits processors run here"),
    "kv_transfer_params": (_VLLM_ASKS_NOTHING, "no disaggregated prefill here"),
    "vllm_xargs": (_VLLM_ASKS_NOTHING, "no custom logits processors read extra arguments here"),
    "mm_processor_kwargs": (_VLLM_ASKS_NOTHING, "the models served here read text only"),
    "media_io_kwargs": (_VLLM_ASKS_NOTHING, "the models served here read text only"),
    "prompt_embeds": (_VLLM_ASKS_NOTHING, "an engine here reads token ids (its embedding table is inside the compiled "
                      "graph): send the prompt as text or token ids"),
}  # fmt: skip
_REQUEST_TEMPLATE_REFUSED = ("a request's own chat template is not run unless the server is started with "
                             "--trust-request-chat-template (vLLM's rule), or give the server one with --chat-template")

Prompt = Union[str, list[int]]
_Body = TypeVar("_Body", bound=BaseModel)


@dataclass
class GenerationRequest:
    """A validated /v1/completions or /v1/chat/completions body."""

    chat: bool
    prompts: list[Prompt]  # completions: text or token ids, one per choice group
    messages: list[dict[str, str]]  # chat: the conversation
    sampling: dict[str, Any]  # SamplingParams fields except max_tokens
    max_tokens: Optional[int]  # None: what is left of max_seq_len after the prompt
    stream: bool
    include_usage: bool
    logprobs: Optional[int]  # top-k log-probs per token, or None
    names: dict[str, str] = field(default_factory=dict)  # runtime field -> request field, for errors
    echo: bool = False  # completions: the prompt (and its log-probs) come before the completion
    echo_only: bool = False  # echo with max_tokens 0: the prompt is scored, nothing is returned after it
    chat_echo: str = ""  # chat's echo (vLLM's): the text each answer starts with, the last message's
    prompt_logprobs: Optional[int] = None  # vLLM's prompt_logprobs field (returned in its own form)
    tools: Optional[ToolChoice] = None  # chat: the output is (or, for auto, may hold) tool calls
    # chat: the tool definitions the template shows: the request's tools, under tool_choice "none" too (vLLM's
    # default and OpenAI's meaning: the model is told of the tools and calls none)
    shown_tools: Optional[list[dict[str, Any]]] = None
    chat_options: dict[str, Any] = field(default_factory=dict)  # chat: LLM.chat_prompt's keyword options
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    truncate_prompt_tokens: Optional[int] = None  # keep the prompt's last k tokens; -1: as many as fit
    truncate_left: bool = True  # truncation_side "left" (vLLM's default): the last k; "right": the first k
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    show_reasoning: bool = True  # vLLM's include_reasoning: false leaves the split-off reasoning out
    return_token_ids: bool = False  # vLLM's: bodies and chunks carry the prompt's and the choices' token ids
    stream_interval: int = 1  # vLLM's: tokens per streamed chunk (raised to the server's --stream-interval)
    add_special_tokens: bool = True  # vLLM's: what the tokenizer adds (a BOS); default true for text, false for chat
    request_id: Optional[str] = None  # vLLM's: the caller's id for the request (the answer's id is built from it)
    priority: int = 0  # vLLM's: lower is served first (the engine refuses other than 0 unless its policy is priority)


def validated(model_type: type[_Body], body: Any) -> _Body:
    """A decoded JSON body as the endpoint's request model; a 400 naming the field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(f"body: must be a JSON object, got {type(body).__name__}", "body")
    try:
        return model_type.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def chat_form(body: Any, route: str) -> tuple[bool, Any]:
    """Whether a body of `route`, which takes a completions form (`prompt`) or a chat form (`messages`), is the
    chat form, and the body without the other form's field when that is null (a null field is one left out, as
    OpenAI and vLLM read it); a 400 naming both fields when it sends both or neither (each form refuses the other's
    field as an unknown one, which named only one of them)."""
    if not isinstance(body, dict):
        return False, body  # the form's validation refuses it
    chat = body.get("messages") is not None
    if chat == (body.get("prompt") is not None):
        raise ApiError(f"body: {route} takes a completions body (prompt) or a chat body (messages), got "
                       f"{'both' if chat else 'neither'}; send one of them", "body")  # fmt: skip
    other = "prompt" if chat else "messages"
    return chat, {k: v for k, v in body.items() if k != other} if other in body else body


def string_field(item: Mapping[str, Any], key: str, where: str, param: str) -> str:
    """`item[key]` when it is a string, else a 400 naming where it sits (`where`) and the request field (`param`)."""
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(f"{where}.{key}: must be a string, got {type(value).__name__}", param)
    return value


def check_request_id(value: Optional[str], field_name: str) -> Optional[str]:
    """A caller's request id (the body's `request_id`, the X-Request-Id header): 1 to MAX_REQUEST_ID_CHARS printable
    ASCII characters, since it goes into the answer's id, a response header and the server's log lines."""
    if value is None:
        return None
    if not 1 <= len(value) <= MAX_REQUEST_ID_CHARS:
        raise ApiError(f"{field_name}: must be 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(value)}", field_name)
    bad = next((c for c in value if not " " <= c <= "~"), None)
    if bad is not None:
        raise ApiError(f"{field_name}: must be printable ASCII characters, got {bad!r}", field_name)
    return value


def check_model(model: Optional[str], names: Sequence[str]) -> None:
    """A request's `model`, when given, must be a served name (404 otherwise, as OpenAI answers); `names`: the
    served ones (vLLM's --served-model-name a b: any of them)."""
    if model is not None and model not in names:
        listed = " or ".join(repr(n) for n in names[:4])
        raise ApiError(f"model: {model!r} does not exist; this server serves {listed}", "model", 404,
                       "not_found_error", "model_not_found")  # fmt: skip


def _token_list(ids: list[int], vocab_size: int) -> list[int]:
    if not ids:
        raise ApiError("prompt: a token-id prompt must be a non-empty array of integers", "prompt")
    return list(constraints.token_ids_in_vocab("prompt", ids, vocab_size))


def _prompts(value: Any, vocab_size: int) -> list[Prompt]:
    """`prompt`: a string, a list of token ids, or a non-empty list of either."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise ApiError("prompt: must be a string, an array of token ids, or a non-empty array of those", "prompt")
    if all(isinstance(t, int) for t in value):
        return [_token_list(value, vocab_size)]
    return [p if isinstance(p, str) else _token_list(p, vocab_size) for p in value]


_CONTENT_REQUIRED = ("system", "developer", "user", "tool")  # roles whose message OpenAI requires a content for


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation for the chat template: role and content (a text, or its text parts), plus the tool-call
    keys templates read. A role outside OpenAI's passes as vLLM passes it; one the template drops is refused when it
    renders (`llm.chat_prompt_text`)."""
    out = []
    for m, msg in enumerate(messages):
        if msg.content is None and msg.role in _CONTENT_REQUIRED:  # OpenAI requires it; only an assistant's calls
            raise ApiError(f"messages[{m}].content: required for a {msg.role} message", "messages")
        content = msg.content  # None (an assistant's calls only): no text, or no part for a template of parts
        if isinstance(content, list):  # the template gets them joined or as parts (LLM's content format)
            content = [{"type": "text", "text": _text_part(part, f"messages[{m}].content[{p}]")}
                       for p, part in enumerate(content)]  # fmt: skip
        # as the request gave them (schemas.ChatMessage types them); a legacy function_call becomes tool_calls below
        given = ("tool_calls", "tool_call_id", "name", "function_call")
        extra = {k: getattr(msg, k) for k in given if k in msg.model_fields_set}
        thought = msg.reasoning if msg.reasoning is not None else msg.reasoning_content
        if thought is not None:  # templates read either name (Qwen3's reasoning_content)
            extra.update(reasoning=thought, reasoning_content=thought)
        out.append({"role": msg.role, "content": content, **extra})
    return as_tool_messages(out)


def message_text(message: dict[str, Any]) -> str:
    """A `chat_messages` message's text: its text parts are lines of one text, as the string content format
    gives them to the template (vLLM's)."""
    content = message.get("content") or ""
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


def _text_part(part: Any, where: str) -> str:
    """A content part's text (`runtime.llm.text_part`), a 400 naming messages otherwise."""
    from trtpaged.runtime.llm import text_part  # the runtime's import, kept off this module's import time

    try:
        return text_part(part, where)
    except RequestError as e:
        raise ApiError(str(e).removeprefix("messages: "), "messages") from None


def _beam_fields(req: Union[CompletionRequest, ChatCompletionRequest], names: dict[str, str]) -> dict[str, Any]:
    """beam_width (TensorRT-LLM) or use_beam_search + best_of (vLLM, best_of defaulting to n) -> beam_width."""
    n = req.n if req.n is not None else 1
    width = req.beam_width
    if width is not None:
        field_name = "beam_width"
    elif req.use_beam_search:
        field_name, width = ("best_of", req.best_of) if req.best_of is not None else ("n", n)
        if width < 2:
            raise ApiError(f"{field_name}: beam search needs a beam width >= 2, got {width}", field_name)
    else:
        field_name, width = "n", 1
        if req.best_of is not None and req.best_of != n:
            raise ApiError(f"best_of: must equal n ({n}) unless use_beam_search is set, got {req.best_of}", "best_of")
    names["beam_width"] = field_name
    names["n/beam_width"] = field_name if width > 1 else "n"
    out: dict[str, Any] = {"beam_width": width}
    if req.early_stopping is not None:
        out["early_stopping"] = req.early_stopping
    return out


def top_k(k: int, name: str, max_logprobs: int, vocab_size: int) -> int:
    """A request's number of top log-probs, vLLM's -1 (the whole vocabulary) as that number, within the server's
    max_logprobs."""
    if k == -1:
        if vocab_size > max_logprobs:
            raise ApiError(f"{name}: -1 (the whole vocabulary, {vocab_size}) exceeds this server's max_logprobs "
                           f"({max_logprobs}; serve --max-logprobs -1 allows it)", name)  # fmt: skip
        return vocab_size
    if not 0 <= k <= max_logprobs:
        whole = " or -1 (the whole vocabulary)" if vocab_size <= max_logprobs else ""
        raise ApiError(f"{name}: must be in [0, {max_logprobs}]{whole}, got {k}", name)
    return k


def _logprobs(req: Union[CompletionRequest, ChatCompletionRequest], names: dict[str, str],
              max_logprobs: int, vocab_size: int) -> Optional[int]:  # fmt: skip
    if isinstance(req, ChatCompletionRequest):
        if not req.logprobs:
            if req.top_logprobs:  # 0 asks for nothing, as vLLM reads it (clients send it by default)
                raise ApiError("top_logprobs: needs logprobs: true", "top_logprobs")
            return None
        names["logprobs"] = "top_logprobs"
        k, name = req.top_logprobs or 0, "top_logprobs"
    else:
        k, name = req.logprobs, "logprobs"
        if k is None:
            return None
    return top_k(k, name, max_logprobs, vocab_size)


def parse_generation(body: Any, chat: bool, served_names: Sequence[str], vocab_size: int,
                     auto_tools: AutoTools = AutoTools(None, "the server was not told the model's tool-call format"),
                     max_logprobs: int = MAX_LOGPROBS,
                     template_defaults: Optional[Mapping[str, Any]] = None,
                     trust_template: bool = False) -> GenerationRequest:  # fmt: skip
    """Validates a decoded JSON body against the endpoint's schema; raises ApiError (400 or 404). `auto_tools`:
    the engine's tool-call format, for tool_choice "auto"; `max_logprobs`: the most top log-probs per token (and
    prompt token) a request may ask for; `template_defaults`: the server's chat template variables;
    `trust_template` (serve --trust-request-chat-template): a request's own chat_template is rendered, else refused."""
    req = validated(ChatCompletionRequest if chat else CompletionRequest, body)
    check_model(req.model, served_names)
    for name, (asks_nothing, why) in _REFUSED.items():
        if getattr(req, name, None) not in asks_nothing:
            raise ApiError(f"{name}: {why}", name)
    own_template = isinstance(req, ChatCompletionRequest) and req.chat_template is not None
    if own_template:
        check_request_template(req.chat_template, trust_template)  # type: ignore[union-attr]
    other = sorted(set(getattr(req, "modalities", None) or ()) - {"text"})
    if other:
        raise ApiError(f"modalities: {other} not supported by this server (text only)", "modalities")
    names: dict[str, str] = {}
    sampling = {k: getattr(req, k) for k in _SAMPLING_FIELDS if getattr(req, k) is not None}
    fields = tool_fields(req) if isinstance(req, ChatCompletionRequest) else None
    try:
        sampling.update(_constraint_fields(req, vocab_size))
        tools = _tools(fields, sampling, auto_tools) if fields is not None else None
        shown = tools.definitions if tools is not None else shown_tools(fields.tools) if fields is not None else None
    except ValueError as exc:  # StructuredOutputsParams' own checks name the request field that set it
        raise from_runtime_error(exc, names) from None
    except ApiError as exc:  # a legacy request's refusal names its own fields
        raise renamed(exc) if fields is not None and fields.functions else exc from None
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    sampling.update(stop=tuple(stop or ()), stop_token_ids=tuple(req.stop_token_ids or ()))
    sampling.update(_beam_fields(req, names))
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
        max_tokens = req.max_completion_tokens
    elif not chat and "max_tokens" not in req.model_fields_set:
        max_tokens = 16  # OpenAI's completions default when the field is absent; an explicit null: the room left
    if chat:
        names["prompt"] = "messages"
        if not own_template:  # an engine without a template: the request has no such field
            names["chat_template"] = "messages"
    include_usage, continuous_usage = _usage_options(req)
    truncate = req.truncate_prompt_tokens
    if truncate is not None and truncate < 1 and truncate != -1:
        raise ApiError(f"truncate_prompt_tokens: must be >= 1 (the prompt's last k tokens are kept) or -1 (as many "
                       f"as max_seq_len leaves beside max_tokens), got {truncate}",
                       "truncate_prompt_tokens")  # fmt: skip
    if req.stream_interval is not None and req.stream_interval < 1:
        raise ApiError(f"stream_interval: must be >= 1 (tokens per streamed chunk), got {req.stream_interval}",
                       "stream_interval")  # fmt: skip
    echo = not chat and bool(getattr(req, "echo", False))
    messages = chat_messages(req.messages) if isinstance(req, ChatCompletionRequest) else []
    logprobs = _logprobs(req, names, max_logprobs, vocab_size)
    echo_only = echo and max_tokens == 0
    if echo_only:
        max_tokens = 1  # the prompt is computed and scored in the step that samples one token, which is dropped
    prompt_k = None if req.prompt_logprobs is None else top_k(req.prompt_logprobs, "prompt_logprobs", max_logprobs,
                                                                 vocab_size)  # fmt: skip
    scored = [k for k in (prompt_k, logprobs if echo else None) if k is not None]
    if req.prompt_logprobs is not None and req.stream:
        raise ApiError("prompt_logprobs: not available with stream: true (as in vLLM); send the request without "
                       "streaming, or use echo with logprobs (completions)", "prompt_logprobs")  # fmt: skip
    if scored:
        sampling["prompt_logprobs"] = max(scored)
    return GenerationRequest(
        chat=chat,
        prompts=[] if chat else _prompts(req.prompt, vocab_size),  # type: ignore[union-attr]
        messages=messages,
        sampling=sampling,
        max_tokens=max_tokens,
        stream=bool(req.stream),
        include_usage=include_usage,
        logprobs=logprobs,
        names=names,
        echo=echo,
        echo_only=echo_only,
        chat_echo=_chat_echo(req, messages) if isinstance(req, ChatCompletionRequest) and req.echo else "",
        prompt_logprobs=prompt_k,
        tools=tools,
        shown_tools=shown,
        chat_options=chat_options(req, template_defaults, trust_template) if isinstance(req, ChatCompletionRequest)
        else {},
        continuous_usage=continuous_usage,
        truncate_prompt_tokens=truncate,
        truncate_left=req.truncation_side != "right",
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        show_reasoning=getattr(req, "include_reasoning", None) is not False,
        return_token_ids=bool(req.return_token_ids),
        stream_interval=req.stream_interval or 1,
        add_special_tokens=req.add_special_tokens,
        request_id=check_request_id(req.request_id, "request_id"),
        priority=req.priority or 0,
    )


def _chat_echo(req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
    """vLLM's chat `echo`: the last message's text, put before each answer when its role is the answer's (the
    assistant's, or with add_generation_prompt false the last message's own, as vLLM names the answer's role)."""
    last = messages[-1]
    answering = "assistant" if req.add_generation_prompt is not False else last["role"]
    return message_text(last) if last["role"] == answering else ""


def _usage_options(req: Union[CompletionRequest, ChatCompletionRequest]) -> tuple[bool, bool]:
    """(include_usage, continuous_usage) from stream_options. continuous_usage_stats (vLLM's) puts each choice's
    usage so far in every chunk; as in vLLM it comes with the closing usage chunk, include_usage unset."""
    options = req.stream_options
    if options is None:
        return False, False
    if not req.stream:
        raise ApiError("stream_options: only allowed with stream: true", "stream_options")
    continuous = bool(options.continuous_usage_stats)
    if continuous and options.include_usage is False:
        raise ApiError("stream_options: continuous_usage_stats needs include_usage (true or unset), got "
                       "include_usage: false", "stream_options")  # fmt: skip
    return bool(options.include_usage) or continuous, continuous


def check_request_template(template: Optional[str], trusted: bool) -> None:
    """Refuses a request's own chat_template unless the server trusts them (vLLM's --trust-request-chat-template),
    or one longer than MAX_REQUEST_TEMPLATE_CHARS (a real template has a few thousand; each distinct one is compiled
    and kept)."""
    if template is None:
        return
    if not trusted:
        raise ApiError(f"chat_template: {_REQUEST_TEMPLATE_REFUSED}", "chat_template")
    if not template.strip() or len(template) > MAX_REQUEST_TEMPLATE_CHARS:
        raise ApiError(f"chat_template: must be a Jinja template of 1 to {MAX_REQUEST_TEMPLATE_CHARS} characters, "
                       f"got {len(template)}", "chat_template")  # fmt: skip


def chat_options(req: Union[ChatCompletionRequest, TokenizeChatRequest],
                 template_defaults: Optional[Mapping[str, Any]] = None, trust_template: bool = False) -> dict[str, Any]:
    """LLM.chat_prompt's options from a chat body (vLLM's add_generation_prompt, continue_final_message,
    chat_template_kwargs and documents): the template variables are the server's `template_defaults`, then
    reasoning_effort (vLLM's: a template variable too; a Responses request's reasoning.effort arrives as it), then
    the request's own chat_template_kwargs, each over the one before key by key. With `trust_template`, the
    request's own chat_template (checked by check_request_template) renders it."""
    kwargs = req.chat_template_kwargs
    if kwargs is None or isinstance(kwargs, dict):  # not a mapping: refused as the request's, further on
        effort = getattr(req, "reasoning_effort", None)
        merged = {**(template_defaults or {}), **({} if effort is None else {"reasoning_effort": effort}),
                  **(kwargs or {})}  # fmt: skip
        kwargs = merged if merged or kwargs is not None else None
    options = {"add_generation_prompt": req.add_generation_prompt is not False,
               "continue_final_message": bool(req.continue_final_message),
               "template_kwargs": kwargs}  # fmt: skip
    if trust_template and req.chat_template is not None:
        options["chat_template"] = req.chat_template
    if req.documents is not None:
        options["documents"] = req.documents
    return options


def _constraint_fields(req: Union[CompletionRequest, ChatCompletionRequest], vocab_size: int) -> dict[str, Any]:
    """logit_bias, allowed_token_ids, bad_words and the output grammar as SamplingParams fields."""
    out: dict[str, Any] = {}
    bias = constraints.logit_bias(req.logit_bias, vocab_size)
    if bias:
        out["logit_bias"] = bias
    allowed = constraints.token_ids_in_vocab("allowed_token_ids", req.allowed_token_ids, vocab_size)
    if allowed is not None:
        out["allowed_token_ids"] = allowed
    if req.bad_words:
        out["bad_words"] = (req.bad_words,) if isinstance(req.bad_words, str) else tuple(req.bad_words)
    grammar = constraints.structured_outputs(req)
    if grammar is not None:
        out["structured_outputs"] = grammar
    return out


def _tools(fields: ToolFields, sampling: dict[str, Any], auto: AutoTools) -> Optional[ToolChoice]:
    """Chat tools: required / named: their grammar becomes the request's (response_format beside it is dropped,
    a structured_outputs / guided_* / structural_tag field is a 400 naming tool_choice). Auto: the model writes
    freely (a grammar field still applies) and its text keeps special tokens unless skip_special_tokens is set, since
    some formats' markers are special tokens ([TOOL_CALLS], <|python_tag|>)."""
    tools = tool_choice(fields.tools, fields.choice, auto, fields.parallel)
    if tools is None:
        return None
    if fields.functions:
        tools = dataclasses.replace(tools, functions=True)
    if tools.auto is not None:
        sampling.setdefault("skip_special_tokens", False)
        return tools
    given = sampling.get("structured_outputs")
    if given is not None and given.origin.split(".")[0] != "response_format":
        raise ApiError("tool_choice: tool calls already constrain the output; drop structured_outputs / guided_* / "
                       "structural_tag", "tool_choice")  # fmt: skip
    # response_format with a forced call (OpenAI's SDK sends both: parse(response_format=M, tools=..., tool_choice=
    # "required")): the reply is the call, leaving no text for response_format to shape; dropped, as vLLM's
    # ToolParser.adjust_request does
    sampling["structured_outputs"] = tools.grammar()
    return tools
