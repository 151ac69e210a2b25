"""Stored Responses (`serve --responses-store-size`) with the official `openai` client: a stored Response reads back
as it was answered; `previous_response_id` answers as the same conversation sent whole in one request (OpenAI's
definition: the earlier input and output, then the new input; the earlier instructions are not carried); a
background request is polled to the answer the same request gets at once, and a cancel ends it with its blocks
freed; the store's byte bound evicts the least recently used; ids are unique; refusals name the field."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from tests.runtime_helpers import openai_client, slowed_steps
from tests.test_server import request, wait_idle
from trtpaged.server import ServerOptions, start_server
from trtpaged.server.responses_store import ResponsesStore

openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install openai)")
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_engine_dir):
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(responses_store_size=1 << 20))  # fmt: skip
    yield handle
    handle.shutdown(timeout=0)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def _create(client, **kw):
    return client.responses.create(model=MODEL, temperature=0, **kw)


def _turn(r) -> list[dict]:
    """A Response's output as input items a client would send back."""
    return [o.model_dump(exclude_none=True) for o in r.output]


def test_a_stored_response_reads_back_as_answered(client, server):
    r = _create(client, input="hello there", max_output_tokens=6)
    assert r.store is True
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    events = list(_create(client, input="stream me", max_output_tokens=6, stream=True))
    last = events[-1].response
    assert last.store is True and client.responses.retrieve(last.id).model_dump() == last.model_dump()
    unstored = _create(client, input="not kept", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(unstored.id)
    assert err.value.body["param"] == "response_id"
    wait_idle(server)


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_answers_as_the_whole_conversation_sent_at_once(client, server, stream):
    first = _create(client, instructions="Be terse.", input="hello there", max_output_tokens=5)
    second = _create(client, input=[{"role": "user", "content": "and then?"}], max_output_tokens=7,
                     previous_response_id=first.id, instructions="Be kind.")  # fmt: skip
    whole = [{"role": "user", "content": "hello there"}, *_turn(first), {"role": "user", "content": "and then?"}]
    truth = _create(client, input=whole, max_output_tokens=7, instructions="Be kind.", store=False)
    assert second.previous_response_id == first.id
    assert second.output_text == truth.output_text
    assert second.usage.input_tokens == truth.usage.input_tokens
    # a third turn walks the chain of two; a stream continues it the same way
    kw = dict(input="more", max_output_tokens=6, previous_response_id=second.id)
    third = _create(client, stream=True, **kw)
    third = [e for e in third][-1].response if stream else _create(client, **kw)
    whole += [*_turn(second), {"role": "user", "content": "more"}]
    truth = _create(client, input=whole, max_output_tokens=6, store=False)
    assert (third.output_text, third.usage.input_tokens) == (truth.output_text, truth.usage.input_tokens)
    wait_idle(server)


def test_a_cut_response_is_continued_by_an_empty_turn(client, server):
    """A Response cut by max_output_tokens ends with an incomplete message: continuing it with no new input
    continues that message (vLLM's rule for an unfinished assistant turn), as the same items sent whole do."""
    cut = _create(client, input="write on", max_output_tokens=3)
    assert cut.status == "incomplete"
    went_on = _create(client, input=[], max_output_tokens=4, previous_response_id=cut.id)
    truth = _create(client, input=[{"role": "user", "content": "write on"}, *_turn(cut)], max_output_tokens=4,
                    store=False)  # fmt: skip
    assert went_on.output_text == truth.output_text
    wait_idle(server)


def test_a_background_response_is_polled_to_the_answer(client, server):
    # a 2h completion window (OpenAI's discounted background mode) is met by running it at once
    queued = _create(client, input="in the background", max_output_tokens=12, background=True,
                     background_options={"completion_window": "2h", "continuation_id": "batch-1"})  # fmt: skip
    assert queued.status == "queued" and queued.background is True and queued.output == []
    deadline = time.monotonic() + 60
    while (r := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    at_once = _create(client, input="in the background", max_output_tokens=12, store=False)
    assert (r.status, r.output_text, r.usage.output_tokens) == (at_once.status, at_once.output_text,
                                                                at_once.usage.output_tokens)  # fmt: skip
    assert r.background is True
    wait_idle(server)


def test_a_cancelled_background_response_frees_its_blocks(client, server):
    """Cancelled while the engine thread is held (so that it cannot finish first): it ends cancelled, short of
    its length, and once the engine runs again no block is left in use."""
    queued = _create(client, input="a long one", max_output_tokens=450, background=True)
    release = threading.Event()
    held = threading.Thread(target=lambda: server.loop.call(lambda e: release.wait(30)))
    try:
        held.start()
        deadline = time.monotonic() + 20
        while (server.loop._commands.qsize() or not held.is_alive()) and time.monotonic() < deadline:
            time.sleep(0.01)  # until the engine thread has taken the holding call off its queue
        assert client.responses.retrieve(queued.id).status == "in_progress"
        with pytest.raises(openai.BadRequestError) as err:  # a running response is cancelled, not deleted
            client.responses.delete(queued.id)
        assert err.value.body["param"] == "response_id"
        cancelled = client.responses.cancel(queued.id)
    finally:
        release.set()
        held.join(30)
    # its usage counts what it generated before (in_progress: a step ran), short of its length
    assert cancelled.status == "cancelled" and 1 <= cancelled.usage.output_tokens < 450
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert client.responses.cancel(queued.id).status == "cancelled"  # again: answered as it is
    wait_idle(server)
    done = _create(client, input="done", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(done.id)
    assert "background" in err.value.body["message"]
    client.responses.delete(queued.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(queued.id)


def _shape(r) -> tuple:
    """A Response as its kind of end shows it: its fields but the ones every response has its own of, and each
    output item's type, status and fields."""
    body = r.model_dump()
    for own in ("id", "created_at", "output", "usage"):
        body.pop(own)
    return body, [(o.type, o.status, sorted(o.model_dump())) for o in r.output]


def test_a_cancelled_background_response_keeps_its_output_so_far(client, server):
    """Not streamed, a background response cancelled while it runs is cancelled with the text it wrote so far (it
    had no output while its usage counted tokens), its message incomplete: the Response GET returns, in the shape a
    cancelled background stream ends with."""
    letters = {"structured_outputs": {"regex": "[a-z]{470}"}}  # no end before the cancel; a token a character
    queued = _create(client, input="go on", max_output_tokens=480, background=True, extra_body=letters)
    deadline = time.monotonic() + 20
    while client.responses.retrieve(queued.id).status == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    release = threading.Event()
    held = threading.Thread(target=lambda: server.loop.call(lambda e: release.wait(30)))
    try:  # the engine thread held: the cancel ends it short of its length
        held.start()
        while (server.loop._commands.qsize() or not held.is_alive()) and time.monotonic() < deadline:
            time.sleep(0.01)
        cancelled = client.responses.cancel(queued.id)
    finally:
        release.set()
        held.join(30)
    assert cancelled.status == "cancelled" and [o.status for o in cancelled.output] == ["incomplete"]
    assert 1 <= cancelled.usage.output_tokens == len(cancelled.output_text) < 470
    assert client.responses.retrieve(queued.id).model_dump() == cancelled.model_dump()
    events = []
    restore = slowed_steps(server, 0.005)  # 2.4 s for its 470 tokens: the cancel lands before its end, however busy
    try:
        for event in _create(client, input="go on", max_output_tokens=480, background=True, stream=True,
                             extra_body=letters):  # fmt: skip
            events.append(event)
            if len(events) == 6:
                client.responses.cancel(events[0].response.id)
    finally:
        restore()
    assert _shape(events[-1].response) == _shape(cancelled)
    wait_idle(server)


def test_deleting_a_response_breaks_the_chains_through_it(client, server):
    first = _create(client, input="one", max_output_tokens=2)
    second = _create(client, input="two", max_output_tokens=2, previous_response_id=first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.delete(first.id)
    for rid in (first.id, second.id):
        with pytest.raises(openai.NotFoundError) as err:
            _create(client, input="three", max_output_tokens=2, previous_response_id=rid)
        assert err.value.body["param"] == "previous_response_id" and first.id in err.value.body["message"]
    assert client.responses.retrieve(second.id).id == second.id  # itself still stored
    wait_idle(server)


def test_ids_name_one_stored_response(client, server):
    """A body's request_id names the Response as given and must be free; an X-Request-Id (a proxy's trace id,
    perhaps repeated) names it only while free, else the Response gets a random id."""
    kept = _create(client, input="x", max_output_tokens=2, extra_body={"request_id": "resp_mine"})
    assert kept.id == "resp_mine"
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, input="y", max_output_tokens=2, extra_body={"request_id": "resp_mine"})
    assert err.value.body["param"] == "request_id" and "resp_mine" in err.value.body["message"]
    first = _create(client, input="y", max_output_tokens=2, extra_headers={"X-Request-Id": "trace"})
    again = _create(client, input="y", max_output_tokens=2, extra_headers={"X-Request-Id": "trace"})
    assert first.id == "resp_trace" and again.id.startswith("resp_") and again.id != first.id
    assert client.responses.retrieve("resp_mine").output_text == kept.output_text  # not replaced
    for unreadable in (".", "..", "resp_a/input_items"):  # no URL could read them back
        with pytest.raises(openai.BadRequestError) as err:
            _create(client, input="y", max_output_tokens=2, extra_body={"request_id": unreadable})
        assert err.value.body["param"] == "request_id"
    from_header = _create(client, input="y", max_output_tokens=2, extra_headers={"X-Request-Id": "t/input_items"})
    assert not from_header.id.endswith("/input_items")  # a random id instead
    slashed = _create(client, input="with a slash", max_output_tokens=2, extra_body={"request_id": "resp_a/b"})
    assert client.responses.retrieve("resp_a/b").id == slashed.id == "resp_a/b"  # read by every route
    assert [i.content[0].text for i in client.responses.input_items.list("resp_a/b").data] == ["with a slash"]
    client.responses.delete("resp_a/b")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_a/b")
    wait_idle(server)


def test_a_chain_through_a_deleted_id_stays_broken_when_the_id_is_reused(client, server):
    """previous_response_id means that response's own items: once it is deleted, a new response under its id
    is not spliced into the chains that went through the old one."""
    old = _create(client, input="the old one", max_output_tokens=3, extra_body={"request_id": "resp_reused"})
    after = _create(client, input="next", max_output_tokens=3, previous_response_id=old.id)
    client.responses.delete(old.id)
    _create(client, input="a new and different one", max_output_tokens=3, extra_body={"request_id": "resp_reused"})
    with pytest.raises(openai.NotFoundError) as err:
        _create(client, input="more", max_output_tokens=3, previous_response_id=after.id)
    assert "resp_reused" in err.value.body["message"]
    wait_idle(server)


@pytest.mark.parametrize("extra, param", [
    ({"background": True, "store": False}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    # OpenAI's rule for the 2h and 8h windows: background, not streamed, standard processing
    ({"background": True, "stream": True, "background_options": {"completion_window": "8h"}}, "background_options"),
    ({"background": True, "service_tier": "priority", "background_options": {"completion_window": "2h"}},
     "background_options"),
])  # fmt: skip
def test_what_the_store_cannot_serve_is_refused_naming_the_field(client, server, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/responses", body={"model": MODEL, "input": "hi", **extra}, cast_to=object)
    assert err.value.body["param"] == param
    wait_idle(server)


def test_a_server_without_a_store_keeps_nothing(tiny_engine_dir):
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu")
    try:
        client = openai_client(handle.url)
        r = _create(client, input="hi", max_output_tokens=2)
        assert r.store is False
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.retrieve(r.id)
        assert "--responses-store-size" in err.value.body["message"]
        with pytest.raises(openai.NotFoundError) as err:  # vLLM's answer without its store; LangChain's
            _create(client, input="hi", max_output_tokens=2, previous_response_id=r.id)  # use_previous_response_id
        assert err.value.body["param"] == "previous_response_id"
        assert "--responses-store-size" in err.value.body["message"]  # why, not 'deleted or evicted'
        with pytest.raises(openai.BadRequestError) as err:
            _create(client, input="hi", max_output_tokens=2, background=True)
        assert err.value.body["param"] == "background"
    finally:
        handle.shutdown(timeout=0)


def test_the_store_keeps_its_byte_bound_least_recently_used_out():
    """The bound counts each entry's JSON; a read is a use; an entry larger than the bound is not kept; running
    (background) entries are never evicted, and the entry just stored is not either."""
    def body(rid: str, text: str) -> dict:
        return {"id": rid, "output": [{"type": "message", "role": "assistant", "content": text}]}

    def turn(text: str) -> list:
        return [{"type": "message", "role": "user", "content": text}]

    store = ResponsesStore(700)
    for rid in ("a", "b", "c"):
        assert store.put(rid, body(rid, "x" * 100), turn("q" + rid), None)
    assert store.size <= 700 and len(store) == 3
    store.get("a")  # a used: b is now the oldest
    _, link = store.conversation("a")
    assert store.put("d", body("d", "x" * 100), turn("qd"), link)
    assert store.get("b") is None and store.get("a") is not None and store.size <= 700
    items, _ = store.conversation("d")
    assert [i["content"] for i in items] == ["qa", "qd"]
    assert not store.put("huge", body("huge", "x" * 1000), [], None) and store.get("huge") is None
    assert len(store) == 3  # nothing else went for it
    store.put("r", body("r", "y" * 300), [], None, running=True)
    for i in range(10):
        assert store.put(f"n{i}", body(f"n{i}", "z" * 300), [], None)
        assert store.get(f"n{i}") is not None  # the one just stored stays, even past the bound
    assert store.running("r") and store.get("r") is not None
    assert store.size == sum(len(json.dumps(store.get(k), separators=(",", ":"))) for k in ("r", "n9")) + 4
    # the helper's repro: 30 background results finishing while others run: each is held until read
    store = ResponsesStore(8192)
    ids = [f"resp_{i}" for i in range(30)]
    for rid in ids:
        assert store.put(rid, {"id": rid, "x": "y" * 250}, [], None, running=True)
    assert not store.room_for_background()  # running ones hold the bound: a new one waits
    for rid in ids:
        assert store.put(rid, {"id": rid, "x": "y" * 300}, [], None, unread=True)
    assert all(store.get(rid) is not None for rid in ids)  # none lost before its first read
    assert store.put("after", body("after", "z"), [], None) and store.size <= 8192  # read ones go again
    assert store.room_for_background() and store.held_size == 0
    store = ResponsesStore(700)
    store.put("r", body("r", "y" * 300), [], None, running=True)
    with pytest.raises(Exception) as err:
        store.claim("r", "request_id")
    assert "request_id" in str(err.value)
    token = store.claim("fresh", "request_id")
    store.release("fresh", token + 1)  # not this claim's token: kept
    assert store.taken("fresh")
    store.release("fresh", token)
    assert not store.taken("fresh")


def test_truncation_auto_drops_the_oldest_turns_that_do_not_fit(client, server):
    """OpenAI's truncation "auto": a conversation past the model's context (512 tokens here) is answered as the
    same conversation with its oldest items dropped, from a user message on, as few as make it fit beside the
    output, instructions kept; "disabled" (the default) refuses it naming the context; one that fits is whole."""
    turns = []
    for i in range(8):
        turns += [{"role": "user", "content": f"question {i}: " + "tell me more " * 6},
                  {"role": "assistant", "content": f"answer {i}: " + "here is more " * 6}]
    turns.append({"role": "user", "content": "last question"})
    kw = dict(instructions="Be brief.", max_output_tokens=40, store=False)
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, input=turns, **kw)
    assert err.value.body["code"] == "context_length_exceeded"
    got = _create(client, input=turns, truncation="auto", **kw)
    assert got.truncation == "auto"
    fitting = [k for k in range(2, len(turns), 2) if _fits(client, turns[k:], **kw)]
    k = fitting[0]  # the fewest user-led turns dropped
    truth = _create(client, input=turns[k:], **kw)
    assert (got.output_text, got.usage.input_tokens) == (truth.output_text, truth.usage.input_tokens)
    assert not _fits(client, turns[k - 2:], **kw)
    short = _create(client, input=turns[-3:], truncation="auto", **kw)
    assert short.usage.input_tokens == _create(client, input=turns[-3:], **kw).usage.input_tokens
    wait_idle(server)


def _fits(client, items, **kw) -> bool:
    try:
        _create(client, input=items, **kw)
    except openai.BadRequestError as err:
        assert err.body["code"] == "context_length_exceeded"
        return False
    return True


def _running_long_request(handle, client) -> tuple[Any, float]:
    """A background request that runs (its steps slowed: 4.5 s for its 450 tokens, so that a request after it waits
    for admission however busy the machine is), and a deadline 30 s on."""
    slowed_steps(handle, 0.01)
    first = _create(client, input="a long one", max_output_tokens=450, background=True)
    deadline = time.monotonic() + 30
    while client.responses.retrieve(first.id).status == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return first, deadline


def test_a_background_response_is_queued_until_it_runs(tiny_engine_dir):
    """One sequence per step: a second background request waits for admission and says `queued` (OpenAI's state)
    while the first runs, then goes on to its answer once the first is cancelled (or done)."""
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu", max_batch_size=1,
                          options=ServerOptions(responses_store_size=1 << 20))  # fmt: skip
    try:
        client = openai_client(handle.url)
        first, deadline = _running_long_request(handle, client)
        second = _create(client, input="then me", max_output_tokens=5, background=True)
        assert client.responses.retrieve(second.id).status == "queued"
        assert client.responses.retrieve(first.id).status == "in_progress"
        assert client.responses.cancel(first.id).status == "cancelled"
        while (done := client.responses.retrieve(second.id)).status in ("queued", "in_progress"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert done.status in ("completed", "incomplete") and done.usage.output_tokens >= 1
        wait_idle(handle)
    finally:
        handle.shutdown(timeout=0)


def test_a_queued_background_stream_says_queued_until_it_runs(tiny_engine_dir):
    """A background stream that waits for admission opens with response.created and response.queued, both
    `queued` as GET says then (was: .in_progress while GET said queued); response.in_progress follows once it runs,
    when GET says in_progress too. The openai package reads each event as its own type."""
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu", max_batch_size=1,
                          options=ServerOptions(responses_store_size=1 << 20))  # fmt: skip
    try:
        client = openai_client(handle.url)
        first, deadline = _running_long_request(handle, client)
        stream = iter(_create(client, input="then me", max_output_tokens=5, background=True, stream=True))
        opening = [next(stream), next(stream)]
        rid = opening[0].response.id
        assert [(type(e).__name__, e.type, e.response.status) for e in opening] == [
            ("ResponseCreatedEvent", "response.created", "queued"),
            ("ResponseQueuedEvent", "response.queued", "queued")]  # fmt: skip
        assert client.responses.retrieve(rid).status == "queued"
        client.responses.cancel(first.id)
        began = next(stream)
        assert (type(began).__name__, began.type, began.response.status) == ("ResponseInProgressEvent",
                                                                             "response.in_progress", "in_progress")
        assert client.responses.retrieve(rid).status in ("in_progress", "completed", "incomplete")
        rest = list(stream)
        assert "in_progress" not in [e.type for e in rest] and rest[-1].response.status in ("completed", "incomplete")
        assert [e.sequence_number for e in opening + [began] + rest] == list(range(3 + len(rest)))
        wait_idle(handle)
    finally:
        handle.shutdown(timeout=0)


def test_background_results_on_a_small_store_are_held_until_read(tiny_engine_dir):
    """An 8 KiB store and 16 concurrent background requests, each polled until it ends: every one accepted reaches
    a terminal state on GET (running and unread results are held, never evicted: a 404 after in_progress lost
    about half of them), and those refused while held ones fill the bound get a 503 with Retry-After."""
    from concurrent.futures import ThreadPoolExecutor

    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(responses_store_size=8 << 10))  # fmt: skip
    client = openai_client(handle.url)

    def run(i: int) -> str:
        try:
            r = _create(client, input=f"hello number {i}", max_output_tokens=60, background=True)
        except openai.APIStatusError as err:
            assert err.status_code == 503 and err.response.headers.get("retry-after"), err
            return "refused"
        deadline = time.monotonic() + 60
        while (status := client.responses.retrieve(r.id).status) in ("queued", "in_progress"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        return status

    try:
        with ThreadPoolExecutor(16) as pool:
            ends = list(pool.map(run, range(16)))
        assert set(ends) <= {"completed", "incomplete", "refused"} and ends.count("refused") < 16, ends
        wait_idle(handle)
    finally:
        handle.shutdown(timeout=0)


def test_input_items_list_what_the_request_gave_paged_and_in_either_order(client, server):
    """`client.responses.input_items.list`: the response's own input (not the earlier turns a previous_response_id
    brought in), its texts as input_text parts, newest first by default; `after` and `limit` page through it with
    ids that are the same at every read; a background response's input is listed from when it is queued."""
    first = _create(client, input="one", max_output_tokens=2)
    given = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two"},
             {"role": "assistant", "content": "ok"},
             {"role": "user", "content": [{"type": "input_text", "text": "three"}]}]
    r = _create(client, input=given, max_output_tokens=2, previous_response_id=first.id)
    listed = client.responses.input_items.list(r.id, order="asc")
    texts = [(i.role, i.content[0].text, i.content[0].type) for i in listed.data]
    assert texts == [("system", "be brief", "input_text"), ("user", "two", "input_text"),
                     ("assistant", "ok", "output_text"), ("user", "three", "input_text")]  # fmt: skip
    assert [i.id for i in client.responses.input_items.list(r.id).data] == [i.id for i in reversed(listed.data)]
    page = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.id for i in page.data] == [i.id for i in listed.data[:2]] and page.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=page.last_id)
    assert [i.id for i in rest.data] == [i.id for i in listed.data[2:]] and not rest.has_more
    assert [i.content[0].text for i in client.responses.input_items.list(first.id).data] == ["one"]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_missing")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_items.list(r.id, limit=0)
    assert err.value.body["param"] == "limit"
    background = _create(client, input="in the back", max_output_tokens=40, background=True)
    assert [i.content[0].text for i in client.responses.input_items.list(background.id).data] == ["in the back"]
    while client.responses.retrieve(background.id).status in ("queued", "in_progress"):
        time.sleep(0.05)
    wait_idle(server)


def test_listed_input_items_are_the_sdks_item_types(client, server):
    """Each kind of input item, listed, validates as the openai package's type of a listed item (their required
    fields: a call's and a call output's status, a reasoning item's summary; the SDK's own parsing does not check)."""
    from openai.types.responses import (ResponseFunctionToolCallItem, ResponseFunctionToolCallOutputItem,
                                        ResponseInputMessageItem, ResponseOutputMessage, ResponseReasoningItem)

    kinds = {"reasoning": ResponseReasoningItem, "function_call": ResponseFunctionToolCallItem,
             "function_call_output": ResponseFunctionToolCallOutputItem}  # fmt: skip
    given = [{"role": "user", "content": "q"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "out"},
             {"role": "assistant", "content": "a"}, {"role": "user", "content": "go"}]  # fmt: skip
    r = _create(client, input=given, max_output_tokens=2)
    listed = client.get(f"/responses/{r.id}/input_items", cast_to=object, options={"params": {"order": "asc"}})
    assert [item["type"] for item in listed["data"]] == [item.get("type", "message") for item in given]
    for item in listed["data"]:
        assistant = item.get("role") == "assistant"
        kinds.get(item["type"], ResponseOutputMessage if assistant else ResponseInputMessageItem).model_validate(item)
    wait_idle(server)


def test_a_background_stream_is_read_again_from_any_event(client, server):
    """background + stream (OpenAI's and vLLM's): the events as a plain stream of the same request sends them (and
    response.queued), each kept, so that GET ?stream=true&starting_after=N sends the ones after N again; a client
    that leaves does not stop the response; a cancel ends a running one as cancelled, its stream with it, its
    blocks freed."""
    import http.client

    kw = {"input": "tell me more", "max_output_tokens": 24}
    plain = list(_create(client, **kw, stream=True))
    events = list(_create(client, **kw, stream=True, background=True))
    # as OpenAI's: queued until it runs (response.queued, then .in_progress)
    assert [e.type for e in events] == [plain[0].type, "response.queued", *[e.type for e in plain[1:]]]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == plain[-1].response.output_text and final.background is True
    again = list(client.responses.retrieve(final.id, stream=True, starting_after=4))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events[5:]]
    assert client.responses.retrieve(final.id).output_text == final.output_text

    body = json.dumps({"model": MODEL, "input": "leave early", "max_output_tokens": 60, "temperature": 0,
                       "background": True, "stream": True})  # fmt: skip
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", "/v1/responses", body, {"Content-Type": "application/json"})
    head = b""
    reply = conn.getresponse()
    while b"\n\n" not in head:
        more = reply.read1(4096)
        assert more, (reply.status, head)
        head += more
    rid = json.loads(head.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"]["id"]
    conn.close()  # gone after the first event: the response runs on
    resumed = list(client.responses.retrieve(rid, stream=True))
    assert resumed[-1].type in ("response.completed", "response.incomplete")
    assert client.responses.retrieve(rid).output_text == resumed[-1].response.output_text

    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    long = json.dumps({"model": MODEL, "input": "go on", "max_output_tokens": 480, "background": True, "stream": True,
                       "structured_outputs": {"regex": "[a-z]{470}"}})  # no end before the cancel  # fmt: skip
    conn.request("POST", "/v1/responses", long, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    head = b""
    while head.count(b"\n\n") < 3:
        more = reply.read1(4096)
        assert more, (reply.status, head)
        head += more
    rid = json.loads(head.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"]["id"]
    assert client.responses.cancel(rid).status == "cancelled"
    reply.read()  # the stream ends
    assert 1 <= client.responses.retrieve(rid).usage.output_tokens < 470  # what it generated before the cancel
    conn.close()
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.retrieve(_create(client, input="plain", max_output_tokens=2).id, stream=True)
    assert err.value.body["param"] == "stream"
    wait_idle(server)


def test_a_cancelled_background_stream_ends_with_the_response_get_returns(client, server):
    """A background stream cancelled while it runs ends with a terminal event (it stopped after its last delta,
    none said why), response.incomplete, whose Response is cancelled and is the one GET returns: the text streamed
    so far, its item incomplete, usage counting the tokens produced; read again, the stream ends the same way."""
    events = []
    stream = _create(client, input="go on", max_output_tokens=480, background=True, stream=True,
                     extra_body={"structured_outputs": {"regex": "[a-z]{470}"}})  # no end before the cancel
    restore = slowed_steps(server, 0.005)  # 2.4 s for its 470 tokens: the cancel lands before its end, however busy
    try:
        for event in stream:
            events.append(event)
            if len(events) == 6:
                rid = events[0].response.id
                cancelled = client.responses.cancel(rid)
    finally:
        restore()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    got = client.responses.retrieve(rid)
    assert got.model_dump() == last.response.model_dump() == cancelled.model_dump()
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert got.output_text == text and got.output[0].status == "incomplete"
    assert 1 <= got.usage.output_tokens == len(text) < 470  # the tiny model's byte vocabulary: a token a character
    again = list(client.responses.retrieve(rid, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
    wait_idle(server)


def test_background_streams_read_to_their_end_do_not_fill_the_store(tiny_engine_dir):
    """A background stream's client that read its last event has the Response: it is no longer held unread, so a
    small store keeps taking new background streams (each was held until polled: a 503 for good after a few). Its
    id, reused once it was evicted, names the new response alone (the old events were replayed as the new one's)."""
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(responses_store_size=8 << 10))  # fmt: skip
    try:
        client = openai_client(handle.url)
        for i in range(24):
            events = list(_create(client, input=f"hi {i}", max_output_tokens=8, background=True, stream=True))
            assert events[-1].type in ("response.completed", "response.incomplete")
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.input_items.list(events[-1].response.id, extra_query={"limit": "abc"})
        assert err.value.body["param"] == "limit"
        status, _, body = request(handle, f"/v1/responses/{events[-1].response.id}?stream=true&starting_after=--5")
        assert status == 400 and body["error"]["param"] == "starting_after"
        last = events[-1].response.id
        for i in range(8):  # answers not in the background push it out of the store; its events stay in theirs
            _create(client, input=f"filler {i}", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(last)
        _create(client, input="another", max_output_tokens=2, extra_body={"request_id": last})  # the id reused
        with pytest.raises(openai.BadRequestError) as err:  # not the evicted response's events
            list(client.responses.retrieve(last, stream=True))
        assert err.value.body["param"] == "stream"
        wait_idle(handle)
    finally:
        handle.shutdown(timeout=0)
