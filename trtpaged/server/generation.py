"""One /v1/completions or /v1/chat/completions request: validate, tokenize, submit, then answer or stream."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Optional, Sequence

from pydantic import BaseModel

from trtpaged.errors import ContextOverflow, RequestError, context_length
from trtpaged.runtime.llm import LLM
from trtpaged.runtime.outputs import RequestOutput, RequestOutputKind
from trtpaged.runtime.prompt_bound import prompt_bound
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.runtime.llm_engine import check_priority
from trtpaged.runtime.scheduler import check_request
from trtpaged.server.engine_loop import (
    ClientGone,
    EngineFailure,
    EngineLoop,
    Overloaded,
    RequestFailure,
    RequestTimeout,
    ShuttingDown,
    Subscription,
)
from trtpaged.server.errors import ApiError, from_runtime_error, overloaded
from trtpaged.server.large_answers import (OFF_LOOP_ENTRIES, check_logprob_entries, logprob_entries,
                                           logprob_entry_bound, off_loop_if)
from trtpaged.server.protocol import GenerationRequest, check_request_id, message_text, parse_generation
from trtpaged.server.reasoning import ChoiceReasoning, split_text
from trtpaged.server.responses import Echo, ResponseBuilder, TokenStrings, logprob_token_ids, sse, top_entries, usage
from trtpaged.server.schemas import CompletionTokensDetails, PromptTokensDetails, Usage, dump
from trtpaged.server.stream_state import CompletionAccumulator, StreamState
from trtpaged.server.token_bytes import token_bytes_reader
from trtpaged.server.tokenization import generation_prompt, prompt_token_ids
from trtpaged.server.tokenizer_worker import LONG_TEXT_CHARS, TokenizerWorker
from trtpaged.server.tool_parsers import CallReader
from trtpaged.server.tools import tool_format

Disconnected = Callable[[], Awaitable[bool]]
log = logging.getLogger("trtpaged.server")


@dataclass
class Summary:
    """What the server logs about one finished HTTP generation request."""

    request_id: str = "-"  # the answer's id
    header_id: str = "-"  # the answer's X-Request-Id: the caller's id when it gave one (as vLLM), else request_id
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    reasoning_tokens: int = 0  # completion tokens that were reasoning, its tags left out (a reasoning parser)
    reasoning_span: int = 0  # completion tokens that went with the reasoning, its tags included
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
    prompts: list[list[int]] = field(default_factory=list)  # token ids per prompt, after truncate_prompt_tokens
    max_tokens: list[int] = field(default_factory=list)  # per prompt, as fitted to its room and the model's cap
    logprob_entries: int = 0  # the most log-prob entries its answer could hold

    @property
    def large(self) -> bool:
        """Whether its whole answer is built and rendered off the event loop (`large_answers.OFF_LOOP_ENTRIES`)."""
        return self.logprob_entries > OFF_LOOP_ENTRIES


def runtime_failure(exc: Exception) -> ApiError:
    """The answer to a request that the server could not finish: a 400 naming the field when the request's own
    settings stopped it inside a step (token filters that allow no token), else a 5xx (the server's fault)."""
    if isinstance(exc, (ShuttingDown, Overloaded)):
        return overloaded(str(exc), busy=isinstance(exc, Overloaded))
    if isinstance(exc, RequestFailure):
        return ApiError(str(exc), exc.field)
    if isinstance(exc, RequestTimeout):
        return ApiError("request: exceeded the server's request timeout and was aborted", None, 504, "timeout_error")
    return ApiError(str(exc) if isinstance(exc, EngineFailure) else "internal server error", None, 500, "server_error")


class GenerationService:
    """Runs OpenAI generation requests on the engine loop; shared by all request handlers. Their tokenizer
    work (prompts, chat templates, log-probs' token strings, echo texts) runs on `tokens`' threads."""

    def __init__(self, llm: LLM, loop: EngineLoop, tokens: TokenizerWorker, model_names: Sequence[str],
                 max_prompt_tokens: Optional[int] = None, request_timeout_s: Optional[float] = None,
                 stream_interval: int = 1, tool_call_parser: Optional[str] = None,
                 default_chat_template_kwargs: Optional[dict[str, Any]] = None,
                 prompt_tokens_details: bool = False, force_include_usage: bool = False,
                 tokens_as_ids: bool = False, trust_request_template: bool = False,
                 max_logprob_entries: Optional[int] = None) -> None:  # fmt: skip
        self.llm = llm
        self.trust_request_template = trust_request_template  # vLLM's --trust-request-chat-template
        self.force_include_usage = force_include_usage  # vLLM's: every stream ends with its usage chunk
        self.tokens_as_ids = tokens_as_ids  # vLLM's: return_tokens_as_token_ids where a request does not say
        self.stream_interval = stream_interval  # tokens per streamed chunk (SamplingParams.stream_interval)
        self.loop = loop
        self.tokens = tokens
        # the served names (vLLM's --served-model-name a b): a request may name any; answers name the first
        self.model_names = tuple(model_names)
        self.model_name = self.model_names[0]
        self.max_seq_len = llm.config.max_seq_len
        self.vocab_size = llm.manifest.dims.vocab_size
        self.max_prompt_tokens = max_prompt_tokens
        # the engine's (LLM(max_logprobs=...), serve --max-logprobs); -1: the vocabulary
        limit = llm.config.max_logprobs
        self.max_logprobs = self.vocab_size if limit < 0 else limit
        # the most log-prob entries one answer may hold (serve --max-logprob-entries; None: large_answers' default)
        self.max_logprob_entries = logprob_entry_bound(self.max_seq_len, self.max_logprobs, max_logprob_entries)
        self.max_tokens_cap = llm.sampling_defaults.get("max_tokens")  # the model's: caps every request's (vLLM's)
        self.sampling_defaults = {k: v for k, v in llm.sampling_defaults.items() if k != "max_tokens"}
        self.request_timeout_s = request_timeout_s
        self._read_bytes: Optional[Callable[[int, str], bytes]] = None  # made on the outputs lane, on first use
        self.prompt_bound = prompt_bound(llm.tokenizer) if llm.tokenizer is not None else None
        self._submits = itertools.count()  # makes engine request ids unique when callers reuse a request_id
        self.auto_tools = auto = tool_format(getattr(llm.tokenizer, "chat_template", None),
                                             llm.manifest.dims.architecture, tool_call_parser)  # fmt: skip
        log.info("tool_choice auto: %s", f"{auto.format.name} calls" if auto.format else f"refused ({auto.reason})")
        self.template_defaults = default_chat_template_kwargs  # every chat request's, under its own
        self.prompt_tokens_details = prompt_tokens_details  # usage's cached_tokens (vLLM's flag of that name)
        # chat answers' reasoning split from their content (vLLM's --reasoning-parser: LLM(reasoning_parser=...))
        self.reasoning = llm.reasoning

    async def submit(self, body: Any, chat: bool, header_id: Optional[str] = None,
                     dry_run: bool = False, large_body: bool = False) -> Optional[Submitted]:  # fmt: skip
        """Validates, tokenizes and queues one request; raises ApiError before anything is sent. The answer's id is
        "cmpl-<id>" ("chatcmpl-<id>") of the caller's id, as vLLM's: the X-Request-Id header (`header_id`), else the
        body's request_id, else a random one. `dry_run`: every check, nothing queued (None). `large_body`: validated
        on a worker thread (the event loop serves the other clients meanwhile)."""
        caller_id = check_request_id(header_id, "X-Request-Id")
        req, params = await self._validated(body, chat, large_body)
        caller_id = caller_id if caller_id is not None else req.request_id
        prompts, tail = await self._tokenize(req)
        in_reasoning = self.reasoning is not None and req.chat and self.reasoning.starts_in_reasoning(
            prompts[0], req.chat_options.get("template_kwargs"), tail)  # fmt: skip
        if in_reasoning and params.structured_outputs is not None:  # the grammar holds for the answer (vLLM's)
            assert self.reasoning is not None
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                params.structured_outputs, starts_after=self.reasoning.end_id))  # fmt: skip
        if params.structured_outputs is not None:
            await self._compile_grammar(req, params)
        answer_id = f"{'chatcmpl' if chat else 'cmpl'}-{caller_id if caller_id is not None else uuid.uuid4().hex}"
        # what a request that fails before any output logs
        summary = Summary(request_id=answer_id, header_id=caller_id if caller_id is not None else answer_id,
                          prompt_tokens=sum(len(ids) for ids in prompts))
        # Engine ids end in this submit's own number: two requests under one caller id never share one (an engine
        # id's last "-" field is the number, so equal ids would be one submit's, whose prompt indices differ).
        serial = next(self._submits)
        requests = [(f"{answer_id}-{i}-{serial}", ids, self._fit_max_tokens(req, params, len(ids)))
                    for i, ids in enumerate(prompts)]  # fmt: skip
        entries = logprob_entries(req, params.n, [len(ids) for ids in prompts],
                                  [p.max_tokens or 0 for _, _, p in requests])  # fmt: skip
        check_logprob_entries(entries, self.max_logprob_entries)
        if dry_run:
            return None
        try:
            sub = await self.loop.submit(requests, scored_only=req.echo_only, priority=req.priority,
                                         starts_in_reasoning=in_reasoning if self.reasoning and req.chat else None)
        except ValueError as exc:
            raise from_runtime_error(exc, req.names) from None
        except (Overloaded, ShuttingDown) as exc:
            raise runtime_failure(exc) from None
        builder = ResponseBuilder(summary.request_id, self.model_name, int(time.time()), chat, req.logprobs, req.tools,
                                  req.return_token_ids, req.chat_echo,
                                  self.reasoning.fmt if self.reasoning is not None and chat else None,
                                  in_reasoning, req.show_reasoning)  # fmt: skip
        index = {rid: i for i, (rid, _, _) in enumerate(requests)}
        return Submitted(req, params, sub, index, builder, summary, prompts,
                         [p.max_tokens for _, _, p in requests], entries.total)  # fmt: skip

    async def check(self, body: Any, chat: bool, large_body: bool = False) -> None:
        """Every check `submit` makes of a body that needs no prompt tokens (its fields, tools and output grammar),
        nothing tokenized or queued; raises ApiError as `submit` would. A count of the prompt (Anthropic's
        count_tokens, OpenAI's input_tokens) refuses what generating would, yet counts a prompt longer than the
        context (what a client counts to find out). `large_body`: validated on a worker thread."""
        req, params = await self._validated(body, chat, large_body)
        if params.structured_outputs is not None:
            await self._compile_grammar(req, params)

    async def _validated(self, body: Any, chat: bool,
                         large_body: bool = False) -> tuple[GenerationRequest, SamplingParams]:  # fmt: skip
        """The request and its sampling parameters (max_tokens as asked: None is fitted to each prompt later),
        checked before any prompt is tokenized; raises ApiError naming the field. `large_body`: parsed on a worker
        thread."""
        req = await off_loop_if(large_body, parse_generation, body, chat, self.model_names, self.vocab_size,
                                self.auto_tools, self.max_logprobs, self.template_defaults,
                                self.trust_request_template)  # fmt: skip
        if req.chat:  # the server's --chat-template-content-format (LLM's), for whichever template renders it
            req.chat_options["content_format"] = self.llm.chat_template_content_format
        if self.force_include_usage and req.stream:
            req.include_usage = True
        if self.tokens_as_ids and body.get("return_tokens_as_token_ids") is None:
            req.tokens_as_ids = True
        try:
            check_priority(req.priority, self.llm.config.scheduling_policy)
        except RequestError as exc:
            raise from_runtime_error(exc, req.names) from None
        params = self._params(req, req.max_tokens)
        if params.thinking_token_budget is not None and self.reasoning is None:
            raise ApiError("thinking_token_budget: needs a reasoning parser to know where the thinking ends (serve "
                           "--reasoning-parser)", "thinking_token_budget")  # fmt: skip
        self._check_num_prompts(req)
        return req, params

    def _cached_details(self, summary: Summary) -> Optional[PromptTokensDetails]:
        """usage.prompt_tokens_details (serve --enable-prompt-tokens-details): only when some prompt tokens were
        found in the prefix cache, as vLLM's; else null."""
        if self.prompt_tokens_details and summary.cached_tokens:
            return PromptTokensDetails(cached_tokens=summary.cached_tokens)
        return None

    # ---- request -> engine requests -----------------------------------------------------------
    def _params(self, req: GenerationRequest, max_tokens: Optional[int]) -> SamplingParams:
        """The engine request's parameters. Every request is served from DELTA outputs: each step hands over
        only what is new (stop strings held back by the runtime), a stream sends it on (every
        `stream_interval` tokens: the server's, or the request's when larger, as vLLM's), a full body joins it."""
        interval = max(self.stream_interval, req.stream_interval) if req.stream else 1
        # the model's recommended settings where the request sets none (vLLM's rule); a beam search samples nothing
        model = {} if req.sampling.get("beam_width", 1) > 1 else self.sampling_defaults
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=req.logprobs, output_kind=RequestOutputKind.DELTA,
                                  stream_interval=interval, **{**model, **req.sampling})
        except ValueError as exc:
            raise from_runtime_error(exc, req.names) from None

    async def _compile_grammar(self, req: GenerationRequest, params: SamplingParams) -> None:
        """Compiles the request's grammar on the grammars lane (once per distinct grammar, then cached), so that
        the engine thread's add_request finds it compiled instead of stalling every running request."""
        grammars = self.llm.engine.grammars
        try:
            await self.loop.call_async(lambda e: grammars.prepare())  # the tokenizer is the engine thread's
            await self.tokens.grammar(lambda: grammars.compile(params.structured_outputs))
        except ValueError as exc:
            raise from_runtime_error(exc, req.names) from None
        except (Overloaded, ShuttingDown) as exc:
            raise runtime_failure(exc) from None

    def _check_num_prompts(self, req: GenerationRequest) -> None:
        """Each prompt is one engine request: more than the waiting queue holds could never be admitted
        (400, where a queue that is full for now is 503)."""
        limit = self.loop.max_waiting
        if limit is not None and len(req.prompts) > limit:
            raise ApiError(f"prompt: {len(req.prompts)} prompts in one request exceeds this server's max_waiting "
                           f"({limit}), the most requests it queues at once; send at most {limit}", "prompt")

    async def _tokenize(self, req: GenerationRequest) -> tuple[list[list[int]], Optional[str]]:
        """Prompt token ids, computed on the prompts lane (its own tokenizer: the engine thread steps meanwhile),
        and, for a chat request on a server with a reasoning parser, the template's generation prompt (where the
        answer starts: in the thinking or not)."""
        vocab = self.vocab_size
        field_name = "messages" if req.chat else "prompt"
        keep = self._kept_tokens(req)
        check = self._text_bound(field_name) if keep is None else None

        def run(tokenizer: Any) -> tuple[list[list[int]], Optional[str]]:
            if req.chat:
                tools, text = req.shown_tools, []
                ids = prompt_token_ids(tokenizer, vocab, None, req.messages, tools, req.chat_options,
                                       req.add_special_tokens, check, text)  # fmt: skip
                tail = generation_prompt(tokenizer, req.messages, tools, req.chat_options, text[0]) if \
                    self.reasoning else None  # fmt: skip
                return [ids], tail
            return [prompt_token_ids(tokenizer, vocab, p, None, None, {}, req.add_special_tokens, check)
                    for p in req.prompts], None  # fmt: skip

        texts = ["".join(message_text(m) for m in req.messages)] if req.chat else \
            [p for p in req.prompts if isinstance(p, str)]  # fmt: skip
        try:
            if check is not None:  # before the lane: what the request's own text makes at least
                for text in texts:
                    check(text)
            prompts, tail = await self.tokens.prompt(run, sum(map(len, texts)) > LONG_TEXT_CHARS)
        except ValueError as exc:
            raise from_runtime_error(exc, req.names) from None
        except (ShuttingDown, Overloaded) as exc:
            raise runtime_failure(exc) from None
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer error is the request's fault
            raise ApiError(f"{field_name}: could not be tokenized ({type(exc).__name__})", field_name) from None
        if keep is not None:  # vLLM's: the last k tokens (a chat prompt's too: its template's start may go)
            prompts = [p[-keep:] if req.truncate_left else p[:keep] for p in prompts]
        limit = self.max_prompt_tokens
        longest = max((len(p) for p in prompts), default=0)
        if limit is not None and longest > limit:
            whole = limit >= self.max_seq_len - 1  # the limit is the model's context: say so as for the context
            raise ApiError(f"{field_name}: {longest} tokens exceeds this server's prompt limit ({limit})"
                           + (f". {context_length(self.max_seq_len, longest)}." if whole else ""), field_name,
                           overflow=ContextOverflow(self.max_seq_len, longest) if whole else None)  # fmt: skip
        return prompts, tail

    def _text_bound(self, field_name: str) -> Optional[Callable[[str], None]]:
        """A check that refuses a text making more tokens than a prompt may have, told by its length alone
        (runtime/prompt_bound.py), before it is tokenized (megabytes: seconds of a tokenizer thread, and of a core);
        None where the tokenizer gives no bound. A chat is checked on its messages' text before the lane, then on
        the template's whole text (roles, and whatever else it renders) before that is tokenized."""
        bound = self.prompt_bound
        if bound is None:
            return None
        limit = self.max_seq_len - 1 if self.max_prompt_tokens is None else min(self.max_prompt_tokens,
                                                                                self.max_seq_len - 1)  # fmt: skip

        def check(text: str) -> None:
            nbytes = len(text.encode("utf-8", errors="surrogatepass"))
            fewest = bound.fewest_tokens(nbytes)
            if fewest > limit:
                whole = limit == self.max_seq_len - 1  # the model's context, not the server's prompt limit
                context = f" {context_length(self.max_seq_len, fewest)} or more." if whole else ""
                raise RequestError(field_name, f"{nbytes} bytes of text make at least {fewest} tokens with this "
                                   f"tokenizer, more than a prompt may have here ({limit}); send less text, or set "
                                   f"truncate_prompt_tokens.{context}", limit,
                                   overflow=ContextOverflow(self.max_seq_len, fewest) if context else None)  # fmt: skip

        return check

    def _kept_tokens(self, req: GenerationRequest) -> Optional[int]:
        """truncate_prompt_tokens as vLLM reads it: at most what max_seq_len leaves beside the output (max_tokens;
        unset: the one token, or min_tokens, it needs at least), -1 that much. An output that leaves no room is
        max_tokens' fault, which `check_request` names."""
        k = req.truncate_prompt_tokens
        if k is None:
            return None
        output = req.max_tokens if req.max_tokens is not None else max(1, req.sampling.get("min_tokens") or 0)
        room = self.max_seq_len - output
        if room < 1:
            return max(k, 1)
        if k > room:
            raise ApiError(f"truncate_prompt_tokens: {k} prompt tokens + {output} output tokens exceeds max_seq_len "
                           f"({self.max_seq_len}); at most {room} here (-1: that many)", "truncate_prompt_tokens")
        return room if k == -1 else k

    def _fit_max_tokens(self, req: GenerationRequest, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Unset max_tokens: what max_seq_len leaves; at most the model's own max_tokens default, as vLLM caps it.
        Then the runtime's own `check_request` on this prompt, so that a request of several prompts is refused
        before any of them is queued."""
        try:
            if req.max_tokens is None:
                fitted = max(1, self.max_seq_len - prompt_len)
            else:  # the request's own max_tokens must fit the room first (vLLM's order), cap or no cap
                check_request(self.llm.config, prompt_len, params)
                fitted = params.max_tokens
            cap = self.max_tokens_cap
            if cap is not None and fitted is not None and fitted > cap:
                if params.min_tokens > cap:
                    name = req.names.get("min_tokens", "min_tokens")
                    raise ApiError(f"{name}: {params.min_tokens} is more than this model's max_new_tokens {cap}, "
                                   "which caps max_tokens (serve --generation-config vllm does not)", name)
                fitted = cap
            if fitted != params.max_tokens:  # re-checks the fields that depend on it (min_tokens), then the limits
                params = dataclasses.replace(params, max_tokens=fitted)
                check_request(self.llm.config, prompt_len, params)
        except RequestError as exc:
            raise from_runtime_error(exc, req.names) from None
        return params

    # ---- answers ------------------------------------------------------------------------------
    async def _token_strings(self, req: GenerationRequest, ids: Iterable[int]) -> TokenStrings:
        """The tokens' texts (and, for chat, their own bytes), read on the outputs lane."""
        ids = sorted(set(ids))
        if not ids:
            return TokenStrings({}, as_ids=req.tokens_as_ids)

        def read(tokenizer: Any) -> TokenStrings:
            text = {t: tokenizer.decode([t], skip_special_tokens=False) for t in ids}
            if not req.chat:
                return TokenStrings(text, as_ids=req.tokens_as_ids)
            if self._read_bytes is None:  # the outputs lane is one thread: one tokenizer, one reader
                self._read_bytes = token_bytes_reader(tokenizer)
            return TokenStrings(text, {t: self._read_bytes(t, text[t]) for t in ids}, req.tokens_as_ids)

        return await self.tokens.output(read)

    async def respond(self, s: Submitted, disconnected: Disconnected, started: Optional[Callable[[], None]] = None,
                      keep_cut: bool = False) -> BaseModel:  # fmt: skip
        """The full (non-streamed) body once every choice finished; raises ClientGone or the engine's error.
        `started` is called once, at the first output (the request was admitted and ran a step). `keep_cut`: a
        request ended by `disconnected` (a cancel) after its first output answers with what it generated so far,
        its choices' finish_reason "abort", instead of raising ClientGone."""
        joined = [CompletionAccumulator() for _ in s.index]
        whole = True
        try:
            async with aclosing(s.sub.outputs(disconnected, self.request_timeout_s)) as outputs:
                async for out in outputs:
                    if started is not None:
                        started()
                        started = None
                    joined[s.index[out.request_id]].add(out)
        except BaseException as exc:  # ended early (cancelled, client gone, a failure): what it generated is its usage
            s.summary.completion_tokens = sum(len(c.token_ids) for j in joined for c in j.completions.values())
            if not (keep_cut and isinstance(exc, ClientGone) and all(j.last is not None for j in joined)):
                raise
            whole = False
        ordered = [j.result() if whole else j.cut() for j in joined]
        echoes = await self._echoes(s, ordered) if s.req.echo else None
        strings = await self._token_strings(s.req, await off_loop_if(s.large, lambda: _shown_ids(s, ordered, echoes)))
        return await off_loop_if(s.large, lambda: self._body(s, ordered, strings, echoes))

    def _body(self, s: Submitted, ordered: list[RequestOutput], strings: TokenStrings,
              echoes: Optional[list[Echo]]) -> BaseModel:  # fmt: skip
        """The whole answer of `s`, its outputs `ordered` by prompt; its summary filled in."""
        body = s.builder.full(ordered, s.params.n, strings, echoes, s.req.echo_only, s.req.prompt_logprobs)
        _summarise(s.summary, ordered, s.req.echo_only)
        body.usage.prompt_tokens_details = self._cached_details(s.summary)
        if self.reasoning is not None and s.builder.reasoning is not None:
            fmt, start = s.builder.reasoning, s.builder.in_reasoning
            entered = [(c.token_ids, split_text(fmt, start, c.text)[2]) for o in ordered for c in o.outputs]
            s.summary.reasoning_tokens = sum(self.reasoning.reasoning_tokens(*e) for e in entered)
            s.summary.reasoning_span = sum(self.reasoning.reasoning_span(*e) for e in entered)
            body.usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=s.summary.reasoning_tokens)
        return body

    async def _echoes(self, s: Submitted, outs: Iterable[RequestOutput]) -> list[Echo]:
        """Each prompt as `echo` shows it: its own text (token-id prompts decoded), tokens and log-probs
        (cut to the `logprobs` asked for, when asked; off the loop for a large answer)."""
        outs = list(outs)
        texts = await self.tokens.output(lambda tokenizer: [o.prompt if o.prompt is not None else tokenizer.decode(
            o.prompt_token_ids, skip_special_tokens=False) for o in outs])  # fmt: skip
        k = s.req.logprobs
        return await off_loop_if(s.large, lambda: [
            Echo(text, list(o.prompt_token_ids), None if k is None or o.prompt_logprobs is None else
                 top_entries(o.prompt_logprobs, o.prompt_token_ids, k)) for text, o in zip(texts, outs)])  # fmt: skip

    async def stream(self, s: Submitted) -> AsyncIterator[bytes]:
        """Server-Sent Events: chunks, the usage chunk if asked for, then `[DONE]`. A failure after the
        stream started is sent as an error event (then `[DONE]`); a cancelled stream aborts its requests."""
        params, builder = s.params, s.builder
        # with a reasoning parser every delta with tokens counts (where the reasoning's tokens end)
        state = StreamState(params.n, builder.top_logprobs is not None or s.req.return_token_ids or
                            builder.reasoning is not None)  # fmt: skip
        ids, continuous = s.req.return_token_ids, s.req.continuous_usage  # per chunk: nothing when not asked for
        first = _FirstChunks(s) if ids else None  # return_token_ids: the prompt's ids go with a choice's first chunk
        echoed: set[int] = set()  # prompts whose echo chunk went out
        tool_readers: dict[int, CallReader] = {}  # choice -> its tool-call parser
        thoughts: dict[int, ChoiceReasoning] = {}  # choice -> its reasoning (a server with a reasoning parser)
        cached: dict[int, int] = {}  # prompt -> its tokens found in the prefix cache
        if s.req.chat:
            for p in range(len(s.index)):
                for i in range(params.n):
                    index = p * params.n + i
                    yield sse(builder.chunk(index, "", role=True, usage=_chunk_usage(s, state, index),
                                            prompt_token_ids=first.take(index) if first else None))  # fmt: skip
                    if builder.echo:  # vLLM's chat echo: the last message's text as the first content
                        yield sse(builder.chunk(index, builder.echo, usage=_chunk_usage(s, state, index)))
        try:
            # Disconnects cancel this generator (the ASGI server's disconnect listener); no polling here.
            async with aclosing(s.sub.outputs(_never, self.request_timeout_s)) as outputs:
                async for out in outputs:
                    if out.num_cached_tokens is not None:
                        cached[s.index[out.request_id]] = out.num_cached_tokens
                        s.summary.cached_tokens = sum(cached.values())  # known from the first output on
                    if s.req.echo and s.index[out.request_id] not in echoed:
                        echoed.add(s.index[out.request_id])
                        async for event in self._echo_chunks(s, state, s.index[out.request_id], out, first):
                            yield event
                    for d in state.deltas(s.index[out.request_id], out):
                        so_far = _chunk_usage(s, state, d.index) if continuous else None
                        new_ids = ([] if s.req.echo_only else list(d.token_ids)) if ids else None
                        prompt_ids = first.take(d.index) if first else None
                        if s.req.echo_only:  # the one sampled token is not part of the answer, nor what ended it
                            if d.finish_reason:
                                yield sse(builder.chunk(d.index, "", "length", stop_reason=None,
                                                        usage=so_far, token_ids=new_ids,
                                                        prompt_token_ids=prompt_ids))  # fmt: skip
                            continue
                        logprobs, text = None, d.text
                        if self.reasoning is not None and builder.reasoning is not None:
                            # the reasoning first, with its tokens' log-probs and ids; then the answer with the rest
                            reading = thoughts.setdefault(d.index, ChoiceReasoning(self.reasoning,
                                                                                   builder.in_reasoning))  # fmt: skip
                            got = reading.read(d.text, d.token_ids, d.logprobs, bool(d.finish_reason))
                            if got is None:  # its start is held back (whitespace, or part of a start tag)
                                continue
                            thought, text, token_ids, raw, cut = got
                            own = None
                            if builder.top_logprobs is not None and raw is not None:
                                strings = await self._token_strings(s.req, logprob_token_ids(token_ids, raw))
                                own = builder.stream_logprobs(token_ids[:cut], raw[:cut], strings, 0) if cut else None
                                logprobs = builder.stream_logprobs(token_ids[cut:], raw[cut:], strings, 0) if \
                                    cut < len(token_ids) else None  # fmt: skip
                            new_ids = token_ids if ids else None
                            if builder.show_reasoning and (thought or (cut and (own is not None or ids))):
                                yield sse(builder.reasoning_chunk(d.index, thought, own, so_far,
                                                                  token_ids[:cut] if ids else None, prompt_ids))
                                prompt_ids, new_ids = None, token_ids[cut:] if ids else None
                            if not (text or d.finish_reason or logprobs is not None or new_ids):
                                continue
                        elif builder.top_logprobs is not None and d.logprobs is not None:
                            strings = await self._token_strings(s.req, logprob_token_ids(d.token_ids, d.logprobs))
                            offset = state.advance_offset(d.index, [strings.text[t] for t in d.token_ids])
                            logprobs = builder.stream_logprobs(d.token_ids, d.logprobs, strings, offset)
                        if s.req.tools is not None:  # content and calls as the parser reads them
                            reader = tool_readers.setdefault(d.index, s.req.tools.stream())
                            for chunk in builder.tool_stream_chunks(d.index, reader, text, d.finish_reason,
                                                                    logprobs, d.stop_reason, new_ids):  # fmt: skip
                                chunk.usage = so_far
                                yield sse(chunk)
                            continue
                        yield builder.event(d.index, text, d.finish_reason, logprobs, d.stop_reason, so_far, new_ids,
                                            prompt_ids)  # fmt: skip
        except (EngineFailure, ShuttingDown, RequestTimeout) as exc:
            # what was sent before the failure is logged as sent (the request log feeds `diagnose`); the prompt
            # tokens are the submitted ones (none may have been sent: a request that timed out waiting)
            s.summary.completion_tokens = 0 if s.req.echo_only else state.completion_tokens
            s.summary.finish_reasons = [type(exc).__name__]
            yield sse(dump(runtime_failure(exc).body()))
            yield sse("[DONE]")
            return
        except BaseException:  # closed early (cancelled, the client gone): what it generated is its usage
            s.summary.completion_tokens = 0 if s.req.echo_only else state.completion_tokens
            raise
        s.summary.prompt_tokens = sum(state.prompt_tokens.values())
        s.summary.cached_tokens = sum(cached.values())
        s.summary.completion_tokens = 0 if s.req.echo_only else state.completion_tokens
        s.summary.finish_reasons = ["length"] * len(state.finish_reasons) if s.req.echo_only else state.finish_reasons
        s.summary.reasoning_tokens = sum(reading.reasoning_tokens for reading in thoughts.values())
        s.summary.reasoning_span = sum(reading.span for reading in thoughts.values())
        if s.req.include_usage:
            last = builder.usage_chunk(s.summary.prompt_tokens, s.summary.completion_tokens)
            last.usage.prompt_tokens_details = self._cached_details(s.summary)
            if self.reasoning is not None and builder.reasoning is not None:
                last.usage.completion_tokens_details = CompletionTokensDetails(
                    reasoning_tokens=s.summary.reasoning_tokens)
            yield sse(last)
        yield sse("[DONE]")


    async def _echo_chunks(self, s: Submitted, state: StreamState, prompt: int, out: RequestOutput,
                           first: Optional[_FirstChunks]) -> AsyncIterator[bytes]:  # fmt: skip
        """`echo` in a stream: each choice of a prompt starts with the prompt's text (and its log-probs)."""
        (echo,) = await self._echoes(s, [out])
        strings = await self._token_strings(s.req, logprob_token_ids(echo.token_ids, echo.logprobs) if echo.logprobs
                                            else ())  # fmt: skip
        for i in range(s.params.n):
            index, logprobs = prompt * s.params.n + i, None
            if echo.logprobs is not None:
                offset = state.advance_offset(index, [strings.text[t] for t in echo.token_ids])
                logprobs = s.builder.stream_logprobs(echo.token_ids, echo.logprobs, strings, offset)
            yield sse(s.builder.chunk(index, echo.text, None, logprobs, usage=_chunk_usage(s, state, index),
                                      token_ids=[] if first else None, prompt_token_ids=first.take(index) if first
                                      else None))  # fmt: skip


async def _never() -> bool:
    return False


def _shown_ids(s: Submitted, ordered: Sequence[RequestOutput], echoes: Optional[Sequence[Echo]]) -> set[int]:
    """Every token id whose text the answer's log-probs show."""
    ids: set[int] = set()
    if s.builder.top_logprobs is not None:
        for out in ordered:
            for c in out.outputs:
                ids |= logprob_token_ids(c.token_ids, c.logprobs)
    for out in ordered:
        if s.req.prompt_logprobs is not None or (echoes and s.builder.top_logprobs is not None):
            ids |= logprob_token_ids(out.prompt_token_ids, out.prompt_logprobs)
    return ids


def _chunk_usage(s: Submitted, state: StreamState, index: int) -> Optional[Usage]:
    """stream_options.continuous_usage_stats: a chunk's usage, as vLLM reports it: its choice's prompt and the
    tokens that choice generated so far; None when not asked for."""
    if not s.req.continuous_usage:
        return None
    return usage(len(s.prompts[index // s.params.n]), 0 if s.req.echo_only else state.tokens_of(index))


class _FirstChunks:
    """return_token_ids in a stream: the prompt's token ids, given once per choice (with its first chunk)."""

    def __init__(self, s: Submitted) -> None:
        self.s = s
        self.sent: set[int] = set()

    def take(self, index: int) -> Optional[list[int]]:
        if index in self.sent:
            return None
        self.sent.add(index)
        return list(self.s.prompts[index // self.s.params.n])


def _summarise(summary: Summary, finals: list[RequestOutput], echo_only: bool = False) -> None:
    summary.prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
    summary.completion_tokens = 0 if echo_only else sum(len(c.token_ids) for o in finals for c in o.outputs)
    # echo_only: the answer's "length", not what ended the token sampled to score the prompt (dropped)
    summary.finish_reasons = [("length" if echo_only else c.finish_reason) or "?" for o in finals for c in o.outputs]
    summary.cached_tokens = sum(o.num_cached_tokens or 0 for o in finals)
