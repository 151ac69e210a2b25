"""The FastAPI application: routes, API-key check, body limits, errors as OpenAI error bodies.

Handlers never touch the engine: they validate, then go through `GenerationService`
(or `Tokenization`), `TokenizerWorker` (every tokenizer call) and `EngineLoop` (every engine call).
"""

from __future__ import annotations

import asyncio
import email.message
import functools
import hmac
import json
import logging
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Optional, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from trtpaged import __version__, json_input
from trtpaged.errors import CONTEXT_LENGTH_EXCEEDED
from trtpaged.json_input import LongNumber, RepeatedField
from trtpaged.server import messages_api, messages_output, responses_api, responses_output
from trtpaged.server.engine_loop import ClientGone, EngineFailure, EngineLoop, Overloaded, RequestTimeout, ShuttingDown
from trtpaged.server.errors import ApiError, overloaded
from trtpaged.server.generation import GenerationService, Submitted, runtime_failure
from trtpaged.server.large_answers import off_loop_if, render_json
from trtpaged.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, ServerMetrics, aged
from trtpaged.server.options import LOOPBACK_ORIGINS, ServerOptions
from trtpaged.server.protocol import chat_form, check_model
from trtpaged.server.request_id_headers import RequestIdHeaders
from trtpaged.server.responses_store import ResponsesStore
from trtpaged.server.schemas import ModelCard, ModelList, dump
from trtpaged.server.stored_responses import Claim, StoredResponses
from trtpaged.server.tokenization import Tokenization

log = logging.getLogger("trtpaged.server")
T = TypeVar("T")
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
          "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics", "/version", "/ping", "/invocations")
ANTHROPIC_PATH = "/v1/messages"  # it and the routes under it are answered in Anthropic's error envelope


def error_response(error: ApiError, anthropic: bool = False) -> JSONResponse:
    """The error body: OpenAI's, or Anthropic's envelope (the /v1/messages routes)."""
    body = messages_output.error_body(error) if anthropic else dump(error.body())
    return JSONResponse(body, error.status_on(anthropic), headers=error.headers or None)


def route_path(scope: Mapping[str, Any]) -> str:
    """The request's path less the server's root path (--root-path) where it starts with it: a proxy may forward
    /api/v1/models or, having cut its prefix, /v1/models; both are the route /v1/models (Starlette's routing rule)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


def _anthropic_scope(scope: Mapping[str, Any]) -> bool:
    path = route_path(scope)
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def _anthropic(request: Request) -> bool:
    return _anthropic_scope(request.scope)


def is_json_content_type(value: str | None) -> bool:
    """Whether a request body of this Content-Type is read as JSON: application/json or application/*+json, or
    none given (as FastAPI reads a JSON body, so vLLM's server). Any other type (text/plain, a form) is refused:
    a web page may send those cross-origin to a server on localhost without a CORS preflight."""
    if not value:
        return True
    message = email.message.Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


# A body past this is decoded and validated on a worker thread: pydantic's validation of a 6 MB chat body of 150k
# messages held the event loop (every other client's /health and stream) 0.5-1.7 s; the hand-over costs more than
# it saves on the 1-100 KB of most bodies
LARGE_BODY_BYTES = 256 << 10
# the codings of a body read as it comes, by header (any other is refused: a compressed body read was not UTF-8)
_PLAIN_CODINGS = {"content-encoding": ("", "identity"), "transfer-encoding": ("", "identity", "chunked")}
DRAIN_POLL_S = 0.1  # how often a request still receiving its body checks whether the server drains
STATS_WAIT_S = 1.0  # how long /metrics waits for the engine's counters before it serves the last ones read


def parse_json(raw: bytes) -> Any:
    """Strict JSON (no NaN/Infinity, no field given twice in one object) in strict UTF-8 (a leading BOM is ignored,
    as RFC 8259 allows); any failure is a 400 on `body`. Decoded here rather than by `json.loads(bytes)`, which would
    also accept UTF-16 and UTF-32."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ApiError("body: is not valid UTF-8", "body") from None
    if not text.strip():  # json's word for it: "Expecting value: line 1 column 1 (char 0)"
        raise ApiError("body: empty (a Content-Length of 0, or none on HTTP/1.0); send the request as a JSON object",
                       "body")  # fmt: skip
    try:
        return json_input.loads(text)
    except RepeatedField as exc:
        raise ApiError(f"body: {exc}", "body") from None
    except LongNumber as exc:
        where = exc.path if exc.field else "body" + exc.path  # "body[0]": in an array that is the whole body
        raise ApiError(f"{where}: {exc.message}", exc.field or "body") from None
    except RecursionError:
        raise ApiError("body: JSON nested too deeply", "body") from None
    except ValueError as exc:
        raise ApiError(f"body: malformed JSON ({exc})", "body") from None


async def unless_disconnected(request: Request, work: Awaitable[T], poll_s: float = 0.25) -> T:
    """`work`'s result, or ClientGone once the client has closed its connection: `work` (waiting on a lane or
    the engine thread, or running there) is cancelled, so a job not yet begun never runs."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                if task.done():  # it finished during that await: its caller's own disconnect check aborts what it made
                    return task.result()
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class EngineStats:
    """The engine's counters for /metrics. They are read on the engine thread between steps; a scrape waits at most
    STATS_WAIT_S for them and otherwise gets the last ones read (one step old), so a long step (a prefill of
    thousands of tokens on a busy CPU: 10 s and more) does not hold the scrape past Prometheus' 10 s timeout; the
    requests' ages in them have grown since (metrics.aged), so a request held by a stuck step still ages."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.last: Optional[tuple[float, dict[str, float]]] = None  # when read (time.monotonic()), what was read
        self.pending: Optional[asyncio.Future] = None  # one read in flight, whatever the number of scrapes

    async def latest(self) -> dict[str, float]:
        if self.pending is None or self.pending.done():
            self.pending = asyncio.ensure_future(self.loop.call_async(lambda e: (time.monotonic(), e.stats())))
            self.pending.add_done_callback(self._keep)
        try:
            # the first scrape has nothing older to give, and waits
            self.last = await asyncio.wait_for(asyncio.shield(self.pending),
                                               None if self.last is None else STATS_WAIT_S)  # fmt: skip
        except asyncio.TimeoutError:
            pass
        read_at, stats = self.last
        return aged(stats, time.monotonic() - read_at)

    def _keep(self, read: asyncio.Future) -> None:
        """A read's counters become the last ones even where the scrape that began it stopped waiting (the next
        scrape serves them); its failure is taken here, which nobody awaits then (the engine stopped: the scrapes
        that follow get no counters)."""
        if not read.cancelled() and read.exception() is None:
            self.last = read.result()


class DrainBegan(Exception):
    """The server began to drain while a request's body was still arriving."""


class StatusCounter:
    """ASGI middleware: counts responses by route and status (the status the handler sent, 499 if none); sets the
    server's root path (--root-path) on each request, which the routing strips from paths that start with it."""

    def __init__(self, app: Callable[..., Awaitable[None]], metrics: ServerMetrics, root_path: str = "") -> None:
        self.app, self.metrics, self.root_path = app, metrics, root_path

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.root_path:
            scope = {**scope, "root_path": self.root_path}
        status = 499

        async def counted_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            path = route_path(scope).rstrip("/") or "/"
            self.metrics.observe_http(path if path in ROUTES else "other", status)


class Draining:
    """Set once shutdown begins: new generation requests get 503, /health reports it."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()


def create_app(service: GenerationService, loop: EngineLoop, metrics: ServerMetrics, cards: list[ModelCard],
               options: ServerOptions, draining: Draining) -> Any:  # fmt: skip
    """The ASGI app (FastAPI wrapped in the request-id and status-counting middlewares)."""
    app = FastAPI(title="trtpaged", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    expected_keys = [k.encode() for k in options.api_keys]  # any of them (vLLM's --api-key k1 k2)
    origins = options.allowed_origins
    app.add_middleware(CORSMiddleware, allow_origins=origins or (),
                       allow_origin_regex=None if origins else LOOPBACK_ORIGINS,
                       allow_methods=options.allowed_methods, allow_headers=options.allowed_headers,
                       allow_credentials=options.allow_credentials,
                       expose_headers=("X-Request-Id", "Retry-After", "request-id"))  # request-id: Anthropic's

    async def authorize(request: Request) -> None:
        """The key as `Authorization: Bearer KEY`, or as Anthropic's clients send it, `x-api-key: KEY`."""
        if not expected_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        anthropic_key = request.headers.get("x-api-key")
        # either header may carry the key (the anthropic client sends both when given an api_key and an auth_token)
        offered = ([given.strip()] if scheme.lower() == "bearer" else []) + ([anthropic_key] if anthropic_key else [])
        matches = [hmac.compare_digest(o.encode(), k) for o in offered for k in expected_keys]  # no early exit
        ok = any(matches)
        if not ok:
            raise ApiError("authorization: missing or wrong API key (send 'Authorization: Bearer KEY' or "
                           "'x-api-key: KEY')", None, 401, "authentication_error", "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"})  # fmt: skip

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc, _anthropic(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = ApiError(f"path: no route {request.method} {request.url.path}", "path", 404, "not_found_error")
        elif exc.status_code == 405:
            error = ApiError(f"method: {request.url.path} does not take {request.method}", "method", 405)
        else:
            error = ApiError(str(exc.detail), None, exc.status_code)
        return error_response(error, _anthropic(request))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        error = ApiError("internal server error (see the server log)", None, 500, "server_error")
        return error_response(error, _anthropic(request))

    async def discard_body(request: Request, budget: int) -> None:
        """Reads and drops up to `budget` more bytes of a refused body (bounded in bytes and time): closing
        a connection with unread data resets it, and the client would get the reset instead of the 413."""
        async def drain() -> None:
            seen = 0
            async for chunk in request.stream():
                seen += len(chunk)
                if seen >= budget:
                    return

        try:
            await until_draining(asyncio.wait_for(drain(), options.body_timeout_s))
        except (asyncio.TimeoutError, ClientDisconnect, DrainBegan):
            pass
        except RuntimeError:  # Starlette's "Stream consumed": nothing is left to read
            pass

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        limit = options.max_body_bytes
        content_type = request.headers.get("content-type")
        if not is_json_content_type(content_type):
            await discard_body(request, limit)
            raise ApiError(f"content-type: {content_type[:80]!r} is not JSON; send the body as application/json",
                           "body", 415, headers={"Connection": "close"})  # fmt: skip
        for header, plain in _PLAIN_CODINGS.items():
            encoding = ", ".join(request.headers.getlist(header))  # each header's codings apply, in order
            if any(c.strip().lower() not in plain for c in encoding.split(",")):
                await discard_body(request, limit)
                raise ApiError(f"{header}: {encoding[:80]!r} is not supported; send the body uncompressed",
                               "body", 415, headers={"Connection": "close"})  # fmt: skip
        if declared is not None:
            if not declared.isdigit():
                raise ApiError("content-length: must be a non-negative integer", "body")
            if int(declared) > limit:
                await discard_body(request, min(int(declared), 2 * limit))
                raise ApiError(f"body: {declared} bytes exceeds the limit ({limit})", "body", 413,
                               headers={"Connection": "close"})  # fmt: skip
        chunks: list[bytes] = []
        size = 0

        async def receive_all() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    await discard_body(request, limit)
                    raise ApiError(f"body: more than the limit ({limit} bytes)", "body", 413,
                                   headers={"Connection": "close"})
                chunks.append(chunk)

        try:
            await until_draining(asyncio.wait_for(receive_all(), options.body_timeout_s))
        except asyncio.TimeoutError:
            raise ApiError(f"body: not received within {options.body_timeout_s:g} s", "body", 408, "timeout_error",
                           headers={"Connection": "close"}) from None  # fmt: skip
        except ClientDisconnect:
            raise ClientGone() from None
        except DrainBegan:  # the rest of the body is not read: the connection closes
            error = overloaded("the server is shutting down", options.retry_after_s, busy=False)
            error.headers["Connection"] = "close"
            raise error from None
        return b"".join(chunks)

    async def until_draining(work: Awaitable[T]) -> T:
        """`work`'s result (reading a body), or DrainBegan once the server drains: a body still arriving when
        shutdown began held the HTTP server's own shutdown for its graceful timeout (5 s), which then cancelled its
        request with a traceback and answered 500."""
        task = asyncio.ensure_future(work)
        try:
            while not (await asyncio.wait({task}, timeout=DRAIN_POLL_S))[0]:
                if draining:
                    raise DrainBegan()
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def read_json(request: Request) -> tuple[Any, bool]:
        """The request's JSON body, and whether it is large (past LARGE_BODY_BYTES: decoded on a worker thread, and
        validated there too by the routes that take the flag)."""
        raw = await read_body(request)
        large = len(raw) > LARGE_BODY_BYTES
        return await off_loop_if(large, parse_json, raw), large

    config = service.llm.config
    cache_block_size = config.block_size if config.enable_prefix_caching else 0  # a Response's cache_write_tokens
    size = options.responses_store_size
    stored = StoredResponses(ResponsesStore(size) if size else None, service, cache_block_size)

    async def generate(request: Request, chat: bool, responses: bool = False,
                       given: Optional[tuple[Any, bool]] = None, messages: bool = False) -> Response:  # fmt: skip
        """One generation request; `responses`: a /v1/responses body, `messages` a /v1/messages one, each served as
        the chat body it translates to; `given`: the body already read, and whether it is large (/invocations)."""
        start = time.monotonic()
        if draining:
            metrics.observe_rejected("draining")
            raise overloaded("the server is shutting down", options.retry_after_s, busy=False)
        call, claimed, message_call = None, None, None
        try:
            body, large = await read_json(request) if given is None else given
            if messages:
                message_call = await off_loop_if(large, messages_api.translate, body, service.model_names,
                                                 service.reasoning is not None)  # fmt: skip
                body = message_call.chat_body
            if responses:
                call = responses_api.translate(body, service.model_names, stored.store, service.max_logprobs,
                                              service.vocab_size)  # fmt: skip
                body = call.chat_body
                claimed = stored.claim(call, request.headers.get("x-request-id"))
                if call.req.truncation == "auto":
                    body = await unless_disconnected(request, fitted(call, request.headers.get("x-request-id")))
            submitting = service.submit(body, chat, request.headers.get("x-request-id"), large_body=large)
            submitted = await unless_disconnected(request, submitting)
            assert submitted is not None
        except ClientGone:
            stored.release(claimed)
            _log(request, 499, "client disconnected before its request was queued", start)
            return Response(status_code=499)
        except ApiError as exc:
            stored.release(claimed)
            if exc.status == 503:
                metrics.observe_rejected("draining" if draining else "overloaded")
                exc.headers["Retry-After"] = str(options.retry_after_s)
            error = responses_api.renamed(exc, call) if call is not None else exc  # the client's field names
            error = messages_api.renamed(error, message_call) if message_call is not None else error
            _log(request, error.status_on(_anthropic(request)), error.message, start)  # as answered (529)
            raise error from None
        summary = submitted.summary
        if message_call is not None:
            return await answer_message(request, submitted, start, message_call)
        if call is None:
            return await answer(request, submitted, start)
        # logged and answered under the Response's id; vLLM's: a body's request_id is the Response's id as given,
        # else resp_ + the caller's or a random id
        rid = claimed[0] if claimed else call.req.request_id or responses_output.response_id(summary.request_id)
        call.used = {"temperature": submitted.params.temperature, "top_p": submitted.params.top_p,
                     "max_output_tokens": submitted.max_tokens[0]}  # fmt: skip
        summary.header_id = rid if summary.header_id == summary.request_id else summary.header_id
        summary.request_id = rid
        if call.req.background:
            def ended(status: int, note: str, s: Submitted | None) -> None:
                _log(request, status, note, start, s)

            try:
                queued = stored.start_background(call, rid, submitted, ended)
            except ApiError as exc:
                stored.release(claimed)
                error = responses_api.renamed(exc, call)
                _log(request, error.status, error.message, start)
                raise error from None
            if submitted.req.stream:  # its events as they come; the response runs on if the client leaves
                return StreamingResponse(stored.follow(rid, 0), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Request-Id": summary.header_id})
            return Response(json.dumps(queued), media_type="application/json",
                            headers={"X-Request-Id": summary.header_id})
        try:
            return await answer(request, submitted, start, call, claimed)
        finally:
            if not submitted.req.stream:  # a stream's claim ends with the stream
                stored.release(claimed)

    async def fitted(call: responses_api.ResponsesCall, header_id: str | None) -> dict[str, Any]:
        """The chat body of a Responses request with `truncation: "auto"`: its conversation as it is if it fits the
        model's context beside its output, else with the fewest of its oldest items dropped that make it fit
        (dry runs of the request, a binary search over where it may be cut); the refusal of the whole conversation
        when no cut fits."""
        try:
            await service.submit(call.chat_body, True, header_id, dry_run=True)
            return call.chat_body
        except ApiError as exc:
            if exc.code != CONTEXT_LENGTH_EXCEEDED:
                raise
            refusal = exc
        cuts, fits = responses_api.cut_points(call), None
        lo, hi = 0, len(cuts)
        while lo < hi:  # the fewest items dropped: the first cut that fits (a later one fits too)
            mid = (lo + hi) // 2
            body = responses_api.without_oldest(call, cuts[mid])
            try:
                await service.submit(body, True, header_id, dry_run=True)
            except ApiError as exc:
                if exc.code != CONTEXT_LENGTH_EXCEEDED:
                    raise
                lo = mid + 1
                continue
            fits, hi = body, mid
        if fits is None:
            raise refusal
        return fits

    async def answer(request: Request, submitted: Submitted, start: float,
                     call: responses_api.ResponsesCall | None = None, claimed: Claim | None = None) -> Response:
        """The answer to a queued request: its stream, or its whole body once it finished; `claimed`: the id a
        stored Response has (given up when its stream ends)."""
        summary = submitted.summary
        headers = {"X-Request-Id": summary.header_id}
        if submitted.req.stream:
            events = _logged_stream(request, submitted, start)
            if call is not None:
                events = stored.released(claimed, responses_output.stream(
                    call, summary.request_id, events, summary, cache_block_size, stored.keep(call, summary.request_id)))
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                                      **headers})  # fmt: skip
        answer = await finished(request, submitted, start, lambda e: responses_api.renamed(e, call) if call else e)
        if isinstance(answer, Response):
            return answer
        if call is not None:
            usage = responses_output.usage_of(summary.prompt_tokens, summary.completion_tokens,
                                              summary.cached_tokens, cache_block_size,
                                              summary.reasoning_tokens)  # fmt: skip
            build = lambda: responses_output.response_body(call, summary.request_id, answer, usage,  # noqa: E731
                                                           summary.reasoning_span)  # fmt: skip
            body = await off_loop_if(submitted.large, build)
            keep = stored.keep(call, summary.request_id)
            if keep is not None:  # on the loop: the store is the loop's
                body["store"] = keep(body)
            # ASCII JSON: a lone surrogate the client sent, echoed in the Response, is escaped (a UTF-8 write failed)
            text = await off_loop_if(submitted.large, json.dumps, body)
            return Response(text, media_type="application/json", headers=headers)
        if submitted.large:  # built and written off the loop, which serves the other clients meanwhile
            return Response(await asyncio.to_thread(render_json, answer), media_type="application/json",
                            headers=headers)  # fmt: skip
        return JSONResponse(dump(answer), headers=headers)

    async def finished(request: Request, submitted: Submitted, start: float, renamed: Callable[[ApiError], ApiError],
                       anthropic: bool = False) -> Any:  # fmt: skip
        """A queued request's whole answer (logged), or the Response that ends it instead: 499 when the client left,
        the error body (its fields `renamed` to the client's API) when the engine could not finish it."""
        try:
            answer = await service.respond(submitted, request.is_disconnected)
        except ClientGone:
            _log(request, 499, "client disconnected; request aborted", start)
            return Response(status_code=499)
        except (EngineFailure, ShuttingDown, RequestTimeout) as exc:
            error = renamed(runtime_failure(exc))
            _log(request, error.status_on(anthropic), error.message, start)
            return error_response(error, anthropic)
        _log(request, 200, "", start, submitted)
        return answer

    async def answer_message(request: Request, submitted: Submitted, start: float,
                             call: messages_api.MessagesCall) -> Response:  # fmt: skip
        """The answer to a queued /v1/messages request: its Anthropic stream, or its Message once it finished."""
        summary = submitted.summary
        mid = "msg_" + summary.request_id.removeprefix("chatcmpl-")
        headers = {"X-Request-Id": summary.header_id, "request-id": mid}
        if submitted.req.stream:
            events = messages_output.stream(call, mid, _logged_stream(request, submitted, start), summary,
                                            len(submitted.prompts[0]), cache_block_size)  # fmt: skip
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                                      **headers})  # fmt: skip
        answer = await finished(request, submitted, start, messages_api.renamed, anthropic=True)
        if isinstance(answer, Response):
            return answer
        usage = messages_output.usage_of(summary.prompt_tokens, summary.completion_tokens, summary.cached_tokens,
                                         cache_block_size)  # fmt: skip
        return JSONResponse(messages_output.message_body(call, mid, answer, usage), headers=headers)

    async def _logged_stream(request: Request, s: Submitted, start: float) -> AsyncIterator[bytes]:
        status, note = 499, "client disconnected; request aborted"
        try:
            async for event in service.stream(s):
                yield event
            status, note = 200, ""
        finally:
            _log(request, status, note, start, s)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.post("/v1/responses", dependencies=[Depends(authorize)])
    async def create_response(request: Request) -> Response:
        return await generate(request, chat=True, responses=True)

    @app.post("/v1/messages", dependencies=[Depends(authorize)])
    async def create_message(request: Request) -> Response:
        """Anthropic's Messages API (vLLM's route), served as the chat request it translates to."""
        return await generate(request, chat=True, messages=True)

    @app.post("/invocations", dependencies=[Depends(authorize)])
    async def invocations(request: Request) -> Response:
        """SageMaker's route, as vLLM serves it: a chat body (messages) or a completions body (prompt)."""
        try:
            body, large = await read_json(request)
        except ClientGone:
            return Response(status_code=499)
        chat, body = chat_form(body, "/invocations")
        return await generate(request, chat=chat, given=(body, large))

    stored.add_routes(app, authorize)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> JSONResponse:
        return JSONResponse(dump(ModelList(data=cards)))

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def model(model_id: str) -> JSONResponse:
        check_model(model_id, [c.id for c in cards])
        return JSONResponse(dump(next(c for c in cards if c.id == model_id)))

    tokenization = Tokenization(service.llm, service.tokens, service.model_names, service.template_defaults,
                                service.trust_request_template)  # fmt: skip

    async def tokenizer_call(request: Request, handler: Callable[[Any, bool], Awaitable[Any]],
                             anthropic: bool = False) -> Response:  # fmt: skip
        """`handler(body, large)`'s answer to the request's JSON body (large: past LARGE_BODY_BYTES)."""
        try:
            body, large = await read_json(request)
            answer = await unless_disconnected(request, handler(body, large))  # a model, or its JSON body made
        except ClientGone:
            return Response(status_code=499)
        except (Overloaded, ShuttingDown) as exc:  # the tokenizer's queue is full, or the server stops
            metrics.observe_rejected("overloaded")
            return error_response(overloaded(str(exc), options.retry_after_s, busy=isinstance(exc, Overloaded)),
                                  anthropic)  # fmt: skip
        if isinstance(answer, bytes):
            return Response(answer, media_type="application/json")
        return JSONResponse(answer if isinstance(answer, dict) else dump(answer))

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(request: Request) -> Response:
        return await tokenizer_call(request, lambda body, _: tokenization.tokenize(body))

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(request: Request) -> Response:
        return await tokenizer_call(request, lambda body, _: tokenization.detokenize(body))

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(authorize)])
    async def count_message_tokens(request: Request) -> Response:
        """Anthropic's count: the tokens of the prompt /v1/messages would render for the same body."""
        async def count(body: Any, large: bool) -> dict[str, int]:
            call = await off_loop_if(large, functools.partial(messages_api.translate, count_only=True), body,
                                     service.model_names, service.reasoning is not None)  # fmt: skip
            try:
                await service.check(call.chat_body, True, large)  # what /v1/messages refuses of this body
                counted = await tokenization.chat_prompt_tokens(call.chat_body)
            except ApiError as exc:
                raise messages_api.renamed(exc, call) from None
            return {"input_tokens": counted}

        return await tokenizer_call(request, count, anthropic=True)

    @app.post("/v1/responses/input_tokens", dependencies=[Depends(authorize)])
    async def count_response_tokens(request: Request) -> Response:
        """OpenAI's count: the input tokens /v1/responses would render for the same body (before any truncation)."""
        async def count(body: Any, large: bool) -> dict[str, Any]:
            # translated here, beside the stored responses it may read (as /v1/responses does)
            call = responses_api.translate(responses_api.count_request(body), service.model_names, stored.store,
                                           service.max_logprobs, service.vocab_size)  # fmt: skip
            try:
                await service.check(call.chat_body, True, large)  # what /v1/responses refuses of this body
                counted = await tokenization.chat_prompt_tokens(call.chat_body)
            except ApiError as exc:
                raise responses_api.renamed(exc, call) from None
            return {"object": "response.input_tokens", "input_tokens": counted}

        return await tokenizer_call(request, count)

    runner_failure = service.llm.engine.runner.failure

    @app.get("/health")
    @app.get("/ping")  # SageMaker's health route, as vLLM serves it (GET and POST)
    @app.post("/ping")
    async def health() -> JSONResponse:
        failed = runner_failure() if loop.alive and not draining else None
        if not loop.alive or draining or failed:
            state = ("shutting down" if draining else "engine loop stopped" if not loop.alive
                     else f"engine failed: {failed}")  # fmt: skip
            return JSONResponse({"status": state}, 503, headers={"Retry-After": str(options.retry_after_s)})
        return JSONResponse({"status": "ok"})

    engine_stats = EngineStats(loop)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        stats = await engine_stats.latest() if loop.alive else {}
        return Response(metrics.render(stats), media_type=METRICS_CONTENT_TYPE)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    return StatusCounter(RequestIdHeaders(app, _anthropic_scope), metrics, options.root_path)


def _log(request: Request, status: int, note: str, start: float, s: Submitted | None = None) -> None:
    seconds = time.monotonic() - start
    path = request.url.path
    if status == 200 and s is not None:
        reasons = ",".join(sorted(set(s.summary.finish_reasons))) or "-"
        log.info("POST %s 200 %s prompt=%d completion=%d finish=%s %.2fs", path, s.summary.request_id,
                 s.summary.prompt_tokens, s.summary.completion_tokens, reasons, seconds)  # fmt: skip
    else:
        log.info("POST %s %d %s %.2fs", path, status, note, seconds)
