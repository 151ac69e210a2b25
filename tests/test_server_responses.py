"""POST /v1/responses (OpenAI's Responses API) with the official `openai` client: the answer is the chat answer of
the messages the request stands for (instructions as the system message, input items as turns), computed by the
Python API; the stream's typed events join to the non-streamed Response; usage counts the chat prompt's tokens;
function tools come back as function_call items; what the server cannot do is refused naming the field."""

from __future__ import annotations

import json
import time

import pytest

from tests.test_server import request, wait_idle
from tests.test_server_scoring import client as client  # a fixture: the openai client of this module's `server`
from tests.test_server_tools import ONE_CALL, TOOLS, TWO_CALLS, tools_engine_dir  # noqa: F401 - a fixture
from trtpaged import LLM, SamplingParams
from trtpaged.server import start_server

from runtime_helpers import slowed_steps

openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install openai)")
MODEL = "tiny"
# the Responses API's function tools: chat's, flattened
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def server(tools_engine_dir):  # noqa: F811 - the fixture imported above
    handle = start_server(tools_engine_dir, port=0, served_model_name=MODEL, device="cpu")
    yield handle
    handle.shutdown(timeout=0)


@pytest.fixture(scope="module")
def llm(tools_engine_dir):  # noqa: F811
    return LLM(tools_engine_dir, device="cpu")


def _chat_truth(llm, messages, max_tokens, tools=None):
    out = llm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0), tools=tools)[0]
    return out.outputs[0], len(llm.chat_prompt(messages, tools=tools))


def test_text_answer_is_the_chat_answer_of_its_messages(client, llm):
    for max_tokens in (3, 40):
        truth, prompt_len = _chat_truth(llm, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "hello there"}], max_tokens)  # fmt: skip
        r = client.responses.create(model=MODEL, instructions="Be brief.", input="hello there",
                                    max_output_tokens=max_tokens, temperature=0)  # fmt: skip
        assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
        assert r.output_text == truth.text
        assert (r.status, r.incomplete_details and r.incomplete_details.reason) == (
            ("incomplete", "max_output_tokens") if truth.finish_reason == "length" else ("completed", None))
        assert (r.usage.input_tokens, r.usage.output_tokens) == (prompt_len, len(truth.token_ids))
        assert r.usage.total_tokens == prompt_len + len(truth.token_ids)
        assert r.max_output_tokens == max_tokens and r.instructions == "Be brief." and r.store is False


def test_input_tokens_count_what_the_response_reads(client, llm):
    """OpenAI's POST /v1/responses/input_tokens through the SDK: the prompt tokens of the chat the same request
    renders (instructions, items, tools), and the usage.input_tokens /v1/responses reports for it."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    counted = client.responses.input_tokens.count(model=MODEL, instructions="Be brief.", input="hello there")
    assert counted.object == "response.input_tokens" and counted.input_tokens == len(llm.chat_prompt(messages))
    answered = client.responses.create(model=MODEL, instructions="Be brief.", input="hello there", max_output_tokens=2)
    assert answered.usage.input_tokens == counted.input_tokens
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]  # fmt: skip
    with_tools = client.responses.input_tokens.count(model=MODEL, input="hello there", tools=tools)
    assert with_tools.input_tokens == len(llm.chat_prompt(messages[1:], tools=TOOLS))
    for extra, param in (({"personality": "friendly"}, "personality"), ({"model": "other"}, "model"),
                         ({"input": None, "instructions": "Be brief."}, "input"),  # as /v1/responses: input needed
                         ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                          "input")):  # fmt: skip
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as err:
            client.responses.input_tokens.count(**{"input": "hi", **extra})
        assert err.value.body["param"] == param


def test_stream_events_join_to_the_full_response(client, server):
    kw = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "tell me"}]}],
              max_output_tokens=12, temperature=0)  # fmt: skip
    full = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{full.status}"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == full.output_text == events[-4].text
    assert {d.item_id for d in deltas} == {events[2].item.id}
    last = events[-1].response
    assert last.output_text == full.output_text and last.status == full.status
    assert (last.usage.input_tokens, last.usage.output_tokens) == (full.usage.input_tokens, full.usage.output_tokens)
    wait_idle(server)


def test_logprobs_are_the_chat_logprobs(client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=4, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    got = r.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    # the second request finds the prompt in the prefix cache: its last row is computed in a smaller step
    assert [(g.token, [t.token for t in g.top_logprobs]) for g in got] == \
        [(w.token, [t.token for t in w.top_logprobs]) for w in want]  # fmt: skip
    for g, w in zip(got, want):
        assert [t.logprob for t in g.top_logprobs] == pytest.approx([t.logprob for t in w.top_logprobs], abs=1e-5)
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
    # top_logprobs without the include asks for none, as OpenAI and vLLM answer it (echoed all the same)
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=4, temperature=0, top_logprobs=2)
    assert r.output[0].content[0].logprobs in (None, []) and r.top_logprobs == 2


@pytest.mark.parametrize("k", [-1, 21, 10**30])
def test_top_logprobs_out_of_range_is_refused_with_or_without_the_include(client, k):
    """An out-of-range top_logprobs is refused as chat refuses it (logprobs true), naming the field and its range,
    whether or not log-probs are included (was: without the include any value was taken and echoed)."""
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       logprobs=True, top_logprobs=k)  # fmt: skip
    assert chat.value.body["param"] == "top_logprobs" and ("[0, 20]" in chat.value.body["message"] or k == -1)
    for include in ([], ["message.output_text.logprobs"]):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, input="hi", max_output_tokens=1, top_logprobs=k, include=include)
        assert (err.value.body["param"], err.value.body["message"]) == ("top_logprobs", chat.value.body["message"])


def test_items_become_the_conversation_turns(client, llm):
    """A function call and its output, an assistant message and a developer message: the prompt the server
    counts is the chat template's prompt of the same turns (developer as system)."""
    items = [
        {"type": "message", "role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris", "unit": "C"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is 21 C."}]},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "assistant", "content": "It is 21 C."},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    truth, prompt_len = _chat_truth(llm, messages, 5)
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=5, temperature=0)
    assert r.usage.input_tokens == prompt_len
    assert r.output_text == truth.text


@pytest.mark.parametrize("forced", [ONE_CALL, TWO_CALLS])
def test_function_calls_are_output_items(client, forced):
    """The model's calls (its text forced by a one-choice grammar) come back as function_call items, as chat reads
    them; streamed, their argument deltas join to the same arguments."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}], tools=TOOLS,
                                          max_tokens=200, temperature=0,
                                          extra_body={"structured_outputs": {"choice": [forced]}})  # fmt: skip
    want = [(tc.function.name, tc.function.arguments) for tc in chat.choices[0].message.tool_calls]
    kw = dict(model=MODEL, input="go", tools=FLAT_TOOLS, max_output_tokens=200, temperature=0,
              extra_body={"structured_outputs": {"choice": [forced]}})  # fmt: skip
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == want
    assert all(c.call_id.startswith("call_") and c.status == "completed" for c in calls)
    texts = [o for o in r.output if o.type == "message"]
    assert [t.content[0].text for t in texts] == ([chat.choices[0].message.content] if chat.choices[0].message.content
                                                  else [])  # fmt: skip
    events = list(client.responses.create(stream=True, **kw))
    args: dict[int, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.output_index] = args.get(e.output_index, "") + e.delta
    final = events[-1].response
    streamed = [(o.name, args.get(i, "")) for i, o in enumerate(final.output) if o.type == "function_call"]
    assert streamed == want
    assert [json.loads(a) for _, a in streamed] == [json.loads(a) for _, a in want]



def test_input_tokens_refuses_what_the_response_refuses_and_counts_what_it_reads(server):
    """/v1/responses/input_tokens answers a body as /v1/responses does (was: counted bodies /v1/responses refuses, the
    checks made of the chat body it translates to skipped: a tool_choice naming no tool, a text.format no grammar
    takes, sampling fields out of range): the same 400, or the usage.input_tokens of the Response."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    refused = [{"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
               {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
               {"temperature": -1}, {"top_p": 2}, {"max_output_tokens": 0}]  # fmt: skip
    taken = [{"tools": FLAT_TOOLS, "tool_choice": "required"},
             {"text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}, {"temperature": 0.5}]
    for change in refused + taken:
        body = {"model": MODEL, "input": "Weather in Paris?", **change}
        status, _, made = request(server, "/v1/responses", {"max_output_tokens": 2, **body})
        count_status, _, counted = request(server, "/v1/responses/input_tokens", body)
        assert count_status == status, (change, made, counted)
        if change in refused:
            assert status == 400 and counted["error"] == made["error"], (change, made, counted)
        else:
            want = {"object": "response.input_tokens", "input_tokens": made["usage"]["input_tokens"]}
            assert status == 200 and counted == want, (change, made, counted)
    wait_idle(server)

@pytest.mark.parametrize("extra, param", [
    ({"truncation": "middle"}, "truncation"),
    ({"background": True}, "background"),  # a background response must be stored: this server stores none
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"include": ["not.a.thing"]}, "include"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"text": {"format": {"type": "json_object", "schema": {}}}}, "text"),
    ({"text": {"verbosity": 5}}, "text"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"reasoning": {"effort": "ultra"}}, "reasoning"),
    ({"reasoning": {"bogus": 1}}, "reasoning"),
    ({"service_tier": "bogus"}, "service_tier"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),  # without stream: true
    ({"stream": True, "stream_options": {"include_usage": True}}, "stream_options"),  # chat's, not this API's
    ({"max_tool_calls": -1}, "max_tool_calls"),
    # OpenAI's options of SDK 3.63: what asks for something this server lacks, or is not of the SDK's type
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]}, "context_management"),
    ({"context_management": [{"compact_threshold": 1000}]}, "context_management"),
    ({"image": {"context_compression": "enabled"}}, "image"),
    ({"image": {"context_compression": True}}, "image"),
    ({"access_programs": {"cyber": "daybreak_red"}}, "access_programs"),
    ({"access_programs": {"cyber": "other"}}, "access_programs"),
    ({"background_options": {"completion_window": "2h"}}, "background_options"),  # without background
    ({"background_options": {"completion_window": "1h"}}, "background_options"),
    ({"background_options": {"continuation_id": 7}}, "background_options"),
    ({"prompt_cache_options": {"prewarm": True}}, "prompt_cache_options"),
    ({"prompt_cache_options": {"ttl": "24h"}}, "prompt_cache_options"),
    ({"prompt_cache_options": {"retention": "24h"}}, "prompt_cache_options"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x",
                                              "prompt_cache_breakpoint": {"mode": "implicit"}}]}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "1d"}}]}]}, "input"),
])  # fmt: skip
def test_what_cannot_be_served_is_refused_naming_the_field(client, server, extra, param):
    body = {"model": MODEL, "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/responses", body=body, cast_to=object)
    assert err.value.body["param"] == param
    assert err.value.body["message"].startswith(param.split(".")[0])
    wait_idle(server)


def test_a_repeated_prompt_reports_its_cached_tokens(client, server):
    """The second of two equal requests finds every whole block of its prompt but the one holding the last token
    (whose logits it must compute) in the prefix cache; the first finds none."""
    kw = dict(model=MODEL, input="a prompt long enough to fill a few blocks " * 3, max_output_tokens=2, temperature=0)
    first, second = client.responses.create(**kw), client.responses.create(**kw)
    block_size = server.llm.config.block_size
    prompt_len = second.usage.input_tokens
    assert first.usage.input_tokens == prompt_len > 2 * block_size
    assert first.usage.input_tokens_details.cached_tokens == 0
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached == (prompt_len - 1) // block_size * block_size
    # every full block of a prompt is written to the cache once computed: the first request's all, the second's none
    # but the one holding the last token, when that block is full
    assert first.usage.input_tokens_details.cache_write_tokens == prompt_len // block_size * block_size
    assert second.usage.input_tokens_details.cache_write_tokens == prompt_len // block_size * block_size - cached


def test_an_answers_text_and_calls_fed_back_are_one_assistant_turn(client, llm):
    """What a client sends back after a tool call: the previous answer's items (its text, then its call), then
    the call's output. The chat conversation they stand for has one assistant message with both."""
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris", "unit": "C"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
    ]  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]  # fmt: skip
    truth, prompt_len = _chat_truth(llm, messages, 4)
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=4, temperature=0)
    assert (r.usage.input_tokens, r.output_text) == (prompt_len, truth.text)


def test_streamed_items_finish_one_before_the_next_begins(client):
    events = list(client.responses.create(model=MODEL, input="go", tools=FLAT_TOOLS, max_output_tokens=200,
                                          temperature=0, stream=True,
                                          extra_body={"structured_outputs": {"choice": [ONE_CALL]}}))  # fmt: skip
    order = [(e.type, e.output_index) for e in events if e.type in ("response.output_item.added",
                                                                     "response.output_item.done")]  # fmt: skip
    # text, then the call: each item added, then done, before the next is added
    assert order == [("response.output_item.added", 0), ("response.output_item.done", 0),
                     ("response.output_item.added", 1), ("response.output_item.done", 1)]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("forced, cut_after", [(ONE_CALL, '"get_weather", "a'), (TWO_CALLS, '"add", "a'),
                                               (TWO_CALLS, "</tool_call>\n<")])  # fmt: skip
def test_a_models_call_cut_by_max_output_tokens_has_the_same_items_streamed_or_not(client, forced, cut_after):
    """The model's call cut while it writes its JSON: the same output items, in the same order, streamed or not,
    and none of the call's JSON as text (was: its cut rest a message after the call streamed, before it whole)."""
    cut = forced.index(cut_after) + len(cut_after)  # the tiny tokenizer's bytes: a token a character
    kw = dict(model=MODEL, input="go", tools=FLAT_TOOLS, max_output_tokens=cut, temperature=0,
              extra_body={"structured_outputs": {"choice": [forced]}})  # fmt: skip

    def items(r) -> list[tuple]:
        return [(o.type, o.status, o.content[0].text if o.type == "message" else (o.name, o.arguments))
                for o in r.output]  # fmt: skip

    whole = client.responses.create(**kw)
    streamed = list(client.responses.create(stream=True, **kw))[-1].response
    assert items(streamed) == items(whole)
    assert [t for kind, _, t in items(whole) if kind == "message"] == ([forced[: forced.index("<")].strip()]
                                                                       if forced.index("<") else [])  # fmt: skip
    assert whole.status == "incomplete" and whole.output[-1].type == "function_call"


@pytest.mark.parametrize("after", [" Done.", '\n<tool_call>\n{"name": "fly"}\n</tool_call>',
                                   '\n<tool_call>\n{"name": "a'])  # fmt: skip
def test_text_after_a_models_calls_is_no_item_streamed_or_not(client, after):
    """Text after the model's calls (words, a call to no tool, a next call's cut start, then EOS): the same items,
    in the same order, streamed or not: the text before the calls, then the calls (was: the text after them a
    message after the call streamed, folded into the message before it whole)."""
    kw = dict(model=MODEL, input="go", tools=FLAT_TOOLS, temperature=0,
              extra_body={"structured_outputs": {"choice": [ONE_CALL + after]}})  # fmt: skip

    def items(r) -> list[tuple]:
        return [(o.type, o.content[0].text if o.type == "message" else (o.name, o.arguments)) for o in r.output]

    whole = client.responses.create(**kw)
    streamed = list(client.responses.create(stream=True, **kw))[-1].response
    assert items(streamed) == items(whole) == [("message", "Let me look."),
                                               ("function_call", ("get_weather", '{"city": "Paris", "unit": "C"}'))]
    assert whole.status == streamed.status == "completed"


def test_a_call_cut_by_max_output_tokens_is_incomplete(client):
    for stream in (False, True):
        kw = dict(model=MODEL, input="go", tools=FLAT_TOOLS, tool_choice="required", max_output_tokens=30,
                  temperature=0)  # fmt: skip
        r = list(client.responses.create(stream=True, **kw))[-1].response if stream else client.responses.create(**kw)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[-1].type == "function_call" and r.output[-1].status == "incomplete"


def test_an_empty_answer_is_one_empty_message_streamed_or_not(client, llm):
    first = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=8, temperature=0.0))[0]
    stop = first.outputs[0].text[:1]
    assert stop
    kw = dict(model=MODEL, input="hi", max_output_tokens=5, temperature=0, extra_body={"stop": [stop]})
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for r in (whole, events[-1].response):
        assert r.status == "completed" and [(o.type, o.content[0].text) for o in r.output] == [("message", "")]


def test_a_lone_surrogate_in_an_echoed_field_is_escaped_not_a_500(server):
    """metadata and user are echoed in the Response; a lone surrogate there (valid JSON, not valid UTF-8 text) made
    the write fail after the whole generation."""
    import urllib.request

    body = b'{"model": "tiny", "input": "hi", "max_output_tokens": 2, "metadata": {"k": "\\ud800"}, "user": "\\ud800"}'
    req = urllib.request.Request(server.url + "/v1/responses", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        answer = json.loads(resp.read())
    assert answer["metadata"] == {"k": "\ud800"} and answer["user"] == "\ud800"


def test_the_response_id_is_the_request_id_header(client):
    raw = client.responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=2)
    assert raw.headers["x-request-id"] == raw.parse().id


def test_a_refusal_of_the_instructions_names_instructions(server):
    import urllib.error
    import urllib.request

    body = b'{"model": "tiny", "input": "hi", "instructions": "\\ud800"}'
    req = urllib.request.Request(server.url + "/v1/responses", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    error = json.loads(err.value.read())["error"]
    assert err.value.code == 400 and error["param"] == "instructions" and error["message"].startswith("instructions:")


def test_the_responses_own_defaults_and_platform_settings_are_taken_and_echoed(client, llm):
    """What a Response echoes can be sent back: tool_choice "auto" (or "none") without tools, max_tool_calls (a cap
    on built-in tools, none of which run here), reasoning and service_tier; the answer is the plain chat answer."""
    truth, _ = _chat_truth(llm, [{"role": "user", "content": "hello there"}], 6)
    for choice in ("auto", "none"):
        r = client.responses.create(model=MODEL, input="hello there", max_output_tokens=6, temperature=0,
                                    tool_choice=choice, max_tool_calls=3, reasoning={"effort": "low"},
                                    service_tier="flex")  # fmt: skip
        assert r.output_text == truth.text
        assert (r.tool_choice, r.max_tool_calls, r.reasoning.effort, r.service_tier) == (choice, 3, "low", "flex")
    plain = client.responses.create(model=MODEL, input="hello there", max_output_tokens=6, temperature=0)
    assert (plain.tool_choice, plain.reasoning.effort, plain.service_tier) == ("auto", None, "auto")


def test_openais_platform_options_that_ask_for_nothing_more_change_nothing(client, llm, server):
    """SDK 3.63's prompt-cache options and content-part breakpoints (the prefix cache here is automatic), the
    Standard access program (a model without a Cyber tier), the soonest completion window, no moderation, no
    context management and the default image options: taken through the SDK; the answer is the plain one."""
    truth, _ = _chat_truth(llm, [{"role": "user", "content": "hello\nthere"}], 6)
    parts = [{"type": "input_text", "text": "hello", "prompt_cache_breakpoint": {"mode": "explicit"}},
             {"type": "input_text", "text": "there", "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": parts}], max_output_tokens=6,
                                temperature=0, moderation=None, context_management=[],
                                image={"context_compression": "auto"}, access_programs={"cyber": "standard"},
                                background_options={"completion_window": "soonest", "continuation_id": "batch-1"},
                                prompt_cache_options={"mode": "explicit", "ttl": "12h", "prewarm": False,
                                                      "comparison_response_id": "resp_earlier"})  # fmt: skip
    assert r.output_text == truth.text
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", moderation={"model": "omni-moderation-latest"})
    assert err.value.body["param"] == "moderation" and "no moderation model" in err.value.body["message"]
    wait_idle(server)
    assert client.responses.create(model=MODEL, input=[{"role": "user", "content": parts}], max_output_tokens=6,
                                   temperature=0).output_text == truth.text  # fmt: skip


def test_a_refusal_keeps_the_clients_own_values_as_sent(client, server):
    """Chat's field names in a refusal become the Responses API's, but not inside a value the client sent: a tool
    named max_tokens is named max_tokens."""
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", tools=FLAT_TOOLS,
                                tool_choice={"type": "function", "name": "max_tokens"})  # fmt: skip
    assert "'max_tokens'" in err.value.body["message"] and "max_output_tokens" not in err.value.body["message"]
    assert err.value.body["param"] == "tool_choice"
    wait_idle(server)


def test_a_body_request_id_is_the_response_id_as_given(client):
    """vLLM's request_id names the Response as given (it was prefixed again: resp_resp_abc)."""
    raw = client.responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=2,
                                                    extra_body={"request_id": "resp_abc"})  # fmt: skip
    assert raw.parse().id == "resp_abc" == raw.headers["x-request-id"]


def test_a_failed_stream_reports_the_tokens_it_spent(tools_engine_dir):  # noqa: F811
    """A stream cut by the request timeout ends with response.failed, whose usage counts the output tokens sent
    before it (one log-prob entry per token in the deltas), not null."""
    from runtime_helpers import openai_client
    from trtpaged.server import ServerOptions

    handle = start_server(tools_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(request_timeout_s=1.0))  # fmt: skip
    restore = slowed_steps(handle, 0.02)  # 400 tokens take >= 8 s: the timeout cuts the stream after some were sent
    try:
        events = list(openai_client(handle.url).responses.create(
            model=MODEL, input="hi", max_output_tokens=400, temperature=0, stream=True,
            include=["message.output_text.logprobs"]))  # fmt: skip
    finally:
        restore()
        handle.shutdown(timeout=0)
    sent = sum(len(e.logprobs) for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.failed" and 0 < sent < 400, (events[-1].type, sent, events[-1])
    usage = events[-1].response.usage
    assert usage is not None and usage.output_tokens == sent and usage.input_tokens > 0


def test_a_response_echoes_the_settings_the_sdk_reads_back(client, llm):
    """prompt_cache_key, safety_identifier, prompt_cache_retention (the Response's spelling) and text.verbosity come
    back as sent, and completed_at is set once the Response completed (OpenAI's), in the body and the stream; was:
    the SDK read None for each. The answer is the plain chat answer (cut at a stop string: completed)."""
    messages = [{"role": "user", "content": "hello there"}]
    long, _ = _chat_truth(llm, messages, 12)
    stop = next(ch for ch in long.text if ch.isalnum())  # a stop string the greedy answer meets
    short, _ = _chat_truth(llm, messages, 3)
    assert short.finish_reason == "length" and stop not in short.text
    for text, max_tokens, extra, completed in ((short.text, 3, {}, False),
                                               (long.text.partition(stop)[0], 12, {"stop": [stop]}, True)):
        ask = dict(model=MODEL, input="hello there", max_output_tokens=max_tokens, temperature=0,
                   prompt_cache_key="k-1", safety_identifier="user-1", prompt_cache_retention="in-memory",
                   text={"verbosity": "low"})  # fmt: skip
        before = time.time()
        r = client.responses.create(**ask, extra_body=extra)
        events = list(client.responses.create(stream=True, **ask, extra_body=extra))
        after = time.time()
        for got in (r, events[-1].response):
            assert got.output_text == text and got.status == ("completed" if completed else "incomplete")
            assert (got.prompt_cache_key, got.safety_identifier, got.prompt_cache_retention, got.text.verbosity) == \
                ("k-1", "user-1", "in_memory", "low")  # fmt: skip
            assert (before - 1 <= got.completed_at <= after) if completed else got.completed_at is None
        assert events[0].response.completed_at is None
