"""OpenAI response bodies and stream chunks (completions and chat) built from `RequestOutput`s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from trtpaged.runtime.outputs import CompletionOutput, RequestOutput
from trtpaged.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    TokenLogprob,
    TopLogprob,
    Usage,
)

TokenStrings = Mapping[int, str]  # token id -> its text, decoded on the engine thread


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def logprob_token_ids(token_ids: Sequence[int], logprobs: Optional[Sequence[Mapping[int, float]]]) -> set[int]:
    """Every token id whose text a logprobs field will show."""
    ids = set(token_ids)
    for entry in logprobs or ():
        ids.update(entry)
    return ids


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Mapping[int, float]], strings: TokenStrings, offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy completions format (tokens, token_logprobs, top_logprobs, text_offset) and the next offset."""
    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(token_ids, logprobs):
        text = strings[token]
        body["tokens"].append(text)
        body["token_logprobs"].append(entry.get(token))
        body["top_logprobs"].append({strings[t]: lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])})
        body["text_offset"].append(offset)
        offset += len(text)
    return CompletionLogprobs(**body), offset


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Mapping[int, float]], strings: TokenStrings, top_k: int
) -> ChatLogprobs:
    """The chat format: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    def item(token: int, logprob: Optional[float]) -> dict[str, Any]:
        text = strings[token]
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token, entry in zip(token_ids, logprobs):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_k]
        content.append(TokenLogprob(**item(token, entry.get(token)), top_logprobs=[TopLogprob(**item(t, lp)) for t, lp in top]))
    return ChatLogprobs(content=content)


@dataclass(frozen=True)
class ResponseBuilder:
    """Shapes bodies for one HTTP request: its id, model name, creation time and endpoint."""

    request_id: str
    model: str
    created: int
    chat: bool
    top_logprobs: Optional[int] = None  # requested top-k, or None when logprobs are off

    def _envelope(self) -> dict[str, Any]:
        return {"id": self.request_id, "created": self.created, "model": self.model}

    def _logprobs(self, token_ids: Sequence[int], logprobs: Optional[Sequence[Mapping[int, float]]],
                  strings: TokenStrings, offset: int = 0) -> Union[ChatLogprobs, CompletionLogprobs, None]:
        if self.top_logprobs is None or logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(token_ids, logprobs, strings, self.top_logprobs)
        return completion_logprobs(token_ids, logprobs, strings, offset)[0]

    def full(self, finals: Sequence[RequestOutput], n: int, strings: TokenStrings) -> Union[ChatCompletionResponse, CompletionResponse]:
        """The non-streamed body: one choice per prompt x completion, numbered prompt-major."""
        choices: list[Any] = []
        for p, out in enumerate(finals):
            for c in out.outputs:
                common = {"index": p * n + c.index, "logprobs": self._logprobs(c.token_ids, c.logprobs, strings),
                          "finish_reason": c.finish_reason, "stop_reason": _stop_reason(c)}  # fmt: skip
                if self.chat:
                    choices.append(ChatChoice(message=AssistantMessage(content=c.text), **common))
                else:
                    choices.append(CompletionChoice(text=c.text, **common))
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
        completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
        body = {**self._envelope(), "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}
        return ChatCompletionResponse(**body) if self.chat else CompletionResponse(**body)

    def chunk(
        self,
        index: int,
        text: Optional[str],
        finish_reason: Optional[str] = None,
        logprobs: Union[ChatLogprobs, CompletionLogprobs, None] = None,
        role: bool = False,
    ) -> Union[ChatCompletionChunk, CompletionChunk]:
        """One streamed choice delta. Chat: `role` sends the assistant role (the first chunk of a choice)."""
        if self.chat:
            delta = Delta(role="assistant", content="") if role else Delta(content=text or None)
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            return ChatCompletionChunk(**self._envelope(), choices=[choice])
        choice = CompletionChoice(index=index, text=text or "", logprobs=logprobs, finish_reason=finish_reason)
        return CompletionChunk(**self._envelope(), choices=[choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> Union[ChatCompletionChunk, CompletionChunk]:
        """The last chunk when stream_options.include_usage is set: no choices, the request's usage."""
        kind = ChatCompletionChunk if self.chat else CompletionChunk
        return kind(**self._envelope(), choices=[], usage=usage(prompt_tokens, completion_tokens))

    def stream_logprobs(self, token_ids: Sequence[int], logprobs: Optional[Sequence[Mapping[int, float]]],
                        strings: TokenStrings, offset: int) -> Union[ChatLogprobs, CompletionLogprobs, None]:
        """Log-probs of the tokens in one streamed delta (completions offsets continue from `offset`)."""
        return self._logprobs(token_ids, logprobs, strings, offset)


def _stop_reason(c: CompletionOutput) -> Any:
    return c.stop_reason if isinstance(c.stop_reason, (str, int)) else None
