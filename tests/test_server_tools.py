"""Tool calls over HTTP with the official `openai` client, on a tiny engine whose chat template takes tools and
asks for hermes-style `<tool_call>` blocks (Qwen2.5's form): `tool_choice: "auto"` (and tools without
tool_choice) reads the calls out of the model's text. The random model's output is forced with a one-choice
grammar (`guided_choice`), so that the generated text IS a given tool call, text, or malformed call; the expected
answer is that text read by the format's rules. Streaming: the calls' first deltas carry id / type / name, later
ones pieces of the arguments, which join to the non-streamed arguments. Named and required calls stream the same
way. (An engine whose template takes no tools refuses auto: tests/test_server_structured.py.)"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import save_manifest

from runtime_helpers import openai_client
from tests.test_server import request, stream, wait_idle
from tests.test_server_scoring import client as client  # a fixture: the openai client of this module's `server`
from trtpaged.engine_files import sha256_file
from trtpaged.manifest import MANIFEST_NAME
from trtpaged.server import ServerOptions, start_server

openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install openai)")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install xgrammar)")

MODEL = "tiny-tools"
# Qwen2.5's tool prompt cut to fit the tiny engine's 512 positions (byte tokens: the tools by name only), in the
# tiny byte-level tokenizer's specials.
HERMES_TEMPLATE = """{%- if tools %}<|bos|>system
Tools: {% for tool in tools %}{{ tool.function.name }} {% endfor %}
Call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|eos|>
{% endif %}{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|bos|>assistant
{% for tc in m.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|eos|>
{% elif m.role == 'tool' %}<|bos|>user
<tool_response>{{ m.content }}</tool_response><|eos|>
{% else %}<|bos|>{{ m.role }}
{{ m.content }}<|eos|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|bos|>assistant
{% endif %}"""
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
MESSAGES = [{"role": "user", "content": "Weather in Paris, and 2 + 40?"}]
ONE_CALL = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
            '</tool_call>')  # fmt: skip
TWO_CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>\n<tool_call>\n'
             '{"arguments": {"city": "Rome, \\"IT\\"", "unit": "F"}, "name": "get_weather"}\n</tool_call>')  # fmt: skip
# (forced output, expected content, expected calls [(name, arguments)]) by the hermes format's rules
CASES = [
    (ONE_CALL, "Let me look.", [("get_weather", {"city": "Paris", "unit": "C"})]),
    (TWO_CALLS, None, [("add", {"a": 2, "b": 40}), ("get_weather", {"city": 'Rome, "IT"', "unit": "F"})]),
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    ('<tool_call>\n{"name": "fly", "arguments": {}}\n</tool_call>', None, []),  # not a tool: content
]


@pytest.fixture(scope="module")
def tools_engine_dir(tiny_engine_dir, tmp_path_factory):
    """The tiny engine with a tools-capable (hermes-style) chat template, its manifest's hashes rewritten."""
    out = tmp_path_factory.mktemp("engines") / "tiny-tools"
    shutil.copytree(tiny_engine_dir, out)
    (out / "tokenizer" / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["chat_template"] = HERMES_TEMPLATE
    manifest["files"] = {rel: sha256_file(out / rel) for rel in manifest["files"]}
    save_manifest(out, manifest)
    return out


@pytest.fixture(scope="module")
def server(tools_engine_dir):
    handle = start_server(tools_engine_dir, port=0, served_model_name=MODEL, device="cpu")
    yield handle
    handle.shutdown(timeout=0)


def _create(client, forced, stream=False, **kw):
    kw.setdefault("tools", TOOLS)
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                                          stream=stream, extra_body={"guided_choice": [forced]}, **kw)  # fmt: skip


def _streamed(chunks):
    """(content, [(id, name, arguments)], finish_reason) of a streamed choice, the calls joined by index."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.id is not None:  # the first delta of a call: id, type, name, no arguments yet
                    assert tc.index not in calls and tc.type == "function" and tc.function.arguments == ""
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                else:
                    assert tc.function.name is None
                    calls[tc.index][2] += tc.function.arguments
            finish = c.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("forced, content, calls", CASES)
def test_auto_reads_the_models_calls(client, forced, content, calls):
    for extra in ({}, {"tool_choice": "auto"}):  # tools without tool_choice: auto, as OpenAI has it
        choice = _create(client, forced, **extra).choices[0]
        assert choice.message.content == (content if calls else forced)
        got = [(tc.function.name, json.loads(tc.function.arguments)) for tc in choice.message.tool_calls or []]
        assert got == calls
        assert choice.finish_reason == ("tool_calls" if calls else "stop")
        for tc in choice.message.tool_calls or []:
            assert tc.id.startswith("call_") and tc.type == "function"
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == tc.function.name)
            jsonschema.validate(json.loads(tc.function.arguments), schema)


@pytest.mark.parametrize("forced, content, calls", CASES)
def test_streamed_auto_joins_to_the_full_answer(client, forced, content, calls):
    full = _create(client, forced).choices[0]
    streamed_content, streamed_calls, finish = _streamed(_create(client, forced, stream=True))
    assert finish == full.finish_reason
    assert streamed_content == full.message.content
    assert [(n, a) for _, n, a in streamed_calls] == [(tc.function.name, tc.function.arguments)
                                                      for tc in full.message.tool_calls or []]  # fmt: skip
    assert all(i.startswith("call_") for i, _, _ in streamed_calls)


def test_streamed_calls_at_stream_interval_3_join_to_the_full_answer(client, tools_engine_dir):
    """A server at `--stream-interval 3` hands the tool-call parser 3 tokens of text at a time: streamed calls
    still join to the interval-1 server's full answers (content, names, arguments, finish reason)."""
    import openai

    handle = start_server(tools_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(stream_interval=3))  # fmt: skip
    try:
        client3 = openai.OpenAI(base_url=handle.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for forced, _, _ in CASES:
            full = _create(client, forced).choices[0]
            content, calls, finish = _streamed(_create(client3, forced, stream=True))
            assert (content, finish) == (full.message.content, full.finish_reason), forced
            assert [(n, a) for _, n, a in calls] == [(tc.function.name, tc.function.arguments)
                                                     for tc in full.message.tool_calls or []], forced  # fmt: skip
        wait_idle(handle)
    finally:
        handle.shutdown(timeout=0)


def test_arguments_arrive_in_pieces(client):
    chunks = list(_create(client, ONE_CALL, stream=True))
    pieces = [tc.function.arguments for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []
              if tc.id is None]  # fmt: skip
    assert len(pieces) > 1 and "".join(pieces) == '{"city": "Paris", "unit": "C"}'


def test_tools_reach_the_template_and_free_generation_runs(client, server, tools_engine_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tools_engine_dir / "tokenizer"))

    def prompt_len(**kw):
        return len(tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kw),
                              add_special_tokens=False))  # fmt: skip

    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=12, n=3,
                                          temperature=1.0, seed=3)  # fmt: skip
    assert resp.usage.prompt_tokens == prompt_len(tools=TOOLS) > prompt_len() + len("get_weather add")
    # tool_choice "none": the model is still shown the tools (OpenAI's meaning, vLLM's default) and writes text
    none = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=4, temperature=0)  # fmt: skip
    assert none.usage.prompt_tokens == prompt_len(tools=TOOLS) and none.choices[0].message.tool_calls is None
    for choice in resp.choices:  # a random model writes no call: its text comes back as content
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "add", "arguments": '{"a": 2, "b": 40}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]  # fmt: skip
    follow = client.chat.completions.create(  # the call and its result rendered back through the template
        model=MODEL, messages=history, tools=TOOLS, max_tokens=20, temperature=0,
        extra_body={"guided_choice": ["It is 42."]})  # fmt: skip
    assert follow.choices[0].message.content == "It is 42." and follow.choices[0].message.tool_calls is None
    wait_idle(server)


@pytest.mark.parametrize("arguments, shown", [('{"a": 2, "b": 40}', {"a": 2, "b": 40}), ("", {}),
                                              ('{"a": 2', {}), ("[2, 40]", [2, 40]), ("40", 40)])  # fmt: skip
def test_call_arguments_reach_the_template_as_objects(server, tools_engine_dir, arguments, shown):
    """An assistant call's arguments, JSON text in OpenAI's API, reach the template as the value they encode (what
    transformers' templates read, as vLLM gives them: Qwen2.5's `arguments | tojson`; a list or a number as it is),
    in chat, /tokenize and LLM.chat's prompt alike, and an object or a list given parsed (LLM.chat) as it is; empty
    or cut arguments as {} (vLLM's), so that such a history still runs."""
    from transformers import AutoTokenizer

    from trtpaged.runtime.llm import chat_prompt_ids

    def history(args):
        return MESSAGES + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "add", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ]  # fmt: skip

    tok = AutoTokenizer.from_pretrained(str(tools_engine_dir / "tokenizer"))
    truth = tok.encode(tok.apply_chat_template(history(shown), tools=TOOLS, add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False)  # fmt: skip
    body = {"model": MODEL, "messages": history(arguments), "tools": TOOLS}
    status, _, tokenized = request(server, "/tokenize", body)
    assert status == 200 and tokenized["tokens"] == truth, tokenized
    status, _, chat = request(server, "/v1/chat/completions", {**body, "max_tokens": 1, "tool_choice": "none"})
    assert status == 200 and chat["usage"]["prompt_tokens"] == len(truth), chat
    assert chat_prompt_ids(tok, history(arguments), TOOLS) == truth
    if isinstance(shown, (dict, list)):  # given parsed (LLM.chat): as it is; vLLM gives another kind as {}
        assert chat_prompt_ids(tok, history(shown), TOOLS) == truth


def test_no_calls_are_none_and_a_call_that_is_no_function_call_is_refused_naming_it(server, tools_engine_dir):
    """An empty list of calls is an assistant turn without calls (vLLM's), for a template that asks whether the key
    is there, and so is another role's message with calls (vLLM keeps only an assistant's); a call without a
    function is a 400 naming it."""
    from transformers import AutoTokenizer

    from trtpaged.runtime.llm import chat_prompt_text

    tok = AutoTokenizer.from_pretrained(str(tools_engine_dir / "tokenizer"))
    asks = "{% for m in messages %}{{ m.role }}{% if m.tool_calls is defined %} calls{% endif %};{% endfor %}"
    answered = MESSAGES + [{"role": "assistant", "content": "hi"}]
    assert chat_prompt_text(tok, answered[:1] + [{**answered[1], "tool_calls": []}], chat_template=asks) == \
        tok.apply_chat_template(answered, chat_template=asks, add_generation_prompt=True, tokenize=False)  # fmt: skip
    calls = [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]
    for role in ("user", "system", "tool"):  # vLLM keeps only an assistant's calls
        assert chat_prompt_text(tok, [{"role": role, "content": "hi", "tool_calls": calls}], chat_template=asks) \
            == tok.apply_chat_template([{"role": role, "content": "hi"}], chat_template=asks,
                                       add_generation_prompt=True, tokenize=False), role  # fmt: skip
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}]
    status, _, answer = request(server, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 400 and answer["error"]["message"].startswith("messages[1].tool_calls[0]: "), answer
    deep = "[" * 5000 + "]" * 5000  # past the JSON reader's stack: was a 500
    messages[1]["tool_calls"][0]["function"] = {"name": "add", "arguments": deep}
    for path, extra in (("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 1})):
        status, _, answer = request(server, path, {"model": MODEL, "messages": messages, **extra})
        assert status == 400, answer
        assert answer["error"]["message"].startswith("messages[1].tool_calls[0].function.arguments: "), answer
    wait_idle(server)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "add"}}, "required"])
def test_forced_calls_stream_in_pieces_like_the_full_answer(client, tool_choice):
    kw = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 160,
          "temperature": 1.0}  # fmt: skip
    for seed in range(16):  # a random model may write calls until max_tokens: the first seed whose calls end
        full = client.chat.completions.create(seed=seed, **kw).choices[0]
        if full.finish_reason != "length":
            break
    kw["seed"] = seed
    ended = "tool_calls" if tool_choice == "required" else "stop"  # a named call ends with "stop" (OpenAI's, vLLM's)
    assert full.finish_reason == ended and full.message.content is None
    content, calls, finish = _streamed(client.chat.completions.create(stream=True, **kw))
    assert finish == ended and content is None
    assert [(n, a) for _, n, a in calls] == [(tc.function.name, tc.function.arguments)
                                             for tc in full.message.tool_calls]  # fmt: skip
    for _, name, arguments in calls:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(json.loads(arguments), schema)



@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "add"}}, "required"])
def test_a_forced_calls_stream_opens_with_content_null_as_openai_does(client, server, tool_choice):
    """A stream whose answer can only be calls (tool_choice required or a named function) opens with
    {"role": "assistant", "content": null}, OpenAI's first delta of a tool-call answer (was: content "", vLLM's
    role chunk): the openai client's stream accumulation then ends with content None, as the same request answered
    whole, and reports no content.delta. Under auto the answer's kind is not known when the role chunk goes out: it
    keeps content "", the first delta OpenAI (and vLLM) send before text."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    kw = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 0,
          "max_tokens": 40}  # fmt: skip
    events = stream(server, "/v1/chat/completions", kw)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}, events[0]
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:-1] if e["choices"]), events
    whole = client.chat.completions.create(**kw).choices[0].message
    state, kinds = ChatCompletionStreamState(), set()
    for chunk in client.chat.completions.create(stream=True, **kw):
        kinds.update(e.type for e in state.handle_chunk(chunk))
    streamed = state.current_completion_snapshot.choices[0].message  # (the final one refuses a cut answer)
    assert streamed.content is whole.content is None and streamed.tool_calls and "content.delta" not in kinds
    assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.tool_calls]  # fmt: skip
    for forced in (TWO_CALLS, "It is sunny in Paris."):  # auto: calls or text, unknown at the role chunk
        body = {**kw, "tool_choice": "auto", "guided_choice": [forced], "max_tokens": 200}
        first = stream(server, "/v1/chat/completions", body)[0]
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}, first
    wait_idle(server)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "add"}}, "required"])
def test_calls_cut_short_read_the_same_streamed_and_whole(client, tool_choice):
    """An output that max_tokens cuts inside a call: the whole answer holds the call as far as it was written
    (what the stream sent, joined), finish_reason "length"; its arguments begin the uncut call's."""
    kw = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 0}
    uncut = client.chat.completions.create(max_tokens=160, **kw)
    full_calls = [(tc.function.name, tc.function.arguments) for tc in uncut.choices[0].message.tool_calls or []]
    kw["max_tokens"] = uncut.usage.completion_tokens - 2  # past the first call's name, before its end
    cut = client.chat.completions.create(**kw).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls
    calls = [(tc.function.name, tc.function.arguments) for tc in cut.message.tool_calls]
    content, streamed, finish = _streamed(client.chat.completions.create(stream=True, **kw))
    assert (content, [(n, a) for _, n, a in streamed], finish) == (cut.message.content, calls, "length")
    if full_calls:  # the uncut call ended: the cut one is its beginning
        name, arguments = calls[-1]
        assert full_calls[len(calls) - 1][0] == name and full_calls[len(calls) - 1][1].startswith(arguments)
    # the grammar's call syntax is never content, at any cut (was: '"', '"parameters' or '[{"name": "add' beside
    # the call, streamed and whole)
    for max_tokens in range(1, uncut.usage.completion_tokens):
        kw["max_tokens"] = max_tokens
        cut = client.chat.completions.create(**kw).choices[0]
        content, streamed, finish = _streamed(client.chat.completions.create(stream=True, **kw))
        assert cut.message.content is None and not content, (max_tokens, cut.message.content, content)
        calls = [(tc.function.name, tc.function.arguments) for tc in cut.message.tool_calls or []]
        assert [(n, a) for _, n, a in streamed] == calls and finish == cut.finish_reason == "length"


@pytest.mark.parametrize("forced", [ONE_CALL, TWO_CALLS])
def test_model_calls_cut_anywhere_read_the_same_streamed_and_whole_with_no_json_as_content(client, forced):
    """The model's own calls (auto) cut by max_tokens at every token: the whole answer is the stream's deltas
    joined (content, calls), and once a call went out no piece of its JSON, or of a next call's, is content (was:
    content '"a' beside an `add` call with empty arguments, sent after the call streamed, before it whole)."""
    before = forced[: forced.index("<tool_call>")].strip() or None  # the text before the first call
    uncut = [(tc.function.name, tc.function.arguments) for tc in _create(client, forced).choices[0].message.tool_calls]
    for max_tokens in range(1, len(forced)):  # the tiny tokenizer's bytes: a token a character
        kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=max_tokens, temperature=0,
                  extra_body={"guided_choice": [forced]})  # fmt: skip
        whole = client.chat.completions.create(**kw).choices[0]
        calls = [(tc.function.name, tc.function.arguments) for tc in whole.message.tool_calls or []]
        content, streamed, finish = _streamed(client.chat.completions.create(stream=True, **kw))
        assert (content, [(n, a) for _, n, a in streamed], finish) == (whole.message.content, calls, "length"), \
            max_tokens  # fmt: skip
        if calls:
            assert whole.message.content == before, (max_tokens, whole.message.content)
            assert all(uncut[i][0] == n and uncut[i][1].startswith(a) for i, (n, a) in enumerate(calls)), max_tokens


# calls, a next call without arguments, text after them: cut at every character, then ended by the model (EOS)
ENDED_ANYWHERE = ('Hi.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>\n<tool_call>{"name": "add"}'
                  '</tool_call> Done.')  # fmt: skip


def _whole_and_streamed(client, forced: str) -> tuple[tuple, tuple]:
    """(content, [(name, arguments)], finish_reason) of the model's forced output answered whole, and streamed."""
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0,
              extra_body={"guided_choice": [forced]})  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    calls = [(tc.function.name, tc.function.arguments) for tc in whole.message.tool_calls or []]
    content, streamed, finish = _streamed(client.chat.completions.create(stream=True, **kw))
    return (whole.message.content, calls, whole.finish_reason), (content, [(n, a) for _, n, a in streamed], finish)


def test_model_calls_ended_anywhere_read_the_same_streamed_and_whole(client):
    """The model ends its output (EOS: finish_reason stop) at every character of its calls: the whole answer is the
    stream's deltas joined, a call that went out included (was: the stream sent the `add` call, the whole answer
    gave the text as content with no call), and once a call went out the content is the text before it (was: " Done."
    after the calls streamed, joined to "Hi." whole: a Responses answer's items in another order)."""
    for end in range(1, len(ENDED_ANYWHERE) + 1):  # the tiny tokenizer's bytes: a token a character
        whole, streamed = _whole_and_streamed(client, ENDED_ANYWHERE[:end])
        assert streamed == whole and whole[2] in ("stop", "tool_calls"), (end, whole, streamed)
        assert whole[0] == ("Hi." if whole[1] else ENDED_ANYWHERE[:end]), (end, whole)


def test_streamed_calls_carry_their_logprobs(client):
    kw = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
          "max_tokens": 40, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    whole = client.chat.completions.create(**kw)
    entries = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in whole.choices[0].logprobs.content]
    assert len(entries) == whole.usage.completion_tokens
    streamed = [(e.token, e.logprob, [t.token for t in e.top_logprobs])
                for chunk in client.chat.completions.create(stream=True, **kw) for c in chunk.choices
                if c.logprobs is not None for e in c.logprobs.content]  # fmt: skip
    assert streamed == entries


def test_streamed_calls_carry_their_token_ids(client):
    """vLLM's return_token_ids through the tool-call parser: the streamed chunks' ids join to the whole answer's,
    which are the tokens its log-probs name (return_tokens_as_token_ids), one per completion token."""
    kw = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
          "max_tokens": 40, "logprobs": True, "extra_body": {"return_token_ids": True,
                                                             "return_tokens_as_token_ids": True}}  # fmt: skip
    resp = client.chat.completions.create(**kw)
    whole, ids = resp.choices[0], resp.choices[0].model_extra["token_ids"]
    assert [e.token for e in whole.logprobs.content] == [f"token_id:{t}" for t in ids]
    assert len(ids) == resp.usage.completion_tokens and whole.message.tool_calls
    streamed = [t for chunk in client.chat.completions.create(stream=True, **kw) for c in chunk.choices
                for t in c.model_extra.get("token_ids") or []]  # fmt: skip
    assert streamed == ids


def test_parallel_tool_calls_false_makes_one_call(client):
    kw = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 160,
          "temperature": 1.0, "parallel_tool_calls": False}  # fmt: skip
    ended = 0
    for seed in range(12):  # a random model may write until max_tokens: count the answers whose call ended
        choice = client.chat.completions.create(seed=seed, **kw).choices[0]
        assert len(choice.message.tool_calls or []) <= 1
        if choice.finish_reason == "tool_calls":
            ended += 1
            assert len(choice.message.tool_calls) == 1
    assert ended


def test_parallel_tool_calls_false_under_auto_answers_the_first_call(client):
    """LangChain's ChatOpenAI(...).bind_tools(tools, parallel_tool_calls=False), the OpenAI Agents SDK's
    ModelSettings(parallel_tool_calls=False) and LiteLLM's parallel_tool_calls=False send it with tool_choice auto: a
    model that writes two calls is answered with the first, whole, streamed and on /v1/responses, as vLLM filters
    them (was: both calls, which those frameworks then ran)."""
    whole = _create(client, TWO_CALLS, parallel_tool_calls=False).choices[0]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in whole.message.tool_calls] == [
        ("add", {"a": 2, "b": 40})]  # fmt: skip
    assert whole.finish_reason == "tool_calls"
    content, calls, finish = _streamed(_create(client, TWO_CALLS, stream=True, parallel_tool_calls=False))
    assert (content, finish) == (whole.message.content, "tool_calls")
    assert [(n, a) for _, n, a in calls] == [("add", whole.message.tool_calls[0].function.arguments)]
    assert len(_create(client, TWO_CALLS).choices[0].message.tool_calls) == 2  # parallel by default
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    for parallel, count in ((False, 1), (True, 2)):
        resp = client.responses.create(model=MODEL, input=MESSAGES[0]["content"], tools=tools, max_output_tokens=200,
                                       temperature=0, parallel_tool_calls=parallel,
                                       extra_body={"structured_outputs": {"choice": [TWO_CALLS]}})  # fmt: skip
        assert [item.name for item in resp.output if item.type == "function_call"] == ["add", "get_weather"][:count]


def test_a_call_cut_by_a_stop_string_reads_the_same_streamed_and_whole(client):
    kw = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 160,
          "tool_choice": {"type": "function", "function": {"name": "add"}}}  # fmt: skip
    uncut = client.chat.completions.create(**kw).choices[0].message.tool_calls[0].function.arguments
    cut = client.chat.completions.create(stop=[","], **kw).choices[0]  # both keys are required: a comma between
    assert (cut.finish_reason, cut.stop_reason) == ("stop", ",")
    calls = [(tc.function.name, tc.function.arguments) for tc in cut.message.tool_calls]
    assert calls == [("add", uncut[: uncut.index(",")])]
    content, streamed, finish = _streamed(client.chat.completions.create(stream=True, stop=[","], **kw))
    assert (content, [(n, a) for _, n, a in streamed], finish) == (cut.message.content, calls, "stop")


def test_a_tool_without_parameters_is_called_with_an_object(client):
    """`parameters: {}` (or none) means an object of any properties, as OpenAI reads it (was: the named call's
    grammar was the empty schema, any JSON value: the model wrote '"SmolLM"' as content, no call)."""
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {}}}]
    kw = {"model": MODEL, "messages": MESSAGES, "tools": tools, "max_tokens": 120, "temperature": 1.0,
          "tool_choice": {"type": "function", "function": {"name": "ping"}}}  # fmt: skip
    ended = 0
    for seed in range(8):  # a random model may write until max_tokens: count the answers whose call ended
        choice = client.chat.completions.create(seed=seed, **kw).choices[0]
        if choice.finish_reason == "length":
            continue
        ended += 1
        (call,) = choice.message.tool_calls
        assert call.function.name == "ping" and isinstance(json.loads(call.function.arguments), dict)
    assert ended


def test_a_forced_call_to_a_tool_whose_parameters_are_no_object_is_refused(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError, match=r"tools\[0\].function.parameters: a forced call's arg"):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, tool_choice=choice)


def test_a_tool_definition_no_template_can_take_is_refused_naming_where(server):
    """A tool's description that is no string, or a lone surrogate (JSON's "\\ud800", which no tokenizer takes) in
    its description or anywhere in its parameters, is a 400 naming that place, from chat and /tokenize alike, with
    tool_choice none too (was: a description of any type rendered as it came; a surrogate named `messages` and a
    place in the template's text, or, where the template renders no descriptions, accepted). So is a `strict` that
    is no boolean, or an unknown key beside the function (Anthropic's cache_control, which LiteLLM sends, is taken)."""
    s = "\ud800"
    cases = [({"description": 5}, "tools[0].function.description: must be a string, got int"),
             ({"description": "a" + s}, "tools[0].function.description: not valid Unicode text"),
             ({"parameters": {"type": "object", "properties": {"x" + s: {"type": "string"}}}},
              "tools[0].function.parameters['properties']['x\\ud800']: not valid Unicode text"),
             ({"parameters": {"type": "object", "properties": {"x": {"type": "string", "enum": ["a", s]}}}},
              "tools[0].function.parameters['properties']['x']['enum'][1]: not valid Unicode text"),
             ({"strict": "yes"}, "tools[0].function.strict: must be true or false, got 'yes'")]  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]
    cases = [([{"type": "function", "function": {"name": "f", **change}}], start) for change, start in cases]
    cases.append(([{"type": "function", "function": {"name": "f"}, "x": 1}], "tools[0]: unknown keys ['x']"))
    for tools, start in cases:
        for path, body in (("/v1/chat/completions", {"tool_choice": "none", "max_tokens": 1}), ("/tokenize", {})):
            status, _, out = request(server, path, {"model": MODEL, "messages": messages, "tools": tools, **body})
            assert status == 400 and out["error"]["param"] == "tools", (path, tools, out)
            assert out["error"]["message"].startswith(start), (path, tools, out)
    tools = [{"type": "function", "function": {"name": "f", "strict": True}, "cache_control": {"type": "ephemeral"}}]
    assert request(server, "/tokenize", {"model": MODEL, "messages": messages, "tools": tools})[0] == 200
    wait_idle(server)

# a template that writes each tool as JSON, as Qwen's, Hermes' and Llama 3.1's do (`tool | tojson`)
JSON_TOOLS_TEMPLATE = ("{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% for m in messages %}<|bos|>"
                       "{{ m.role }}\n{{ m.content }}<|eos|>\n{% endfor %}{% if add_generation_prompt %}<|bos|>"
                       "assistant\n{% endif %}")  # fmt: skip


def test_a_tool_reaches_a_json_writing_template_in_vllms_key_order(tools_engine_dir):
    """A tool's keys reach the template in the order of vLLM's model ({type, function: {name, description,
    parameters, strict}}), whatever order the client wrote: the openai SDK's pydantic_function_tool writes {name,
    strict, parameters, description}, which a template writing tools as JSON wrote as sent (was: another prompt
    than vLLM's for the same request). Truth: transformers' template rendering of the tool written in that order."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tools_engine_dir / "tokenizer"))
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    sdk = openai.pydantic_function_tool  # the order this client writes, checked below
    pydantic = pytest.importorskip("pydantic")

    class _Weather(pydantic.BaseModel):
        """Weather in a city"""

        city: str

    sent = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": params,
                                             "description": "Weather in a city"}}  # fmt: skip
    typed = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                              "parameters": params, "strict": True}}  # fmt: skip
    assert list(sdk(_Weather)["function"]) == ["name", "strict", "parameters", "description"]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = tok.apply_chat_template(messages, tools=[typed], chat_template=JSON_TOOLS_TEMPLATE, tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    assert text.index('"description"') < text.index('"parameters"') < text.index('"strict"')
    truth = tok.encode(text, add_special_tokens=False)
    handle = start_server(tools_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          chat_template=JSON_TOOLS_TEMPLATE)  # fmt: skip
    try:
        status, _, out = request(handle, "/tokenize", {"model": MODEL, "messages": messages, "tools": [sent]})
        assert status == 200 and out["tokens"] == truth, out
    finally:
        handle.shutdown(timeout=0)


def test_tokenize_takes_chats_tool_choice_and_counts_the_chat_prompt(client, server):
    """/tokenize with tools and any tool_choice chat takes (with parallel_tool_calls): its tokens are the prompt
    tokens the chat completion of the same messages, tools and tool_choice reports (vLLM's return_token_ids) and
    counts in its usage; a tool_choice chat refuses is refused with chat's 400 (was: 400 "tool_choice: unknown
    field" for every choice)."""
    named = {"type": "function", "function": {"name": "add"}}
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [named]}}
    for choice in ("none", "auto", "required", named, allowed):
        for parallel in ({}, {"parallel_tool_calls": False}):
            chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                  max_tokens=1, extra_body={"return_token_ids": True}, **parallel)
            status, _, out = request(server, "/tokenize", {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                                           "tool_choice": choice, **parallel})  # fmt: skip
            assert status == 200, (choice, out)
            assert out["tokens"] == chat.model_extra["prompt_token_ids"], choice
            assert out["count"] == chat.usage.prompt_tokens, choice
    for choice in ({"type": "function", "function": {"name": "nope"}}, "sometimes"):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice)
        status, _, out = request(server, "/tokenize", {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                                       "tool_choice": choice})  # fmt: skip
        assert status == 400 and out["error"] == exc.value.body, choice
        assert out["error"]["param"] == "tool_choice"
    wait_idle(server)


def test_required_calls_follow_each_tools_own_defs(client):
    """A tool's $defs / definitions (pydantic writes them) are lifted to the root the required calls' grammar
    is compiled from, where their $refs point (was: 400 "Cannot find field '$defs'")."""
    date = {"type": "object", "properties": {"y": {"type": "integer"}}, "required": ["y"],
            "additionalProperties": False}
    tools = [
        {"type": "function", "function": {"name": "book", "parameters": {
            "$defs": {"Date": date}, "type": "object", "properties": {"when": {"$ref": "#/$defs/Date"}},
            "required": ["when"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "old", "parameters": {
            "definitions": {"N": {"type": "integer"}}, "type": "object",
            "properties": {"n": {"$ref": "#/definitions/N"}},
            "required": ["n"], "additionalProperties": False}}},
    ]  # fmt: skip
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    ended = 0
    for seed in range(8):
        choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required",
                                                max_tokens=160, temperature=1.0, seed=seed).choices[0]  # fmt: skip
        if choice.finish_reason != "tool_calls":
            continue
        ended += 1
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert ended


CHAIN = {"type": "object", "properties": {"val": {"type": "string", "maxLength": 3},
                                         "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                                         "copy": {"$ref": "#/properties/val"}},
         "required": ["val", "next"], "additionalProperties": False}  # fmt: skip


def test_required_calls_follow_refs_to_each_tools_own_root(client):
    """A tool's `$ref: "#"` (a recursive schema) and `#/properties/...` point into its own parameters. In the
    required calls' grammar they pointed to the root of the array of calls, so `next` could hold a list of calls
    (`{"val": "a", "next": [{"name": "chain", "parameters": ...}]}`), which the tool's schema refuses."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from trtpaged.server.tools import tool_choice

    tools = [{"type": "function", "function": {"name": "chain", "parameters": CHAIN}},
             {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "$defs": {
                 "val": {"type": "integer"}}, "properties": {"n": {"$ref": "#/$defs/val"}}, "required": ["n"]}}}]
    fine = {"val": "a", "next": {"val": "b", "next": None, "copy": "c"}}
    breaking = {"val": "a", "next": [{"name": "chain", "parameters": {"val": "b", "next": None}}]}
    jsonschema.validate(fine, CHAIN)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(breaking, CHAIN)
    grammar = xgrammar.Grammar.from_json_schema(tool_choice(tools, "required").grammar().json, any_whitespace=False)
    for arguments, taken in ((fine, True), (breaking, False), ({"n": 1}, False)):
        assert _is_grammar_accept_string(grammar, json.dumps([{"name": "chain", "parameters": arguments}])) == taken
    assert _is_grammar_accept_string(grammar, json.dumps([{"name": "other", "parameters": {"n": 1}}]))
    ended = 0
    for seed in range(8):
        choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools[:1], tool_choice="required",
                                                max_tokens=300, temperature=1.0, seed=seed).choices[0]  # fmt: skip
        if choice.finish_reason == "tool_calls":
            ended += 1
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), CHAIN)
    assert ended


PYTHONIC_CASES = [
    ('[get_weather(city="Paris", unit="C"), add(a=2, b=40)]', None,
     [("get_weather", {"city": "Paris", "unit": "C"}), ("add", {"a": 2, "b": 40})]),
    ("It is sunny. [add(a=1, b=2)]", "It is sunny. [add(a=1, b=2)]", []),  # calls only as the whole output
]  # fmt: skip


@pytest.fixture(scope="module")
def pythonic_client(tools_engine_dir):
    """The openai client of a server at --tool-call-parser pythonic (vLLM's, for Llama 3.2 and Gemma 3 templates)."""
    handle = start_server(tools_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(tool_call_parser="pythonic"))  # fmt: skip
    yield openai_client(handle.url)
    wait_idle(handle)
    handle.shutdown(timeout=0)


def test_pythonic_parser_reads_a_python_list_of_calls(pythonic_client):
    """The model's Python list of calls comes back as tool_calls with JSON arguments, whole and streamed alike;
    other text is content."""
    client = pythonic_client
    for forced, content, calls in PYTHONIC_CASES:
        full = _create(client, forced).choices[0]
        assert full.message.content == content
        got = [(tc.function.name, json.loads(tc.function.arguments)) for tc in full.message.tool_calls or []]
        assert got == calls and full.finish_reason == ("tool_calls" if calls else "stop")
        streamed_content, streamed_calls, finish = _streamed(_create(client, forced, stream=True))
        assert (streamed_content, finish) == (content, full.finish_reason)
        assert [(n, json.loads(a)) for _, n, a in streamed_calls] == calls


def test_pythonic_calls_ended_anywhere_read_the_same_streamed_and_whole(pythonic_client):
    """A Python list of calls ended by the model (EOS) at every character, a list of no calls and a call to no tool:
    the whole answer is the stream's deltas joined; with a call, no text is content, else all of it is (was: "[] x"
    streamed as content " x", the list dropped, and whole as "[] x")."""
    listed = '[get_weather(city="Paris)"), add(a=1, b=[2])] Done.'
    for forced in [listed[:end] for end in range(1, len(listed) + 1)] + ["[] x", "[add(a=1), fly(b=2)]"]:
        whole, streamed = _whole_and_streamed(pythonic_client, forced)
        assert streamed == whole and whole[2] in ("stop", "tool_calls"), (forced, whole, streamed)
        assert whole[0] == (None if whole[1] else forced), (forced, whole)


def test_allowed_tools_limits_the_calls_to_the_tools_it_names(client):
    """OpenAI's tool_choice {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}} (the Responses API's flat
    form too): the template is shown every tool (the prompt is the one of all the tools), the calls are the named
    tools' only: under "auto" a call to another tool reads as text, as it does when only the named tools are given;
    under "required" the call is forced among them; was: a 400 on a value the SDK types offer."""
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "add"}}]}}  # fmt: skip
    got = _create(client, TWO_CALLS, tool_choice=allowed)
    only_add = _create(client, TWO_CALLS, tools=[TOOLS[1]])  # the same output read with the add tool alone
    assert got.usage.prompt_tokens == _create(client, TWO_CALLS).usage.prompt_tokens  # every tool shown
    assert got.usage.prompt_tokens > only_add.usage.prompt_tokens
    choice, truth = got.choices[0], only_add.choices[0]
    assert (choice.message.content, choice.finish_reason) == (truth.message.content, truth.finish_reason)
    assert [(tc.function.name, tc.function.arguments) for tc in choice.message.tool_calls] == [
        (tc.function.name, tc.function.arguments) for tc in truth.message.tool_calls] == [("add", '{"a": 2, "b": 40}')]
    content, calls, finish = _streamed(_create(client, TWO_CALLS, stream=True, tool_choice=allowed))
    assert (content, finish, [(n, a) for _, n, a in calls]) == (truth.message.content, truth.finish_reason,
                                                                [("add", '{"a": 2, "b": 40}')])  # fmt: skip
    required = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "add"}}]}}  # fmt: skip
    ended = 0
    for seed in range(12):  # a random model may write until max_tokens: count the answers whose call ended
        choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=required,
                                                max_tokens=160, temperature=1.0, seed=seed).choices[0]  # fmt: skip
        assert {tc.function.name for tc in choice.message.tool_calls} == {"add"}
        if choice.finish_reason == "tool_calls":
            ended += 1
            for tc in choice.message.tool_calls:
                jsonschema.validate(json.loads(tc.function.arguments), TOOLS[1]["function"]["parameters"])
    assert ended
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    resp = client.responses.create(model=MODEL, input=MESSAGES[0]["content"], tools=tools, max_output_tokens=200,
                                   temperature=0, tool_choice={"type": "allowed_tools", "mode": "auto", "tools": [
                                       {"type": "function", "name": "add"}]},
                                   extra_body={"structured_outputs": {"choice": [TWO_CALLS]}})  # fmt: skip
    assert [item.name for item in resp.output if item.type == "function_call"] == ["add"]
    assert resp.tool_choice.type == "allowed_tools" and resp.tool_choice.mode == "auto"  # echoed as sent
    for bad, where in (({"mode": "sometimes", "tools": [{"type": "function", "function": {"name": "add"}}]}, "mode"),
                       ({"mode": "auto", "tools": [{"type": "function", "function": {"name": "fly"}}]}, "'fly'"),
                       ({"mode": "auto", "tools": []}, "tools"),
                       ({"mode": "auto", "tools": [{"type": "custom", "custom": {"name": "add"}}]}, "function")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=4,
                                           tool_choice={"type": "allowed_tools", "allowed_tools": bad})  # fmt: skip
        assert err.value.body["param"] == "tool_choice" and where in err.value.body["message"], err.value.body


def test_a_responses_allowed_tools_refusal_names_the_fields_as_the_client_sent_them(client):
    """The Responses API's allowed_tools is flat ({"type", "mode", "tools"}): a refusal of it named chat's nesting
    (tool_choice.allowed_tools.tools[0]), a field the client never sent."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    for bad, where in (({"mode": "auto", "tools": [{"type": "function", "name": "fly"}]},
                        "tool_choice.tools[0]: no tool named 'fly' in tools"),
                       ({"mode": "auto", "tools": []}, "tool_choice.tools: must be a non-empty list of "
                                                       "{'type': 'function', 'name': ...}")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, input="hi", tools=tools, max_output_tokens=4,
                                    tool_choice={"type": "allowed_tools", **bad})  # fmt: skip
        assert err.value.body["param"] == "tool_choice" and err.value.body["message"] == where, err.value.body
