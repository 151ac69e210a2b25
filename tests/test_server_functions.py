"""OpenAI's legacy function calling (`functions`, `function_call`, assistant `function_call` turns and `role:
"function"` messages) with the official `openai` client, on test_server_tools' tiny engine with a hermes-style chat
template. The truth is the same request in the tools form it stands for, answered by the same server: the legacy
answer is that answer's first call as `message.function_call` (`delta.function_call` in a stream), finish_reason
"function_call" where the tools form's is "tool_calls" ("stop" for a named call, as OpenAI ends a forced one); a
legacy conversation renders the same prompt as its tools form."""

from __future__ import annotations

import json

import pytest

from tests.test_server import request, wait_idle
from tests.test_server_scoring import client as client  # a fixture: the openai client of this module's `server`
from tests.test_server_tools import (MESSAGES, MODEL, ONE_CALL, TOOLS, TWO_CALLS,  # noqa: F401 - fixtures
                                     server as server, tools_engine_dir)  # fmt: skip
from trtpaged.server import start_server
from trtpaged.server.protocol import chat_messages
from trtpaged.server.schemas import ChatMessage

openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install openai)")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install xgrammar)")

FUNCTIONS = [t["function"] for t in TOOLS]
ADD = {"name": "add"}
SCHEMAS = {f["name"]: f["parameters"] for f in FUNCTIONS}


def _legacy(client, stream=False, **kw):
    kw.setdefault("functions", FUNCTIONS)
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", MESSAGES), stream=stream, **kw)


def _tools_form(client, stream=False, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", MESSAGES), tools=TOOLS,
                                          parallel_tool_calls=False, stream=stream, **kw)  # fmt: skip


def _streamed(chunks):
    """(content, (name, arguments) or None, finish_reason) of a streamed legacy choice; asserts the call's first
    delta carries its name with arguments "", the later ones pieces of its arguments only, and no tool_calls."""
    content, name, arguments, pieces, finish = "", None, "", 0, None
    for chunk in chunks:
        for c in chunk.choices:
            assert c.delta.tool_calls is None
            content += c.delta.content or ""
            call = c.delta.function_call
            if call is not None:
                if name is None:
                    assert call.name is not None and call.arguments == ""
                    name = call.name
                else:
                    assert call.name is None and call.arguments
                    arguments += call.arguments
                    pieces += 1
            finish = c.finish_reason or finish
    return content or None, (name, arguments, pieces) if name is not None else None, finish


@pytest.mark.parametrize("function_call", [None, "auto"])
@pytest.mark.parametrize("forced", [ONE_CALL, TWO_CALLS, "It is sunny in Paris."])
def test_auto_answers_the_first_call_as_function_call(client, forced, function_call):
    """functions without function_call (OpenAI's default "auto") or with "auto": the model's output (forced with a
    one-choice grammar) read as the tools form reads it; its first call is message.function_call."""
    extra = {"extra_body": {"guided_choice": [forced]}, "max_tokens": 200, "temperature": 0}
    legacy = _legacy(client, **({"function_call": function_call} if function_call else {}), **extra).choices[0]
    truth = _tools_form(client, **extra).choices[0]
    assert legacy.message.tool_calls is None and legacy.message.content == truth.message.content
    if truth.message.tool_calls:
        first = truth.message.tool_calls[0].function
        assert (legacy.message.function_call.name, legacy.message.function_call.arguments) == \
            (first.name, first.arguments)  # fmt: skip
        jsonschema.validate(json.loads(first.arguments), SCHEMAS[first.name])
        assert (truth.finish_reason, legacy.finish_reason) == ("tool_calls", "function_call")
    else:
        assert legacy.message.function_call is None and legacy.finish_reason == truth.finish_reason == "stop"
    content, call, finish = _streamed(_legacy(client, stream=True, **extra))
    assert (content, finish) == (legacy.message.content, legacy.finish_reason)
    whole = legacy.message.function_call
    assert (call[:2] if call else None) == ((whole.name, whole.arguments) if whole else None)
    assert call is None or call[2] > 1  # the arguments arrive in pieces


def test_named_function_call_is_forced_and_ends_with_stop(client, server):
    """function_call {"name": N} constrains the output to N's arguments, as the named tool_choice does: the same
    seed gives the tools form's call; it ends with "stop" (OpenAI's finish for a forced function_call)."""
    kw = {"max_tokens": 160, "temperature": 1.0}
    for seed in range(16):  # a random model may write until max_tokens: the first seed whose call ended
        legacy = _legacy(client, function_call=ADD, seed=seed, **kw)
        if legacy.choices[0].finish_reason != "length":
            break
    choice = legacy.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None and choice.message.tool_calls is None
    assert choice.message.function_call.name == "add"
    jsonschema.validate(json.loads(choice.message.function_call.arguments), SCHEMAS["add"])
    truth = _tools_form(client, tool_choice={"type": "function", "function": ADD}, seed=seed, **kw)
    assert choice.message.function_call.arguments == truth.choices[0].message.tool_calls[0].function.arguments
    assert legacy.usage.prompt_tokens == truth.usage.prompt_tokens  # the functions reach the template as tools
    content, call, finish = _streamed(_legacy(client, stream=True, function_call=ADD, seed=seed, **kw))
    assert (content, call[:2], finish) == (None, ("add", choice.message.function_call.arguments), "stop")
    none = _legacy(client, function_call="none", max_tokens=4, temperature=0)  # shown the functions, calls none
    assert none.usage.prompt_tokens == truth.usage.prompt_tokens and none.choices[0].message.function_call is None
    wait_idle(server)


LEGACY_HISTORY = MESSAGES + [
    {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": '{"a": 2, "b": 40}'}},
    {"role": "function", "name": "add", "content": "42"},
]
TOOLS_HISTORY = MESSAGES + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "add", "arguments": '{"a": 2, "b": 40}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "42"},
]  # fmt: skip


def test_a_conversation_with_function_turns_renders_as_its_tools_form(client, server):
    status, _, legacy = request(server, "/tokenize", {"model": MODEL, "messages": LEGACY_HISTORY, "tools": TOOLS})
    assert status == 200
    _, _, truth = request(server, "/tokenize", {"model": MODEL, "messages": TOOLS_HISTORY, "tools": TOOLS})
    assert legacy["tokens"] == truth["tokens"]
    follow = _legacy(client, messages=LEGACY_HISTORY, max_tokens=20, temperature=0,
                     extra_body={"guided_choice": ["It is 42."]})  # fmt: skip
    assert follow.usage.prompt_tokens == truth["count"] and follow.choices[0].message.content == "It is 42."
    wait_idle(server)


def test_tokenize_takes_functions_and_counts_the_chat_requests_prompt(client, server):
    """/tokenize of a legacy chat body's messages and functions is its prompt as /v1/chat/completions renders it
    (the ids its return_token_ids gives, the count its usage gives), the same as the tools form's (was: 400
    "functions: unknown field"); its refusals name the legacy fields, as the chat endpoint's do."""
    body = {"model": MODEL, "messages": LEGACY_HISTORY, "functions": FUNCTIONS}
    status, _, counted = request(server, "/tokenize", body)
    assert status == 200, counted
    done = _legacy(client, messages=LEGACY_HISTORY, function_call=ADD, max_tokens=1,
                   extra_body={"return_token_ids": True})  # fmt: skip
    assert counted["tokens"] == done.prompt_token_ids and counted["count"] == done.usage.prompt_tokens
    assert counted["tokens"] == request(server, "/tokenize", {"model": MODEL, "messages": TOOLS_HISTORY,
                                                              "tools": TOOLS})[2]["tokens"]  # fmt: skip
    for change, param, message in [
        ({"tools": TOOLS}, "functions", "functions: cannot be sent with tools"),
        ({"functions": [{"name": "a b"}]}, "functions", "functions[0].name: must match"),
        ({"functions": [{"name": "f", "type": "function"}]}, "functions", "functions[0]: unknown keys ['type']"),
        ({"functions": [FUNCTIONS[1], FUNCTIONS[1]]}, "functions", "functions[1].name: 'add' is defined twice"),
        ({"functions": [{"name": "f", "parameters": {"type": 3}}]}, "functions", "functions[0].parameters['type']"),
    ]:
        status, _, out = request(server, "/tokenize", {**body, **change})
        assert status == 400 and out["error"]["param"] == param and out["error"]["message"].startswith(message), out
    for asks_nothing in ({"functions": None}, {"functions": []}):  # as without them, as chat answers them
        assert request(server, "/tokenize", {**body, **asks_nothing})[2]["tokens"] == request(
            server, "/tokenize", {"model": MODEL, "messages": LEGACY_HISTORY})[2]["tokens"]  # fmt: skip
    wait_idle(server)


def test_function_messages_answer_the_calls_of_their_names():
    """Each function message is the tool message answering the oldest unanswered call of its name (a stable id,
    the same in every request that sends the conversation); one without such a call gets its own id."""
    turns = [{"role": "user", "content": "go"},
             {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": "{}"}},
             {"role": "assistant", "content": "and", "function_call": {"name": "get_weather", "arguments": "{}"}},
             {"role": "function", "name": "get_weather", "content": "sun"},
             {"role": "function", "name": "add", "content": "3"},
             {"role": "function", "name": "add", "content": None}]  # fmt: skip
    messages = chat_messages([ChatMessage.model_validate(t) for t in turns])
    assert chat_messages([ChatMessage.model_validate(t) for t in turns]) == messages  # stable
    ids = {m["tool_calls"][0]["function"]["name"]: m["tool_calls"][0]["id"] for m in messages if m.get("tool_calls")}
    assert [m["content"] for m in messages[1:3]] == [None, "and"] and "function_call" not in messages[1]
    answers = [(m["role"], m["tool_call_id"], m["content"]) for m in messages[3:]]
    assert answers[:2] == [("tool", ids["get_weather"], "sun"), ("tool", ids["add"], "3")]
    assert answers[2][1] not in ids.values() and answers[2][2] == ""
    assert all(len(i) == 9 and i.isalnum() for i in [*ids.values(), answers[2][1]])


BAD = [
    ({"functions": FUNCTIONS, "tools": TOOLS}, "functions", "functions: cannot be sent with tools"),
    ({"functions": FUNCTIONS, "function_call": ADD, "tool_choice": "auto"}, "function_call",
     "function_call: cannot be sent with tool_choice"),
    ({"functions": FUNCTIONS, "tool_choice": "required"}, "tool_choice",
     "tool_choice: cannot be sent with functions; send function_call"),
    ({"function_call": ADD}, "function_call", "function_call: needs functions"),
    ({"function_call": "auto", "functions": []}, "function_call", "function_call: needs functions"),
    ({"functions": FUNCTIONS, "function_call": "required"}, "function_call", "function_call: must be 'none', 'auto'"),
    ({"functions": FUNCTIONS, "function_call": {"name": "fly"}}, "function_call",
     "function_call: no function named 'fly' in functions"),
    ({"functions": [{"name": "a b"}]}, "functions", r"functions[0].name: must match"),
    ({"functions": [{"name": "f", "type": "function"}]}, "functions", "functions[0]: unknown keys ['type']"),
    ({"functions": ["f"]}, "functions", "functions[0]: must be {name, description?, parameters?}"),
    ({"functions": [FUNCTIONS[1], FUNCTIONS[1]]}, "functions", "functions[1].name: 'add' is defined twice"),
    ({"functions": [{"name": f"f{i}"} for i in range(129)]}, "functions", "functions: at most 128 functions"),
    ({"functions": [{"name": "f", "parameters": {"type": 3}}]}, "functions", "functions[0].parameters['type']"),
    ({"functions": [{"name": "f", "parameters": {"type": "array"}}], "function_call": {"name": "f"}}, "functions",
     "functions[0].parameters: a forced call's arguments are a JSON object"),
    ({"functions": FUNCTIONS, "function_call": ADD, "extra_body": {"guided_regex": "x"}}, "function_call",
     "function_call: function calls already constrain the output"),
    ({"messages": MESSAGES + [{"role": "assistant", "function_call": {"name": "add"}}]}, "messages",
     "messages[1].function_call: must be {'name': string, 'arguments': string}"),
    ({"messages": MESSAGES + [{"role": "function", "content": "1"}]}, "messages",
     "messages[1].name: required for a function message"),
]  # fmt: skip


@pytest.mark.parametrize("body, param, message", BAD)
def test_bad_legacy_fields_are_refused_naming_them(client, server, body, param, message):
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**kw)
    error = caught.value.body
    assert error["param"] == param and error["message"].startswith(message), error
    wait_idle(server)  # no block left behind; the server answers the next request


@pytest.mark.parametrize("asks_nothing", [{"functions": None}, {"functions": []}, {"function_call": None},
                                          {"function_call": "none"},
                                          {"function_call": "none", "tools": TOOLS, "tool_choice": "none"}])
def test_legacy_fields_that_ask_nothing_answer_as_without_them(server, asks_nothing):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    status, _, plain = request(server, "/v1/chat/completions", {**body, **{k: v for k, v in asks_nothing.items()
                                                                           if k in ("tools", "tool_choice")}})
    status_given, _, given = request(server, "/v1/chat/completions", {**body, **asks_nothing})
    assert status == status_given == 200
    assert given["choices"][0]["message"] == plain["choices"][0]["message"]
    assert "function_call" not in given["choices"][0]["message"]


def test_an_engine_whose_template_takes_no_tools_refuses_auto_and_forces_a_named_call(tiny_engine_dir):
    """As with tools: auto (the default with functions) needs the model's call format, refused in the legacy
    fields' words; a named function_call is grammar-forced on any engine."""
    from runtime_helpers import openai_client

    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu")
    try:
        plain = openai_client(handle.url)
        with pytest.raises(openai.BadRequestError) as caught:
            _legacy(plain, max_tokens=4)
        error = caught.value.body
        assert error["param"] == "function_call" and error["message"].startswith(
            "function_call: 'auto' (the default when functions are given) is not available: ") and \
            error["message"].endswith("send 'none' or {'name': ...}")  # fmt: skip
        # in the legacy words throughout (was: "this model's chat template does not take tools": the apostrophe read
        # as a quote, whose text is never renamed)
        assert "chat template does not take functions" in error["message"] and "tool" not in error["message"]
        for seed in range(16):
            choice = _legacy(plain, function_call=ADD, max_tokens=160, temperature=1.0, seed=seed).choices[0]
            if choice.finish_reason != "length":
                break
        assert choice.finish_reason == "stop" and choice.message.function_call.name == "add"
        jsonschema.validate(json.loads(choice.message.function_call.arguments), SCHEMAS["add"])
        wait_idle(handle)
    finally:
        handle.shutdown(timeout=0)
