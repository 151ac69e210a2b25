"""The server's side of stored Responses (`serve --responses-store-size`): ids claimed before a request is queued,
finished Responses kept, background requests run and cancelled, and the routes that read them:
GET /v1/responses/{id}, DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel (OpenAI's and vLLM's) and
GET /v1/responses/{id}/input_items (OpenAI's)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from trtpaged.server import responses_api, responses_output
from trtpaged.server.engine_loop import ClientGone, EngineFailure, RequestTimeout, ShuttingDown
from trtpaged.server.errors import ApiError, overloaded
from trtpaged.server.event_logs import EventLogs
from trtpaged.server.generation import GenerationService, Submitted, runtime_failure
from trtpaged.server.large_answers import off_loop_if
from trtpaged.server.responses_api import ResponsesCall
from trtpaged.server.responses_output import Keep
from trtpaged.server.responses_store import ResponsesStore, not_found

log = logging.getLogger("trtpaged.server")
CANCEL_WAIT_S = 30.0  # how long a cancel waits for its request to end (an abort takes a step or a poll, 0.25 s)
Ended = Callable[[int, str, Optional[Submitted]], None]  # logs a background request's end: status, note
Claim = tuple[str, int]  # a claimed Response id and the claim's token
_ITEMS_SUFFIX = "/input_items"  # of GET /v1/responses/{id}/input_items; an id may hold '/' (the routes read paths)


class StoredResponses:
    """Stored Responses and the background requests that make them; `store` None: the server keeps none (a client
    asking for one gets a 404 saying so, as vLLM's without its store)."""

    def __init__(self, store: Optional[ResponsesStore], service: GenerationService, block_size: int) -> None:
        self.store = store
        self.service = service
        self.block_size = block_size  # the prefix cache's (0: off), for usage's cache_write_tokens
        self.running: dict[str, tuple[asyncio.Task, asyncio.Event]] = {}  # background id -> its task, its cancel
        # the events of background streams (stream: true), read again with GET ?stream=true
        self.logs = EventLogs(store.max_bytes if store is not None else 0)

    def claim(self, call: ResponsesCall, header_id: Optional[str]) -> Optional[Claim]:
        """Claims the id a stored Response will have: the body's request_id (a 400 when a stored or running response
        has it), else resp_ + X-Request-Id (a random id when that one is taken: a proxy's repeated trace id is no
        fault of the request), else a random one. None: the Response is not stored (its id is made as ever)."""
        store = self.store
        if not call.stored or store is None:
            return None
        rid = call.req.request_id
        if rid is not None:
            if _unreadable(rid):
                raise ApiError(f"request_id: '.', '..' and ids ending in {_ITEMS_SUFFIX!r} cannot name a stored "
                               "response (no URL reads them back)", "request_id")  # fmt: skip
            claim = rid, store.claim(rid, "request_id")
        elif header_id is not None and not _unreadable(rid := responses_output.response_id(f"chatcmpl-{header_id}")) \
                and not store.taken(rid):
            claim = rid, store.claim(rid, "X-Request-Id")
        else:
            rid = f"resp_{uuid.uuid4().hex}"
            claim = rid, store.claim(rid, "request_id")
        # the id names a new response now: the events of an earlier one of that id (evicted, its log kept) go
        self.logs.drop(rid)
        return claim

    def release(self, claim: Optional[Claim]) -> None:
        if claim is not None and self.store is not None:
            self.store.release(*claim)

    def released(self, claim: Optional[Claim], events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`events`, the stream of a Response; its claimed id is given up when the stream ends (its Response stored
        by then, or not at all when the client left), or when the stream is dropped without having started."""
        return _Releasing(events, lambda: self.release(claim))

    def keep(self, call: ResponsesCall, rid: str) -> Optional[Keep]:
        """What stores the finished Response `rid` of `call` (None: it is not stored)."""
        store = self.store
        if not call.stored or store is None:
            return None
        return lambda body: store.put(rid, body, responses_api.turn(call, body["output"]), call.link,
                                      inputs=len(call.items))

    def start_background(self, call: ResponsesCall, rid: str, s: Submitted, ended: Ended) -> dict[str, Any]:
        """Runs the queued request `s` in a task that stores its Response when it ends; returns the queued
        Response, what the client gets now (a stream's client reads `follow(rid, 0)` instead). `ended` logs the
        end."""
        assert self.store is not None
        queued = responses_output.envelope(call, rid, "queued", [])
        if not self.store.room_for_background() or self.logs.open_size() >= self.store.max_bytes:
            self.service.loop.abort(sorted(s.index))
            raise overloaded(f"background: the Responses store's bound ({self.store.max_bytes} bytes) is held by "
                             "background responses running or not read yet; read them, or retry later", busy=True)
        inputs = responses_api.turn(call, [])  # read from the start (input_items)
        if not self.store.put(rid, queued, inputs, call.link, running=True, inputs=len(inputs)):
            self.service.loop.abort(sorted(s.index))
            raise ApiError(f"background: the Response is larger than the Responses store's bound "
                           f"({self.store.max_bytes} bytes)", "background")  # fmt: skip
        if call.req.stream:  # open before the task runs: the client's stream reads it from now on
            self.logs.open(rid)
        cancel = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self._run(call, rid, s, inputs, cancel, ended))
        self.running[rid] = (task, cancel)
        return queued

    async def _run(self, call: ResponsesCall, rid: str, s: Submitted, inputs: list[dict[str, Any]],
                   cancel: asyncio.Event, ended: Ended) -> None:  # fmt: skip
        """The background request `s` to its end, stored under `rid` with its `inputs` (its turn's input items)."""
        store = self.store
        assert store is not None

        def started() -> None:  # queued until it runs (OpenAI's states): admitted, and a step computed it
            store.put(rid, responses_output.envelope(call, rid, "in_progress", []), inputs, call.link, running=True,
                      inputs=len(inputs))

        async def cancelled() -> bool:
            return cancel.is_set()

        status, note = 200, ""
        try:
            if call.req.stream:
                body = await self._streamed(call, rid, s, started)
                if body.get("status") == "failed":  # its stream's response.failed (the engine failed, or a timeout)
                    status, note = 500, str((body.get("error") or {}).get("message", "failed"))
                elif body.get("status") == "cancelled":
                    status, note = 499, "cancelled"
            else:
                # cancelled, it answers with its output so far (as a cancelled stream ends)
                answer = await self.service.respond(s, cancelled, started, keep_cut=True)
                usage = self._usage(s)
                build = lambda: responses_output.response_body(call, rid, answer, usage,  # noqa: E731
                                                               s.summary.reasoning_span)  # fmt: skip
                body = await off_loop_if(s.large, build)
                if body["status"] == "cancelled":
                    status, note = 499, "cancelled"
        except (ClientGone, asyncio.CancelledError):  # cancelled: the request was aborted
            status, note = 499, "cancelled"
            body = responses_output.envelope(call, rid, "cancelled", [], self._usage(s))
        except Exception as exc:  # noqa: BLE001 - any failure ends this response as failed, never the server
            if not isinstance(exc, (EngineFailure, ShuttingDown, RequestTimeout)):
                log.exception("background response %s failed", rid)
            error = runtime_failure(exc)
            status, note = error.status, error.message
            body = responses_output.envelope(call, rid, "failed", [], self._usage(s),
                                             error={"code": "server_error", "message": error.message})  # fmt: skip
        finally:
            self.running.pop(rid, None)
            self.logs.close(rid)
        # held until read: a poll finds the end, not a 404
        if not self.store.put(rid, body, responses_api.turn(call, body["output"]), call.link, unread=True,
                              inputs=len(call.items)):
            # too large to keep: what it ended as is kept instead
            message = f"the response is larger than the Responses store's bound ({self.store.max_bytes} bytes)"
            body = responses_output.envelope(call, rid, "failed", [], self._usage(s),
                                             error={"code": "server_error", "message": message})  # fmt: skip
            self.store.put(rid, body, [], call.link, unread=True)
            status, note = 500, message
        ended(status, note, s if status == 200 else None)

    async def _streamed(self, call: ResponsesCall, rid: str, s: Submitted,
                        started: Callable[[], None]) -> dict[str, Any]:  # fmt: skip
        """Runs a background stream: its events go to its log (what its readers read) and the last one holds the
        Response it ended as. Cancelling the task aborts the request (its chat stream is closed) and ends the stream
        with the output so far, cancelled (EventStream.cancelled)."""
        log = self.logs.get(rid)
        assert log is not None
        last = b""
        state = responses_output.EventStream(call, rid)
        events = responses_output.stream(call, rid, self.service.stream(s), s.summary, self.block_size, events=state)
        try:
            async with aclosing(events):
                async for event in events:
                    log.append(event)
                    last = event
                    if event.startswith(b"event: response.in_progress\n"):  # a step computed it
                        started()
        except asyncio.CancelledError:  # a cancel: its readers get a last event, as the Response GET returns
            for event in state.cancelled(self._usage(s)):
                log.append(event)
                last = event
        return json.loads(last.split(b"\ndata: ", 1)[1])["response"]

    async def follow(self, rid: str, start: int) -> AsyncIterator[bytes]:
        """The events of background stream `rid` from number `start` on, as they come, until it ends. A reader that
        leaves ends nothing: the response runs on."""
        log = self.logs.get(rid)
        if log is None:
            return
        async for event in log.read(start):
            yield event
        # this reader has the last event, the Response it ended as: it is read, no longer held (a client that reads
        # its whole stream never polls; held unread, such responses filled the store's bound, every new background
        # request a 503 for good)
        if self.store is not None:
            self.store.touch(rid)

    def stream_log(self, rid: str) -> None:
        """Checks that `rid`'s events can be read again (a 400 naming `stream` otherwise)."""
        if self.store is None or not self.store.touch(rid):
            raise self._missing(rid)
        if self.logs.get(rid) is None:
            raise ApiError(f"stream: the events of response {rid[:80]!r} are not kept (only those of a background "
                           "response created with stream: true, while it runs and for a while after)", "stream")

    def _usage(self, s: Submitted) -> dict[str, Any]:
        m = s.summary
        return responses_output.usage_of(m.prompt_tokens, m.completion_tokens, m.cached_tokens, self.block_size,
                                         m.reasoning_tokens)  # fmt: skip

    # ---- routes -------------------------------------------------------------------------------
    def stored(self, rid: str) -> dict[str, Any]:
        body = self.store.get(rid) if self.store is not None else None
        if body is None:
            raise self._missing(rid)
        return body

    def _missing(self, rid: str) -> ApiError:
        """The 404 for a response that is not stored."""
        return not_found(rid, stores=self.store is not None)

    async def cancel(self, rid: str) -> dict[str, Any]:
        """Cancels background response `rid` while it runs (a cancelled one is answered as it is)."""
        body = self.stored(rid)
        running = self.running.get(rid)
        if running is None:
            if body["status"] == "cancelled":
                return body
            why = "it did not run in the background" if not body.get("background") else f"it is {body['status']}"
            raise ApiError(f"response_id: only a background response still running can be cancelled; {why}",
                           "response_id")  # fmt: skip
        task, cancel = running
        cancel.set()
        if self.logs.get(rid) is not None:  # a stream has no poll for the flag: its task is cancelled
            # once it has started: a task cancelled before its first step never runs _run's cleanup (its store
            # entry, log and id held for good); that first step is queued already, so one pass of the loop runs it
            await asyncio.sleep(0)
            task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_WAIT_S)  # not the task cancelled if this request is
        return self.stored(rid)

    def delete(self, rid: str) -> dict[str, Any]:
        self.stored(rid)
        if rid in self.running:
            raise ApiError("response_id: a background response still running cannot be deleted; cancel it first",
                           "response_id")  # fmt: skip
        assert self.store is not None
        self.store.delete(rid)
        self.logs.drop(rid)
        return {"id": rid, "object": "response", "deleted": True}

    def input_items(self, rid: str, limit: int, order: str, after: Optional[str]) -> dict[str, Any]:
        """OpenAI's list of a stored response's input items (`client.responses.input_items.list`): `order` "desc"
        (newest first, OpenAI's default) or "asc", at most `limit` after the item `after`; ids made from the
        response's id and serial and the item's place, the same at every read."""
        if not 1 <= limit <= 100:
            raise ApiError(f"limit: must be in [1, 100], got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise ApiError(f"order: must be 'asc' or 'desc', got {order[:20]!r}", "order")
        found = self.store.input_items(rid) if self.store is not None else None
        if found is None:
            raise self._missing(rid)
        items, serial = found
        listed = [responses_output.input_item(item, f"{rid}/{serial}/{i}") for i, item in enumerate(items)]
        if order == "desc":
            listed.reverse()
        if after is not None:
            at = next((i for i, item in enumerate(listed) if item["id"] == after), None)
            if at is None:
                raise ApiError(f"after: no input item {after[:80]!r} in response {rid[:80]!r}", "after", 404,
                               "not_found_error")  # fmt: skip
            listed = listed[at + 1 :]
        page = listed[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(listed) > limit}  # fmt: skip

    def add_routes(self, app: FastAPI, authorize: Callable[[Request], Awaitable[None]]) -> None:
        @app.get("/v1/responses/{response_id:path}" + _ITEMS_SUFFIX, dependencies=[Depends(authorize)])
        async def list_input_items(response_id: str, limit: str = "20", order: str = "desc",
                                   after: Optional[str] = None) -> Response:  # fmt: skip
            if re.fullmatch(r"[0-9]{1,4}", limit) is None:  # a 400 in OpenAI's form, not FastAPI's 422
                raise ApiError(f"limit: must be an integer in [1, 100], got {limit[:20]!r}", "limit")
            return _json(self.input_items(response_id, int(limit), order, after))

        @app.get("/v1/responses/{response_id:path}", dependencies=[Depends(authorize)])
        async def get_response(response_id: str, request: Request) -> Response:
            if request.query_params.get("stream", "false").lower() in ("false", "0", "no", "off", ""):
                return _json(self.stored(response_id))
            after = request.query_params.get("starting_after", "-1")
            # ASCII digits only: str.isdigit also takes '²' and '--5' passed a strip of '-', int() then failed (a 500)
            if re.fullmatch(r"-1|[0-9]{1,18}", after) is None:
                raise ApiError(f"starting_after: must be an event's sequence number (>= 0), got {after[:20]!r}",
                               "starting_after")  # fmt: skip
            self.stream_log(response_id)
            return StreamingResponse(self.follow(response_id, int(after) + 1), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip

        @app.delete("/v1/responses/{response_id:path}", dependencies=[Depends(authorize)])
        async def delete_response(response_id: str) -> Response:
            return _json(self.delete(response_id))

        @app.post("/v1/responses/{response_id:path}/cancel", dependencies=[Depends(authorize)])
        async def cancel_response(response_id: str) -> Response:
            return _json(await self.cancel(response_id))


def _unreadable(rid: str) -> bool:
    """Whether no URL reads a response of id `rid` back: '.' and '..' (path segments a client resolves away), and
    an id ending in /input_items (GET reads it as the input items of the id before)."""
    return rid in (".", "..") or rid.endswith(_ITEMS_SUFFIX)


def _json(body: dict[str, Any]) -> Response:
    # ASCII JSON, as the Response was first answered: a lone surrogate a client sent is escaped, not a failed write
    return Response(json.dumps(body), media_type="application/json")


class _Releasing:
    """An event stream that calls `release` once: when it ends or is closed, or when it is dropped unstarted (a
    client gone before the first event: a generator that never ran has no `finally` to run)."""

    def __init__(self, events: AsyncIterator[bytes], release: Callable[[], None]) -> None:
        self.events, self._release = events, release
        self._released = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._run()

    async def _run(self) -> AsyncIterator[bytes]:
        try:
            async with aclosing(self.events):
                async for event in self.events:
                    yield event
        finally:
            self.release()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()

    def __del__(self) -> None:
        self.release()
