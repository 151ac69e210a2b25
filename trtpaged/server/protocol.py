"""OpenAI request bodies -> prompts and SamplingParams fields; every error names the field and the rule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

MAX_LOGPROBS = 20  # top log-probs per token a request may ask for (OpenAI's limit)

# request field -> (JSON kind, SamplingParams field); range checks are SamplingParams' own
_SAMPLING_FIELDS: dict[str, tuple[str, str]] = {
    "temperature": ("number", "temperature"),
    "top_p": ("number", "top_p"),
    "top_k": ("integer", "top_k"),
    "min_p": ("number", "min_p"),
    "n": ("integer", "n"),
    "seed": ("integer", "seed"),
    "presence_penalty": ("number", "presence_penalty"),
    "frequency_penalty": ("number", "frequency_penalty"),
    "repetition_penalty": ("number", "repetition_penalty"),
    "ignore_eos": ("boolean", "ignore_eos"),
    "include_stop_str_in_output": ("boolean", "include_stop_str_in_output"),
    "skip_special_tokens": ("boolean", "skip_special_tokens"),
    "length_penalty": ("number", "length_penalty"),
}
_UNSUPPORTED = ("echo", "suffix", "logit_bias", "tools", "functions", "tool_choice", "function_call")

Prompt = Union[str, list[int]]


class ApiError(Exception):
    """An error answered as an OpenAI error body: `{"error": {message, type, param, code}}`."""

    def __init__(
        self, message: str, param: Optional[str] = None, status: int = 400, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


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
    names: dict[str, str] = field(default_factory=dict)  # SamplingParams field -> request field, for errors


def _kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def typed(body: dict, name: str, kind: str, default: Any = None) -> Any:
    """`body[name]` if present and not null, checked against a JSON kind (integer, number, boolean, string)."""
    value = body.get(name)
    if value is None:
        return default
    got = _kind_of(value)
    if got != kind and not (kind == "number" and got == "integer"):
        raise ApiError(f"{name}: must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got {got} {value!r}", name)
    return value


def _token_list(value: Any, name: str, vocab_size: int) -> list[int]:
    if not value or not all(_kind_of(t) == "integer" for t in value):
        raise ApiError(f"{name}: a token-id prompt must be a non-empty array of integers", name)
    bad = next((t for t in value if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})", name)
    return list(value)


def parse_prompts(value: Any, vocab_size: int) -> list[Prompt]:
    """`prompt`: a string, a list of token ids, or a non-empty list of either."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise ApiError("prompt: must be a string, an array of token ids, or a non-empty array of those", "prompt")
    if all(_kind_of(t) == "integer" for t in value):
        return [_token_list(value, "prompt", vocab_size)]
    prompts: list[Prompt] = []
    for item in value:
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list):
            prompts.append(_token_list(item, "prompt", vocab_size))
        else:
            raise ApiError(f"prompt: array items must be strings or arrays of token ids, got {_kind_of(item)}", "prompt")
    return prompts


def parse_messages(value: Any) -> list[dict[str, str]]:
    """`messages`: [{role, content}], content a string or text parts ([{type: text, text}])."""
    if not isinstance(value, list) or not value:
        raise ApiError("messages: must be a non-empty array of {role, content} objects", "messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ApiError(f"messages[{i}]: must be an object with a string 'role'", "messages")
        content = msg.get("content") or ""
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(f"messages[{i}].content: only text parts ({{type: text, text}}) are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(f"messages[{i}].content: must be a string or an array of text parts", "messages")
        out.append({"role": msg["role"], "content": content})
    return out


def _stop_fields(body: dict) -> dict[str, Any]:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise ApiError("stop: must be a non-empty string or an array of non-empty strings", "stop")
    ids = body.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(_kind_of(t) == "integer" for t in ids)):
        raise ApiError("stop_token_ids: must be an array of integers", "stop_token_ids")
    return {"stop": tuple(stop or ()), "stop_token_ids": tuple(ids or ())}


def _beam_fields(body: dict, names: dict[str, str]) -> dict[str, Any]:
    """beam_width (TensorRT-LLM) or use_beam_search + best_of (vLLM, best_of defaulting to n) -> beam_width."""
    n = typed(body, "n", "integer", 1)
    use_beam = typed(body, "use_beam_search", "boolean", False)
    best_of = typed(body, "best_of", "integer")
    width = typed(body, "beam_width", "integer")
    if width is not None:
        field_name = "beam_width"
    elif use_beam:
        field_name, width = ("best_of", best_of) if best_of is not None else ("n", n)
        if width < 2:
            raise ApiError(f"{field_name}: beam search needs a beam width >= 2, got {width}", field_name)
    else:
        field_name, width = "n", 1
        if best_of is not None and best_of != n:
            raise ApiError(f"best_of: must equal n ({n}) unless use_beam_search is set, got {best_of}", "best_of")
    names["beam_width"] = field_name
    names["n/beam_width"] = field_name if width > 1 else "n"
    out: dict[str, Any] = {"beam_width": width}
    early = body.get("early_stopping")
    if early is not None:
        if early not in (True, False, "never"):
            raise ApiError(f"early_stopping: must be true, false or \"never\", got {early!r}", "early_stopping")
        out["early_stopping"] = early
    return out


def _logprobs(body: dict, chat: bool, names: dict[str, str]) -> Optional[int]:
    if chat:
        if not typed(body, "logprobs", "boolean", False):
            if body.get("top_logprobs") is not None:
                raise ApiError("top_logprobs: needs logprobs: true", "top_logprobs")
            return None
        names["logprobs"] = "top_logprobs"
        k, name = typed(body, "top_logprobs", "integer", 0), "top_logprobs"
    else:
        k, name = typed(body, "logprobs", "integer"), "logprobs"
        if k is None:
            return None
    if not 0 <= k <= MAX_LOGPROBS:
        raise ApiError(f"{name}: must be in [0, {MAX_LOGPROBS}], got {k}", name)
    return k


def parse_generation(body: Any, chat: bool, served_model: str, vocab_size: int) -> GenerationRequest:
    """Checks a request body's shape and types; value ranges are left to SamplingParams and the engine."""
    if not isinstance(body, dict):
        raise ApiError(f"body: must be a JSON object, got {_kind_of(body)}", "body")
    model = typed(body, "model", "string")
    if model is not None and model != served_model:
        raise ApiError(f"model: {model!r} is not served here; the served model is {served_model!r}", "model")
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False, "", [], {}, "none"):
            raise ApiError(f"{name}: not supported by this server", name)
    names: dict[str, str] = {"prompt": "messages" if chat else "prompt"}
    sampling = {sp: typed(body, name, kind) for name, (kind, sp) in _SAMPLING_FIELDS.items()}
    sampling = {k: v for k, v in sampling.items() if v is not None}  # top_k -1 (off): SamplingParams maps it to 0
    sampling.update(_stop_fields(body))
    sampling.update(_beam_fields(body, names))
    max_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    names["max_tokens"] = max_field
    max_tokens = typed(body, max_field, "integer", None if chat else 16)
    stream = typed(body, "stream", "boolean", False)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise ApiError("stream_options: must be an object, and only with stream: true", "stream_options")
    include_usage = bool(typed(options or {}, "include_usage", "boolean", False))
    return GenerationRequest(
        chat=chat,
        prompts=[] if chat else parse_prompts(body.get("prompt"), vocab_size),
        messages=parse_messages(body.get("messages")) if chat else [],
        sampling=sampling,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        logprobs=_logprobs(body, chat, names),
        names=names,
    )


def api_error_from(exc: ValueError, names: dict[str, str]) -> ApiError:
    """A runtime ValueError ("SamplingParams.top_p: must be ...", "prompt: 600 tokens exceeds ...") as a 400
    naming the request field it came from; the runtime's rule and limit are kept word for word."""
    text = str(exc)
    head, sep, rest = text.partition(": ")
    head = head.removeprefix("SamplingParams.")
    if not sep or " " in head:
        return ApiError(text)
    param = names.get(head, head)
    return ApiError(f"{param}: {rest}", param)
