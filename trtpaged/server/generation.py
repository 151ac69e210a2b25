"""One /v1/completions or /v1/chat/completions request: validate, tokenize, submit, answer or stream."""

from __future__ import annotations

import dataclasses
import time
import uuid
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

from trtpaged.runtime.llm import LLM
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.outputs import RequestOutput
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.server.engine_loop import EngineLoop, Subscription
from trtpaged.server.protocol import ApiError, GenerationRequest, api_error_from, parse_generation
from trtpaged.server.responses import ResponseBuilder, logprob_token_ids
from trtpaged.server.stream_state import StreamState


class Connection(Protocol):
    """What a generation needs from the HTTP layer."""

    def disconnected(self) -> bool: ...
    def send_json(self, status: int, body: Any) -> None: ...
    def start_events(self) -> None: ...
    def send_event(self, data: Any) -> None: ...


@dataclass
class Summary:
    """What the server logs about one finished HTTP generation request."""

    request_id: str = "-"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)


class GenerationService:
    """Runs OpenAI generation requests on the engine loop; shared by all HTTP handler threads."""

    def __init__(self, llm: LLM, loop: EngineLoop, model_name: str) -> None:
        self.llm = llm
        self.loop = loop
        self.model_name = model_name
        self.max_seq_len = llm.config.max_seq_len
        self.vocab_size = llm.manifest.dims.vocab_size

    def handle(self, body: Any, chat: bool, conn: Connection, summary: Summary) -> None:
        """Answers one request on `conn`; raises ApiError before anything is sent, ClientGone if the client left."""
        req = parse_generation(body, chat, self.model_name, self.vocab_size)
        params = self._params(req, req.max_tokens if req.max_tokens is not None else 16)
        prompts = self._tokenize(req)
        requests = []
        summary.request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        for i, ids in enumerate(prompts):
            requests.append((f"{summary.request_id}-{i}", ids, self._fit_max_tokens(req, params, len(ids))))
        try:
            sub = self.loop.submit(requests)
        except ValueError as exc:
            raise api_error_from(exc, req.names) from None
        builder = ResponseBuilder(summary.request_id, self.model_name, int(time.time()), chat, req.logprobs)
        index = {rid: i for i, (rid, _, _) in enumerate(requests)}
        if req.stream:
            self._stream(req, params, sub, index, builder, conn, summary)
        else:
            self._respond(params, sub, index, builder, conn, summary)

    # ---- request -> engine requests -----------------------------------------------------------
    def _params(self, req: GenerationRequest, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=req.logprobs, **req.sampling)
        except ValueError as exc:
            raise api_error_from(exc, req.names) from None

    def _tokenize(self, req: GenerationRequest) -> list[list[int]]:
        """Prompt token ids, computed on the engine thread (the only thread that touches the tokenizer)."""

        def run(engine: LLMEngine) -> list[list[int]]:
            if req.chat:
                return [self.llm.chat_prompt(req.messages)]
            return [engine.encode(p)[1] for p in req.prompts]

        try:
            return self.loop.call(run)
        except ValueError as exc:
            raise api_error_from(exc, req.names) from None
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer error is the request's fault
            field_name = "messages" if req.chat else "prompt"
            raise ApiError(f"{field_name}: could not be tokenized: {type(exc).__name__}: {exc}", field_name) from None

    def _fit_max_tokens(self, req: GenerationRequest, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Unset max_tokens: what max_seq_len leaves. Set: prompt + max_tokens must fit in max_seq_len."""
        if prompt_len > self.max_seq_len:
            return params  # add_request refuses it, naming max_seq_len
        room = self.max_seq_len - prompt_len
        if req.max_tokens is None:
            return dataclasses.replace(params, max_tokens=max(1, room))
        if req.max_tokens > room:
            name = req.names["max_tokens"]
            raise ApiError(
                f"{name}: {prompt_len} prompt tokens + {req.max_tokens} requested exceeds max_seq_len "
                f"({self.max_seq_len}); at most {room} here", name)
        return params

    # ---- answers ------------------------------------------------------------------------------
    def _token_strings(self, ids: Iterable[int]) -> dict[int, str]:
        ids = sorted(set(ids))
        if not ids:
            return {}
        return self.loop.call(lambda e: {t: e.tokenizer.decode([t], skip_special_tokens=False) for t in ids})

    def _respond(self, params, sub: Subscription, index, builder: ResponseBuilder, conn: Connection, summary) -> None:
        finals: dict[int, RequestOutput] = {}
        with closing(sub.outputs(conn.disconnected)) as outputs:
            for out in outputs:
                if out.finished:
                    finals[index[out.request_id]] = out
        ordered = [finals[i] for i in range(len(index))]
        ids: set[int] = set()
        if builder.top_logprobs is not None:
            for out in ordered:
                for c in out.outputs:
                    ids |= logprob_token_ids(c.token_ids, c.logprobs)
        body = builder.full(ordered, params.n, self._token_strings(ids))
        _summarise(summary, ordered)
        conn.send_json(200, body)

    def _stream(self, req, params, sub: Subscription, index, builder: ResponseBuilder, conn: Connection, summary) -> None:
        state = StreamState(params.n, params.stop, params.use_beam_search, builder.top_logprobs is not None)
        usage_flag = req.include_usage
        conn.start_events()
        if req.chat:
            for p in range(len(index)):
                for i in range(params.n):
                    conn.send_event(builder.chunk(p * params.n + i, "", role=True, include_usage=usage_flag))
        finals: dict[int, RequestOutput] = {}
        with closing(sub.outputs(conn.disconnected)) as outputs:  # closing early aborts what is left
            for out in outputs:
                p = index[out.request_id]
                if out.finished:
                    finals[p] = out
                for d in state.deltas(p, out):
                    logprobs = None
                    if builder.top_logprobs is not None and d.logprobs is not None:
                        strings = self._token_strings(logprob_token_ids(d.token_ids, d.logprobs))
                        offset = state.advance_offset(d.index, [strings[t] for t in d.token_ids])
                        logprobs = builder.stream_logprobs(d.token_ids, d.logprobs, strings, offset)
                    conn.send_event(builder.chunk(d.index, d.text, d.finish_reason, logprobs, include_usage=usage_flag))
        ordered = [finals[i] for i in range(len(index))]
        _summarise(summary, ordered)
        if usage_flag:
            conn.send_event(builder.usage_chunk(summary.prompt_tokens, summary.completion_tokens))
        conn.send_event("[DONE]")


def _summarise(summary: Summary, finals: list[RequestOutput]) -> None:
    summary.prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
    summary.completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
    summary.finish_reasons = [c.finish_reason or "?" for o in finals for c in o.outputs]
