"""An explicit JSON null for an optional request field is the field left out, on every route, as OpenAI's API and
vLLM read it (LangChain, LiteLLM and Go / Java clients send null for the parameters they do not set): each case
sends a body with one field null and the same body without it to a real server, and the two answers must be the
same (status, greedy output or token ids; a chat template that prints what it is shown, for nested fields)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.test_server import request, wait_idle
from trtpaged.server import start_server
from trtpaged.server.server import ServerOptions

MODEL = "tiny-nulls"
USER = [{"role": "user", "content": "hello there"}]
# a request template showing what the template is given: a null that reached it would show as null
SHOWN = "{{ messages|tojson }}#{{ (tools|tojson) if tools is defined else 'undef' }}"
FUNCTION = {"name": "get_weather", "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip
GREEDY = {"model": MODEL, "temperature": 0}
TOOL_USE = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]  # fmt: skip

# (route, a valid body, the path of the field sent as null)
CASES = [
    ("/tokenize", {"model": MODEL, "messages": USER, "prompt": "x"}, ["prompt"]),
    ("/tokenize", {"model": MODEL, "prompt": "hello there", "messages": USER}, ["messages"]),
    ("/invocations", {**GREEDY, "messages": USER, "max_tokens": 4, "prompt": "x"}, ["prompt"]),
    ("/invocations", {**GREEDY, "prompt": "once upon a time", "max_tokens": 4, "messages": USER}, ["messages"]),
    ("/tokenize", {"model": MODEL, "prompt": "hello there", "add_special_tokens": True}, ["add_special_tokens"]),
    ("/tokenize", {"model": MODEL, "messages": USER, "add_special_tokens": True}, ["add_special_tokens"]),
    ("/v1/completions", {**GREEDY, "prompt": "once upon a time", "max_tokens": 4, "add_special_tokens": True},
     ["add_special_tokens"]),
    ("/v1/chat/completions", {**GREEDY, "messages": USER, "max_tokens": 4, "add_special_tokens": True},
     ["add_special_tokens"]),
    ("/v1/responses", {**GREEDY, "input": "hello there", "max_output_tokens": 4, "stream": False}, ["stream"]),
    ("/v1/responses/input_tokens", {"model": MODEL, "input": "hello there", "stream": False}, ["stream"]),
    ("/v1/messages", {**GREEDY, "messages": USER, "max_tokens": 4, "stream": False}, ["stream"]),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": USER, "stream": False}, ["stream"]),
    ("/v1/messages", {**GREEDY, "messages": TOOL_USE, "max_tokens": 4}, ["messages", 1, "content", 0, "input"]),
    ("/v1/chat/completions", {**GREEDY, "messages": USER, "max_tokens": 4, "tools": [{"type": "function",
     "function": FUNCTION}], "tool_choice": "none"}, ["tools", 0, "function", "parameters"]),  # fmt: skip
    ("/v1/chat/completions", {**GREEDY, "messages": USER, "max_tokens": 4, "functions": [FUNCTION],
                              "function_call": "none"}, ["functions", 0, "parameters"]),  # fmt: skip
    ("/tokenize", {"model": MODEL, "messages": USER, "functions": [FUNCTION], "function_call": "none"},
     ["function_call"]),
    *(("/tokenize", {"model": MODEL, "messages": USER, "chat_template": SHOWN,
                     "tools": [{"type": "function", "function": {**FUNCTION, "strict": False}}]},
       ["tools", 0, "function", key]) for key in ("description", "parameters", "strict")),
]


@pytest.fixture(scope="module")
def server(tiny_engine_dir):
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(trust_request_chat_template=True))  # fmt: skip
    yield handle
    handle.shutdown(timeout=0)


def _edited(body: dict[str, Any], path: list[Any], null: bool) -> dict[str, Any]:
    """`body` with the field at `path` set to null, or left out."""
    out = copy.deepcopy(body)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    if null:
        parent[path[-1]] = None
    else:
        parent.pop(path[-1])
    return out


def _answer(status: int, out: Any) -> tuple[int, Any]:
    """What must not depend on the null: the status, and the tokens, the greedy text or the error's message."""
    if status != 200:
        return status, out["error"]["message"]
    if "choices" in out:
        return status, [(c.get("text"), c.get("message"), c["finish_reason"]) for c in out["choices"]]
    if out.get("object") == "response":
        return status, [item.get("content") for item in out["output"]]
    return status, {k: out[k] for k in ("tokens", "input_tokens", "content") if k in out}


@pytest.mark.parametrize("route, body, path", CASES, ids=[f"{r}:{'.'.join(map(str, p))}" for r, _, p in CASES])
def test_a_null_field_is_the_field_left_out(server, route, body, path):
    absent = _answer(*request(server, route, _edited(body, path, null=False))[::2])
    assert absent[0] == 200, absent  # the body without the field is a valid one
    assert _answer(*request(server, route, _edited(body, path, null=True))[::2]) == absent
    wait_idle(server)


def test_tokenize_takes_function_call_as_chat_does(server):
    """/tokenize takes the legacy function_call beside functions as the chat endpoint does (the template is shown the
    functions whatever it chooses: the tokens are the chat prompt's), and refuses it as chat does."""
    status, _, chat = request(server, "/v1/chat/completions", {
        **GREEDY, "messages": USER, "max_tokens": 1, "functions": [FUNCTION], "function_call": {"name": "get_weather"},
        "return_token_ids": True})  # fmt: skip
    assert status == 200, chat
    for choice in ("none", "auto", {"name": "get_weather"}):
        status, _, out = request(server, "/tokenize", {"model": MODEL, "messages": USER, "functions": [FUNCTION],
                                                       "function_call": choice})  # fmt: skip
        assert status == 200 and out["tokens"] == chat["prompt_token_ids"], (choice, out)
    tools = [{"type": "function", "function": FUNCTION}]
    for body in ({"function_call": {"name": "get_weather"}, "tools": tools}, {"function_call": "auto"},
                 {"functions": [FUNCTION], "function_call": 3}, {"functions": [FUNCTION], "function_call": "required"}):
        for route in ("/tokenize", "/v1/chat/completions"):
            status, _, out = request(server, route, {"model": MODEL, "messages": USER, **body})
            assert status == 400 and out["error"]["param"] == "function_call", (route, body, out)


@pytest.mark.parametrize("route, body", [
    ("/tokenize", {"model": MODEL, "prompt": "hi", "add_special_tokens": "yes"}),
    ("/v1/responses", {**GREEDY, "input": "hi", "stream": "no"}),
    ("/tokenize", {"model": MODEL, "prompt": None}),
    ("/tokenize", {"model": MODEL, "prompt": None, "messages": None}),
    ("/v1/chat/completions", {**GREEDY, "messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": "none"}}], "tool_choice": "none"}),  # fmt: skip
    ("/v1/messages", {**GREEDY, "messages": USER, "max_tokens": None}),
])
def test_a_wrong_value_or_a_required_fields_null_is_still_refused(server, route, body):
    status, _, out = request(server, route, body)
    assert status == 400 and out["error"]["message"], out
