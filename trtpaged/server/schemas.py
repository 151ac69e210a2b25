"""Pydantic models of the OpenAI bodies the server reads and writes.

Requests check shape and JSON types (strict: "8" is not an integer, 1.5 is not an
integer, unknown fields are refused); value ranges stay with `SamplingParams` and
the scheduler, which raise the runtime's typed errors.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    computed_field,
    model_serializer,
    model_validator,
)

# A JSON number; an integer is read as a float. (A union of int and float would word a string's
# refusal as two errors, the first "should be a valid integer".)
Number = StrictFloat
TokenIds = list[StrictInt]


class NullIsDefault(BaseModel):
    """A request model that reads an explicit JSON null as the field left out, as OpenAI's API and vLLM read it
    (clients that write every parameter send null for those they do not set: LangChain, LiteLLM, Go and Java
    clients): a field whose default is not None gets its default, where the null would be refused (a strict bool)
    or read as false (`add_generation_prompt: null`). A required field's null is still refused."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        defaulted = [k for k, v in data.items() if v is None and k in fields and not fields[k].is_required()
                     and fields[k].get_default(call_default_factory=True) is not None]  # fmt: skip
        return {k: v for k, v in data.items() if k not in defaulted} if defaulted else data


class _Strict(NullIsDefault):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: Optional[StrictBool] = None  # unset: false, or true with continuous_usage_stats (vLLM's default)
    continuous_usage_stats: Optional[StrictBool] = False  # vLLM: every chunk carries its choice's usage so far
    include_obfuscation: Optional[StrictBool] = None  # OpenAI's (SDK 3.63): no padding is sent here either way


class _PlatformFields(_Strict):
    """OpenAI fields about its own platform (storage, tagging, billing tier, its prompt cache's routing, abuse
    tracking): accepted, without effect here."""

    store: Optional[StrictBool] = None
    metadata: Optional[dict[str, StrictStr]] = None
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = None
    prompt_cache_key: Optional[StrictStr] = None
    prompt_cache_retention: Optional[Literal["in-memory", "in_memory", "24h"]] = None  # the SDK's, LiteLLM's spelling
    safety_identifier: Optional[StrictStr] = None


class ChatPromptCacheOptions(_Strict):
    """Chat's prompt_cache_options: how OpenAI's prompt cache places its breakpoints and how long it keeps them;
    checked, without effect (the prefix cache here is automatic: it reuses any prompt's full blocks it still holds)."""

    mode: Optional[Literal["implicit", "explicit"]] = None
    ttl: Optional[Literal["30m"]] = None


class PromptCacheOptions(ChatPromptCacheOptions):
    """The Responses API's prompt_cache_options: chat's, another lifetime, a response to compare for cache
    diagnostics (none are made here) and prewarm (responses_api.py refuses true: every request here generates)."""

    ttl: Optional[Literal["30m", "12h"]] = None
    comparison_response_id: Optional[StrictStr] = None
    prewarm: Optional[StrictBool] = None


class _VllmPlumbing(_Strict):
    """vLLM fields that a vLLM client or router may send: accepted when they ask for nothing (null or empty), or, for
    the guided-decoding backend, whatever backend they name (the grammar is the same; xgrammar runs it here);
    protocol.py refuses any other value naming what this server lacks."""

    guided_decoding_backend: Optional[StrictStr] = None
    guided_whitespace_pattern: Optional[StrictStr] = None
    logits_processors: Optional[list[Any]] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    vllm_xargs: Optional[dict[str, Any]] = None


class GenerationFields(_PlatformFields, _VllmPlumbing):
    """Fields every generation endpoint reads under the same name and meaning: completions, chat completions and
    the Responses API (OpenAI's, plus vLLM's sampling extensions)."""

    model: Optional[StrictStr] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    seed: Optional[StrictInt] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    user: Optional[StrictStr] = None
    request_id: Optional[StrictStr] = None  # vLLM: the caller's id; the answer's id is "cmpl-<it>" ("chatcmpl-<it>")
    cache_salt: Optional[StrictStr] = None  # vLLM: prefix-cache blocks are shared only under the same salt
    structured_outputs: Optional[dict[str, Any]] = None  # vLLM's (docs/structured_outputs.md)
    priority: Optional[StrictInt] = None  # vLLM: lower is served first under serve --scheduling-policy priority
    thinking_token_budget: Optional[StrictInt] = None  # vLLM: the reasoning's end tag is forced after this many tokens


class _SamplingFields(GenerationFields):
    """Fields shared by completions and chat completions (OpenAI, plus vLLM's extensions)."""

    max_tokens: Optional[StrictInt] = None
    min_tokens: Optional[StrictInt] = None  # vLLM: no EOS / stop before this many tokens
    n: Optional[StrictInt] = None
    length_penalty: Optional[Number] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: Optional[StrictBool] = None
    include_stop_str_in_output: Optional[StrictBool] = None
    skip_special_tokens: Optional[StrictBool] = None
    spaces_between_special_tokens: Optional[StrictBool] = None  # vLLM's; a fast tokenizer's decode has no such choice
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    stream_interval: Optional[StrictInt] = None  # vLLM: tokens per streamed chunk, at least the server's
    use_beam_search: Optional[StrictBool] = False
    best_of: Optional[StrictInt] = None
    beam_width: Optional[StrictInt] = None
    early_stopping: Optional[Union[StrictBool, Literal["never"]]] = None
    logit_bias: Optional[dict[str, Number]] = None  # token id (as a string, OpenAI's form) -> bias
    allowed_token_ids: Optional[list[StrictInt]] = None  # vLLM
    bad_words: Optional[Union[StrictStr, list[StrictStr]]] = None  # vLLM
    prompt_logprobs: Optional[StrictInt] = None  # vLLM: log-probs of the prompt's tokens
    truncate_prompt_tokens: Optional[StrictInt] = None  # vLLM: keep the prompt's last k tokens (-1: as many as fit)
    truncation_side: Optional[Literal["left", "right"]] = None  # vLLM: "right" keeps the first k tokens instead
    return_tokens_as_token_ids: Optional[StrictBool] = None  # vLLM: logprobs name tokens "token_id:<id>"
    return_token_ids: Optional[StrictBool] = None  # vLLM: the prompt's and each choice's token ids in the answer
    # Structured outputs (docs/structured_outputs.md): OpenAI's response_format, vLLM's two spellings
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[StrictStr, dict[str, Any]]] = None
    guided_regex: Optional[StrictStr] = None
    guided_choice: Optional[list[StrictStr]] = None
    guided_grammar: Optional[StrictStr] = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Union[StrictStr, TokenIds, list[Union[StrictStr, TokenIds]]]
    logprobs: Optional[StrictInt] = None
    echo: Optional[StrictBool] = False
    suffix: Optional[StrictStr] = None
    add_special_tokens: StrictBool = True  # vLLM: what the tokenizer adds to a text prompt (a BOS)
    prompt_embeds: Optional[Union[StrictStr, list[StrictStr]]] = None  # vLLM's base64 tensors: refused unless empty


class ChatMessage(BaseModel):
    """One conversation turn; the tool-call keys chat templates read are typed as OpenAI types them, other extra
    keys are carried, not used."""

    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: Optional[Union[StrictStr, list[Any]]] = None  # a list: content parts (protocol.py reads text ones)
    name: Optional[StrictStr] = None
    tool_call_id: Optional[StrictStr] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    function_call: Optional[dict[str, Any]] = None  # an assistant's call in OpenAI's legacy form (legacy_functions.py)
    reasoning: Optional[StrictStr] = None  # an assistant turn's reasoning (vLLM's; reasoning_content its old name)
    reasoning_content: Optional[StrictStr] = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[StrictBool] = None  # false: tool_choice "required" makes exactly one call
    # vLLM's chat options (LLM.chat_prompt): continue the last assistant message, more template variables
    add_generation_prompt: Optional[StrictBool] = True
    continue_final_message: Optional[StrictBool] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # vLLM's: documents for a retrieval-augmented template (Command R's, Granite's), given to it as `documents`
    documents: Optional[list[dict[StrictStr, StrictStr]]] = None
    add_special_tokens: StrictBool = False  # vLLM: on top of the template's own text (which writes its BOS itself)
    echo: Optional[StrictBool] = False  # vLLM: the last message's text before the answer when the roles match
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    # OpenAI fields that ask a reasoning model to think less or more, or to be terse, or hand it a prediction of the
    # answer (a speed hint: the answer is the same without it): accepted; reasoning_effort is a chat template
    # variable (vLLM's), which a template may read; the others are without effect; modalities other than text and
    # web search are refused (protocol.py)
    reasoning_effort: Optional[StrictStr] = None
    include_reasoning: Optional[StrictBool] = None  # vLLM's: false leaves the split-off reasoning out of the answer
    chat_template: Optional[StrictStr] = None  # vLLM's: rendered under serve --trust-request-chat-template
    mm_processor_kwargs: Optional[dict[str, Any]] = None  # vLLM's multimodal options: refused unless empty
    media_io_kwargs: Optional[dict[str, Any]] = None
    verbosity: Optional[StrictStr] = None
    prediction: Optional[dict[str, Any]] = None
    modalities: Optional[list[StrictStr]] = None
    audio: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None
    prompt_cache_options: Optional[ChatPromptCacheOptions] = None
    moderation: Optional[dict[str, Any]] = None  # OpenAI's moderated completions: refused unless null (protocol.py)
    structural_tag: Optional[Union[StrictStr, dict[str, Any]]] = None  # vLLM's, beside guided_*: a structural tag


class ResponsesStreamOptions(_Strict):
    """The Responses API's stream_options."""

    include_obfuscation: Optional[StrictBool] = None  # no padding is sent here either way


class Reasoning(_Strict):
    """The Responses API's reasoning settings: checked and echoed; `effort` is a chat template variable
    (`reasoning_effort`, vLLM's), which a template may read; `serve --reasoning-parser` returns the thinking as a
    reasoning item."""

    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None  # the older spelling of summary


class AccessPrograms(_Strict):
    """OpenAI's domain-specific access programs: a model without a Cyber tier (every model here) serves under
    "standard"; responses_api.py refuses the Daybreak ones."""

    cyber: Optional[Literal["standard", "daybreak_blue", "daybreak_red"]] = None


class BackgroundOptions(_Strict):
    """How soon a background response must be done, and an id OpenAI groups related ones by (no effect here):
    responses_api.py checks the window against background, stream and service_tier as OpenAI does."""

    completion_window: Optional[Literal["soonest", "2h", "8h"]] = None
    continuation_id: Optional[StrictStr] = None


class ContextManagement(_Strict):
    """One entry of OpenAI's context management (compaction): refused, as there is none here (responses_api.py)."""

    type: StrictStr
    compact_threshold: Optional[StrictInt] = None


class ImageOptions(_Strict):
    """OpenAI's request-level image options: how image inputs are compressed (this server reads no images)."""

    context_compression: Optional[Literal["auto", "enabled", "disabled"]] = None


class ResponsesRequest(GenerationFields):
    """POST /v1/responses (OpenAI's Responses API; server/responses_api.py serves it through chat). Items, tools
    and text.format are checked there, where their errors can name the item."""

    input: Union[StrictStr, list[Any]]
    instructions: Optional[StrictStr] = None
    max_output_tokens: Optional[StrictInt] = None
    top_logprobs: Optional[StrictInt] = None
    include: Optional[list[StrictStr]] = None
    stream: StrictBool = False
    stream_options: Optional[ResponsesStreamOptions] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[StrictStr, dict[str, Any]]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    text: Optional[dict[str, Any]] = None  # format (as chat's response_format), verbosity (no effect here)
    reasoning: Optional[Reasoning] = None
    truncation: Optional[StrictStr] = None
    max_tool_calls: Optional[StrictInt] = None
    previous_response_id: Optional[StrictStr] = None  # a stored response's id (a server with a Responses store)
    conversation: Optional[Any] = None
    prompt: Optional[dict[str, Any]] = None
    background: Optional[StrictBool] = None
    background_options: Optional[BackgroundOptions] = None
    prompt_cache_options: Optional[PromptCacheOptions] = None
    access_programs: Optional[AccessPrograms] = None
    moderation: Optional[dict[str, Any]] = None  # refused unless null, as chat's (protocol.py)
    context_management: Optional[list[ContextManagement]] = None
    image: Optional[ImageOptions] = None


# ---- responses -----------------------------------------------------------------------------------
class TokenizeCompletionRequest(_Strict):
    """POST /tokenize with a text prompt."""

    model: Optional[StrictStr] = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True  # what the tokenizer adds (a BOS), as /v1/completions does
    return_token_strs: Optional[StrictBool] = False


class TokenizeChatRequest(_Strict):
    """POST /tokenize with a conversation, under the chat template."""

    model: Optional[StrictStr] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: Optional[StrictBool] = True
    continue_final_message: Optional[StrictBool] = False
    add_special_tokens: StrictBool = False  # on top of the template's own (which writes its BOS itself)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[StrictStr] = None  # vLLM's: rendered under serve --trust-request-chat-template
    tools: Optional[list[Any]] = None
    # checked as chat checks them; the template is shown the same tools whatever is chosen
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[StrictBool] = None
    functions: Optional[list[Any]] = None  # OpenAI's legacy form of tools (legacy_functions.py), as chat takes it
    function_call: Optional[Any] = None  # and of tool_choice
    documents: Optional[list[dict[StrictStr, StrictStr]]] = None  # as chat completions take them
    return_token_strs: Optional[StrictBool] = False


class TokenizeResponse(BaseModel):
    """The /tokenize answer."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None  # the vocabulary's spelling of each token, when asked for


class DetokenizeRequest(_Strict):
    """POST /detokenize."""

    model: Optional[StrictStr] = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    """The /detokenize answer."""

    prompt: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # the prompt's tokens found in the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # the completion's reasoning tokens, its tags left out (OpenAI's; the Responses API's too)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None  # serve --enable-prompt-tokens-details (vLLM's)
    completion_tokens_details: Optional[CompletionTokensDetails] = None  # a chat answer under --reasoning-parser

    @model_serializer(mode="wrap")
    def _details_when_counted(self, handler: Any) -> dict[str, Any]:
        """Without completion_tokens_details unless counted (the body of vLLM's usage otherwise)."""
        return {k: v for k, v in handler(self).items() if k != "completion_tokens_details" or v is not None}


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]  # None for the first token of an echoed prompt
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's form of one prompt log-prob entry (keyed by token id): rank 1 is the position's most likely token."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[Optional[dict[str, PromptLogprob]]]


class TopLogprob(BaseModel):
    token: str
    logprob: Optional[float]
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's (or chunk's) log-probs: `refusal` always null (OpenAI's schema requires the key)."""

    content: list[TokenLogprob]
    refusal: Optional[list[TokenLogprob]] = None


def _token_ids() -> Any:
    """A field of vLLM's return_token_ids: left out of the JSON unless asked for, at no cost to the bodies that did
    not ask (a model serializer would run Python for every chunk)."""
    return Field(None, exclude_if=_is_none)


def _is_none(value: Any) -> bool:
    return value is None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[list[int]] = _token_ids()  # return_token_ids (a stream: with the choice's first chunk)
    token_ids: Optional[list[int]] = _token_ids()  # return_token_ids (a stream: the chunk's new tokens)


class _Reply(BaseModel):
    """What every completion reply and stream chunk carries: its id, creation time and model."""

    id: str
    created: int
    model: str


class CompletionResponse(_Reply):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _with_old_reasoning_name(out: dict[str, Any]) -> dict[str, Any]:
    """A serialized message or delta with its `reasoning` also under `reasoning_content` (the older name)."""
    if "reasoning" in out:
        out["reasoning_content"] = out["reasoning"]
    return out


class AssistantMessage(BaseModel):
    """The reply: `content` (null when the reply is tool calls), `refusal` (always null: no model here refuses
    apart from its text, and OpenAI's schema requires the key), and `tool_calls` (or `function_call`, the legacy
    form's one call) only when there are some;
    `reasoning` (vLLM's) only from a server with a reasoning parser, also as `reasoning_content` (its older name,
    which DeepSeek's API and many clients read)."""

    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    refusal: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    function_call: Optional[FunctionCall] = None  # the call in OpenAI's legacy form (a request with `functions`)
    reasoning: Optional[str] = None

    @model_serializer(mode="wrap")
    def _without_absent_parts(self, handler: Any) -> dict[str, Any]:
        return _with_old_reasoning_name({k: v for k, v in handler(self).items()
                                         if k not in ("tool_calls", "function_call", "reasoning") or v is not None})


class _WithoutNulls(BaseModel):
    """A stream delta part: fields left unset (None) are left out of the JSON."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_WithoutNulls):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_WithoutNulls):
    """A streamed tool call: the first delta of a call carries its id, type and name (arguments ""), the next
    ones pieces of its arguments."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = _token_ids()  # return_token_ids


class ChatCompletionResponse(_Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[list[int]] = _token_ids()  # return_token_ids


class Delta(_WithoutNulls):
    """A chat stream delta; absent fields are left out (`{}` on the last chunk of a choice), except the content of
    the role chunk (a choice's first), which OpenAI always sends: "" or, for an answer of tool calls only, null."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None  # vLLM's: the reasoning's next piece (a server with a reasoning parser)
    tool_calls: Optional[list[DeltaToolCall]] = None
    function_call: Optional[DeltaFunctionCall] = None  # the legacy form's call: its name, then its arguments' pieces

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:  # the parent's, plus the older reasoning name
        return _with_old_reasoning_name({k: v for k, v in handler(self).items()
                                         if v is not None or (k == "content" and self.role is not None)})


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None  # vLLM's: the stop string or stop token id that ended it
    token_ids: Optional[list[int]] = _token_ids()  # return_token_ids: the chunk's new tokens


class ChatCompletionChunk(_Reply):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    prompt_token_ids: Optional[list[int]] = _token_ids()  # return_token_ids: with a choice's first chunk


class CompletionChunk(CompletionResponse):
    """A completions stream chunk: OpenAI streams text_completion objects of the reply's own shape."""


class ModelCard(BaseModel):
    """A served model as OpenAI's client reads it (id, object, created, owned_by; vLLM's root and max_model_len) and
    as Anthropic's does (its ModelInfo: type, display_name, created_at, lifecycle), in one body:
    both clients ask GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "trtpaged"
    root: str
    max_model_len: int
    type: Literal["model"] = "model"
    lifecycle: Literal["active"] = "active"

    @computed_field  # type: ignore[prop-decorator]
    @property
    def display_name(self) -> str:
        return self.id

    @computed_field  # type: ignore[prop-decorator]
    @property
    def created_at(self) -> str:
        """`created` as RFC 3339 (Anthropic's spelling of the time)."""
        return datetime.fromtimestamp(self.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ModelList(BaseModel):
    """OpenAI's model list, with Anthropic's page fields (every model is on the one page)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    has_more: bool = False

    @computed_field  # type: ignore[prop-decorator]
    @property
    def first_id(self) -> Optional[str]:
        return self.data[0].id if self.data else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def last_id(self) -> Optional[str]:
        return self.data[-1].id if self.data else None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def dump(model: BaseModel) -> dict[str, Any]:
    """A response model as JSON-ready data."""
    return model.model_dump(mode="json")
