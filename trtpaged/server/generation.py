"""One /v1/completions or /v1/chat/completions request: validate, tokenize, submit, then answer or stream."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Optional, Union

from pydantic import BaseModel

from trtpaged.errors import RequestError
from trtpaged.runtime.llm import LLM
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.outputs import RequestOutput, RequestOutputKind
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.runtime.scheduler import check_request
from trtpaged.server.engine_loop import (
    EngineFailure,
    EngineLoop,
    Overloaded,
    RequestTimeout,
    ShuttingDown,
    Subscription,
)
from trtpaged.server.errors import ApiError, from_runtime_error, overloaded
from trtpaged.server.protocol import GenerationRequest, parse_generation
from trtpaged.server.responses import ResponseBuilder, logprob_token_ids
from trtpaged.server.schemas import dump
from trtpaged.server.stream_state import CompletionAccumulator, StreamState

Disconnected = Callable[[], Awaitable[bool]]


@dataclass
class Summary:
    """What the server logs about one finished HTTP generation request."""

    request_id: str = "-"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)


@dataclass
class Submitted:
    """A request accepted by the engine: everything needed to answer or stream it."""

    req: GenerationRequest
    params: SamplingParams
    sub: Subscription
    index: dict[str, int]  # engine request id -> prompt index
    builder: ResponseBuilder
    summary: Summary


def runtime_failure(exc: Exception) -> ApiError:
    """The answer to a request that the server could not finish (its own fault, not the client's)."""
    if isinstance(exc, (ShuttingDown, Overloaded)):
        return overloaded(str(exc))
    if isinstance(exc, RequestTimeout):
        return ApiError("request: exceeded the server's request timeout and was aborted", None, 504, "timeout_error")
    return ApiError(str(exc) if isinstance(exc, EngineFailure) else "internal server error", None, 500, "server_error")


def sse(data: Union[BaseModel, dict, str]) -> bytes:
    """One Server-Sent Event."""
    payload = data if isinstance(data, str) else json.dumps(dump(data) if isinstance(data, BaseModel) else data)
    return f"data: {payload}\n\n".encode()


class GenerationService:
    """Runs OpenAI generation requests on the engine loop; shared by all request handlers."""

    def __init__(self, llm: LLM, loop: EngineLoop, model_name: str, max_prompt_tokens: Optional[int] = None,
                 request_timeout_s: Optional[float] = None) -> None:  # fmt: skip
        self.llm = llm
        self.loop = loop
        self.model_name = model_name
        self.max_seq_len = llm.config.max_seq_len
        self.vocab_size = llm.manifest.dims.vocab_size
        self.max_prompt_tokens = max_prompt_tokens
        self.request_timeout_s = request_timeout_s

    async def submit(self, body: Any, chat: bool) -> Submitted:
        """Validates, tokenizes and queues one request; raises ApiError before anything is sent."""
        req = parse_generation(body, chat, self.model_name, self.vocab_size)
        params = self._params(req, req.max_tokens)  # None: fitted to each prompt below
        self._check_num_prompts(req)
        prompts = await self._tokenize(req)
        summary = Summary(request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}")
        requests = [(f"{summary.request_id}-{i}", ids, self._fit_max_tokens(req, params, len(ids)))
                    for i, ids in enumerate(prompts)]  # fmt: skip
        try:
            sub = await self.loop.submit(requests)
        except ValueError as exc:
            raise from_runtime_error(exc, req.names) from None
        except (Overloaded, ShuttingDown) as exc:
            raise overloaded(str(exc)) from None
        builder = ResponseBuilder(summary.request_id, self.model_name, int(time.time()), chat, req.logprobs)
        index = {rid: i for i, (rid, _, _) in enumerate(requests)}
        return Submitted(req, params, sub, index, builder, summary)

    # ---- request -> engine requests -----------------------------------------------------------
    def _params(self, req: GenerationRequest, max_tokens: Optional[int]) -> SamplingParams:
        """The engine request's parameters. Every request is served from DELTA outputs: each step hands over
        only what is new (stop strings held back by the runtime), a stream sends it on, a full body joins it."""
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=req.logprobs, output_kind=RequestOutputKind.DELTA,
                                  **req.sampling)
        except ValueError as exc:
            raise from_runtime_error(exc, req.names) from None

    def _check_num_prompts(self, req: GenerationRequest) -> None:
        """Each prompt is one engine request: more than the waiting queue holds could never be admitted
        (400, where a queue that is full for now is 503)."""
        limit = self.loop.max_waiting
        if limit is not None and len(req.prompts) > limit:
            raise ApiError(f"prompt: {len(req.prompts)} prompts in one request exceeds this server's max_waiting "
                           f"({limit}), the most requests it queues at once; send at most {limit}", "prompt")

    async def _tokenize(self, req: GenerationRequest) -> list[list[int]]:
        """Prompt token ids, computed on the engine thread (the only thread that touches the tokenizer)."""

        def run(engine: LLMEngine) -> list[list[int]]:
            if req.chat:
                return [self.llm.chat_prompt(req.messages)]
            return [engine.encode(p)[1] for p in req.prompts]

        field_name = "messages" if req.chat else "prompt"
        try:
            prompts = await self.loop.call_async(run)
        except ValueError as exc:
            raise from_runtime_error(exc, req.names) from None
        except ShuttingDown as exc:
            raise overloaded(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer error is the request's fault
            raise ApiError(f"{field_name}: could not be tokenized ({type(exc).__name__})", field_name) from None
        limit = self.max_prompt_tokens
        longest = max((len(p) for p in prompts), default=0)
        if limit is not None and longest > limit:
            raise ApiError(f"{field_name}: {longest} tokens exceeds this server's prompt limit ({limit})", field_name)
        return prompts

    def _fit_max_tokens(self, req: GenerationRequest, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Unset max_tokens: what max_seq_len leaves. Then the runtime's own `check_request` on this
        prompt, so that a request of several prompts is refused before any of them is queued."""
        if req.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max(1, self.max_seq_len - prompt_len))
        try:
            check_request(self.llm.config, prompt_len, params)
        except RequestError as exc:
            raise from_runtime_error(exc, req.names) from None
        return params

    # ---- answers ------------------------------------------------------------------------------
    async def _token_strings(self, ids: Iterable[int]) -> dict[int, str]:
        ids = sorted(set(ids))
        if not ids:
            return {}
        return await self.loop.call_async(lambda e: {t: e.tokenizer.decode([t], skip_special_tokens=False) for t in ids})

    async def respond(self, s: Submitted, disconnected: Disconnected) -> BaseModel:
        """The full (non-streamed) body once every choice finished; raises ClientGone or the engine's error."""
        joined = [CompletionAccumulator() for _ in s.index]
        async with aclosing(s.sub.outputs(disconnected, self.request_timeout_s)) as outputs:
            async for out in outputs:
                joined[s.index[out.request_id]].add(out)
        ordered = [j.result() for j in joined]
        ids: set[int] = set()
        if s.builder.top_logprobs is not None:
            for out in ordered:
                for c in out.outputs:
                    ids |= logprob_token_ids(c.token_ids, c.logprobs)
        body = s.builder.full(ordered, s.params.n, await self._token_strings(ids))
        _summarise(s.summary, ordered)
        return body

    async def stream(self, s: Submitted) -> AsyncIterator[bytes]:
        """Server-Sent Events: chunks, the usage chunk if asked for, then `[DONE]`. A failure after the
        stream started is sent as an error event (then `[DONE]`); a cancelled stream aborts its requests."""
        params, builder = s.params, s.builder
        state = StreamState(params.n, builder.top_logprobs is not None)
        if s.req.chat:
            for p in range(len(s.index)):
                for i in range(params.n):
                    yield sse(builder.chunk(p * params.n + i, "", role=True))
        try:
            # Disconnects cancel this generator (the ASGI server's disconnect listener); no polling here.
            async with aclosing(s.sub.outputs(_never, self.request_timeout_s)) as outputs:
                async for out in outputs:
                    for d in state.deltas(s.index[out.request_id], out):
                        logprobs = None
                        if builder.top_logprobs is not None and d.logprobs is not None:
                            strings = await self._token_strings(logprob_token_ids(d.token_ids, d.logprobs))
                            offset = state.advance_offset(d.index, [strings[t] for t in d.token_ids])
                            logprobs = builder.stream_logprobs(d.token_ids, d.logprobs, strings, offset)
                        yield sse(builder.chunk(d.index, d.text, d.finish_reason, logprobs))
        except (EngineFailure, ShuttingDown, RequestTimeout) as exc:
            s.summary.finish_reasons = [type(exc).__name__]
            yield sse(dump(runtime_failure(exc).body()))
            yield sse("[DONE]")
            return
        s.summary.prompt_tokens = sum(state.prompt_tokens.values())
        s.summary.completion_tokens = state.completion_tokens
        s.summary.finish_reasons = state.finish_reasons
        if s.req.include_usage:
            yield sse(builder.usage_chunk(s.summary.prompt_tokens, s.summary.completion_tokens))
        yield sse("[DONE]")


async def _never() -> bool:
    return False


def _summarise(summary: Summary, finals: list[RequestOutput]) -> None:
    summary.prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
    summary.completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
    summary.finish_reasons = [c.finish_reason or "?" for o in finals for c in o.outputs]
