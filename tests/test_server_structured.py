"""Structured outputs and tool calls over HTTP with the official `openai` client: OpenAI's response_format and
tools, vLLM's structured_outputs / guided_* spellings; outputs checked with jsonschema, the regex, the choices;
bad specs are 400s naming the field."""

from __future__ import annotations

import functools
import json
import re

import openai
import pytest

from tests.test_server import metrics, request, stream, wait_idle
from tests.test_server_scoring import MODEL, client as client, server as server  # fixtures, one server per module
from tests.test_structured_outputs import ANSWER, ANSWER_TAG, LEGACY_TAG, STRUCTURES, check_exactly_tagged, \
    check_triggered  # fmt: skip

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install xgrammar)")
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14},
                   "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["city", "days", "code"], "additionalProperties": False,
}  # fmt: skip
DEEP_SCHEMA = functools.reduce(lambda inner, _: {"type": "array", "items": inner}, range(100), {"type": "string"})

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                                    "unit": {"enum": ["C", "F"]}},
                                                     "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
MESSAGES = [{"role": "user", "content": "Plan a trip."}]


def test_response_format_json_schema_on_both_endpoints(client, server):
    before = metrics(server).get("structured_output_requests_total", 0)
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, n=6, temperature=1.0,
                                          max_tokens=80)  # fmt: skip
    done = client.completions.create(model=MODEL, prompt="trip:", n=6, temperature=1.0, max_tokens=80,
                                     extra_body={"response_format": fmt})  # fmt: skip
    outputs = [c.message.content for c in chat.choices] + [c.text for c in done.choices]
    for text in outputs:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(outputs)) > 2
    assert metrics(server)["structured_output_requests_total"] == before + 2
    wait_idle(server)


def test_json_schema_without_a_schema_is_an_object_and_the_empty_schema_any_value(client, server):
    """OpenAI's json_schema with no schema: the answer is a JSON object; `{}`, the empty schema, lets any JSON
    value through (a tiny random model writes long values: only the finished answers are parsed)."""
    seen: dict[str, set] = {"absent": set(), "empty": set()}
    for case, spec in (("absent", {"name": "any"}), ("empty", {"name": "any", "schema": {}})):
        fmt = {"type": "json_schema", "json_schema": spec}
        for seed in range(6):
            resp = client.completions.create(model=MODEL, prompt="json:", max_tokens=48, temperature=1.0, seed=seed,
                                             extra_body={"response_format": fmt})
            choice = resp.choices[0]
            if choice.finish_reason == "stop":
                seen[case].add(type(json.loads(choice.text)).__name__)
    assert seen["absent"] == {"dict"}, seen
    assert seen["empty"] and seen["empty"] != {"dict"}, seen
    wait_idle(server)


def test_vllm_spellings_regex_choice_grammar_json(client):
    def texts(extra, n=6, max_tokens=40):
        resp = client.completions.create(model=MODEL, prompt="answer:", n=n, temperature=1.0, max_tokens=max_tokens,
                                         extra_body=extra)  # fmt: skip
        return [c.text for c in resp.choices]

    pattern = r"[0-9]{2}:[0-9]{2}"
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        assert all(re.fullmatch(pattern, t) for t in texts(extra))
    choices = ["left", "right", "straight on"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        assert set(texts(extra, n=8)) <= set(choices)
    assert all(re.fullmatch("(on|off)!", t) for t in texts({"guided_grammar": 'root ::= ("on" | "off") "!"'}))
    for text in texts({"guided_json": SCHEMA}, max_tokens=80):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_streamed_structured_output_joins_to_valid_json(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 80, "temperature": 1.0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}  # fmt: skip
    events = stream(server, "/v1/chat/completions", body)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)


def _validate_call(call):
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_choice_named_and_required(client):
    named = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, n=4, temperature=1.0,
                                           max_tokens=60, tool_choice={"type": "function", "function": {"name": "add"}})
    for choice in named.choices:  # a named call ends with "stop", as OpenAI and vLLM end it
        assert choice.finish_reason == "stop" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
        _validate_call(call)
    required = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, n=4, temperature=1.0,
                                              max_tokens=150, tool_choice="required")  # fmt: skip
    names = set()
    for choice in required.choices:
        if choice.finish_reason == "length":  # a random model may call many tools; then it is text
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _validate_call(call)
            names.add(call.function.name)
    assert names


def test_response_format_beside_a_forced_call_is_dropped(client):
    """The SDK's parse(response_format=M, tools=..., tool_choice=...) sends both: the reply is the call, with no text
    for response_format to shape, so it is dropped (vLLM's ToolParser.adjust_request): the same call as without it,
    named and required, whole and streamed; structured_outputs / guided_* beside a forced call stay refused."""
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0)
        plain = client.chat.completions.create(**kw).choices[0]
        both = client.chat.completions.create(response_format=fmt, **kw).choices[0]
        assert both.message.tool_calls and both.finish_reason == plain.finish_reason
        assert [(c.function.name, c.function.arguments) for c in both.message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in plain.message.tool_calls]
        streamed = list(client.chat.completions.create(response_format=fmt, stream=True, **kw))
        arguments = "".join(tc.function.arguments or "" for ch in streamed for c in ch.choices
                            for tc in (c.delta.tool_calls or []))  # fmt: skip
        assert arguments == "".join(c.function.arguments for c in plain.message.tool_calls)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       max_tokens=8, extra_body={"structured_outputs": {"regex": "a"}})  # fmt: skip
    assert err.value.body["param"] == "tool_choice"


def test_streamed_tool_calls(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=1.0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))  # fmt: skip
    deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]  # id, type and name first; then pieces of the arguments
    assert first.index == 0 and first.function.name == "get_weather" and first.id.startswith("call_")
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    first.function.arguments += "".join(d.function.arguments for d in rest)
    _validate_call(first)
    assert chunks[-1].choices[0].finish_reason == "stop"  # a named call's, as OpenAI and vLLM end it


def test_tool_choice_none_generates_text(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=5, temperature=0)  # fmt: skip
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": "nope"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),  # no name
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a\n", "schema": SCHEMA}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strcit": True}}},
     "response_format"),  # a misspelt key is not silently dropped
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": "yes"}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f\n"}}], "tool_choice": "required"}, "tools"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": DEEP_SCHEMA}}},
     "response_format"),  # nested 100 deep: refused before xgrammar compiles it
    ({"guided_json": "{broken"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"bogus": 1}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" by default: refused (this template takes no tools)
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "other"}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
      "tool_choice": "required"}, "tools"),
    # not a JSON schema: refused whatever tool_choice is (was: a 200 with "none", a 400 on tool_choice otherwise)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "none"}, "tools"),
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": "g", "parameters": {"properties": 5}}}],
      "tool_choice": {"type": "function", "function": {"name": TOOLS[0]["function"]["name"]}}}, "tools"),
    # a schema, but one the grammar would not enforce: the forced call's grammar is refused
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"n": 2, "use_beam_search": True, "guided_regex": "a"}, "guided_regex"),
    ({"allowed_token_ids": [0], "guided_choice": ["yes"]}, "guided_choice"),  # found in the step: nothing allowed
    # structural tags: the shape when the request is read, xgrammar's reason (and the json kind's rules) at compile
    ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "response_format.format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "sequence", "elements": []}}},
     "response_format.format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": DEEP_SCHEMA}}},
     "response_format.format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.format"),
    ({"response_format": {**ANSWER_TAG, "strict": True}}, "response_format"),
    ({"response_format": {**LEGACY_TAG, "triggers": ["<x"]}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>", "end": "</a>"}],
                          "triggers": ["<"]}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<"]}}, "response_format"),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": json.dumps({"format": ANSWER_TAG["format"]})}},
     "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": "[" * 3000 + "]" * 3000}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": json.dumps(ANSWER_TAG), "regex": "a"}}, "structured_outputs"),
    ({"structural_tag": '{"type": "structural_tag", "format": {"type": "or", "elements": []}}'}, "structural_tag"),
    ({"structural_tag": json.dumps(ANSWER_TAG), "guided_regex": "a"}, "structural_tag"),  # two grammars: the second
    ({"response_format": ANSWER_TAG, "structured_outputs": {"structural_tag": json.dumps(ANSWER_TAG)}},
     "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": "required", "structural_tag": json.dumps(ANSWER_TAG)}, "tool_choice"),
])  # fmt: skip
def test_bad_specs_are_400s_naming_the_field(client, server, extra, field):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert info.value.body["param"] == field, info.value.body
    wait_idle(server)


def test_a_refusal_renames_the_fields_it_names_but_not_the_values_it_quotes(server):
    """A request with max_completion_tokens: a runtime refusal's text names max_tokens as max_completion_tokens,
    but a value of the client's it quotes stays as sent (was: the schema's required 'max_tokens' shown as
    'max_completion_tokens', a property the schema does not have)."""
    schema = {"type": "object", "properties": {}, "required": ["max_tokens"]}
    body = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}  # fmt: skip
    status, _, out = request(server, "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "response_format", out
    assert out["error"]["message"].startswith("response_format: the JSON schema's required property 'max_tokens' "
                                              "is not defined in 'properties'"), out  # fmt: skip
    wait_idle(server)


@pytest.mark.parametrize("extra, field, words", [
    ({"guided_json": {"const": "\ud800"}}, "guided_json", "json schema #/const: not valid Unicode text"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"\ud800": {"type": "string"}}}}},
     "structured_outputs", "json schema #/properties/\\ud800: not valid Unicode text"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["a", "\udc00"]}}}},
     "response_format", "json schema #/enum/1: not valid Unicode text"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {
        "const": "\ud800"}}}}, "response_format.format", "json schema at format.json_schema #/const: not valid"),
    ({"guided_choice": ["yes", "\u0000"]}, "guided_choice", "choice[1] holds a NUL character (U+0000"),
    ({"structured_outputs": {"choice": ["a\u0000b"]}}, "structured_outputs", "choice[0] holds a NUL character"),
    ({"guided_choice": ["\ud800"]}, "guided_choice", "choice[0]: not valid Unicode text"),
    # a lone surrogate in a structural tag's own strings (was: xgrammar's 'Failed to parse JSON: syntax error')
    ({"response_format": {"type": "structural_tag", "format": {"type": "tag", "begin": "\ud800", "content": {
        "type": "any_text"}, "end": "x"}}}, "response_format.format", "format.begin: not valid Unicode text"),
    ({"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "const_string", "value": "a\udc00"}})}}, "structured_outputs.structural_tag",
     "format.value: not valid Unicode text"),
])  # fmt: skip
def test_a_grammar_no_output_can_hold_is_refused_saying_why(server, extra, field, words):
    """A lone surrogate (sent as its JSON escape, the body valid JSON) in a schema's string or name: no output
    text holds it, and it was refused as 'invalid json: Failed to parse JSON: syntax error', though the JSON was
    valid. A NUL in a choice: refused as 'The regex must not contain null characters', though a choice is no
    regex (xgrammar's regexes and EBNF strings end at a NUL). Both are now refused naming the field, the place and
    the character."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}
    status, _, out = request(server, "/v1/chat/completions", body)  # json.dumps: the surrogate as its escape
    assert status == 400 and out["error"]["param"] == field and words in out["error"]["message"], out
    wait_idle(server)


def test_auto_is_refused_where_the_template_takes_no_tools(client, server):
    """The tiny engine's chat template takes no tools: auto (asked for, or the default with tools) is a 400 on
    tool_choice that says why (tests/test_server_tools.py serves auto on a template that takes them)."""
    import openai

    for extra in ({"tool_choice": "auto"}, {}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=4, **extra)
        body = info.value.body
        assert body["param"] == "tool_choice" and "chat template does not take tools" in body["message"], body
    wait_idle(server)


def test_logit_bias_and_allowed_ids_over_http(client):
    resp = client.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=1.0, n=4,
                                     logit_bias={"65": 100}, extra_body={"ignore_eos": True})  # fmt: skip
    assert all(c.text == "b" * 6 for c in resp.choices)  # token 65 is "b" in the tiny byte-level vocabulary
    allowed = client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=1.0, n=4,
                                        extra_body={"allowed_token_ids": [64, 65], "ignore_eos": True})  # fmt: skip
    assert all(set(c.text) <= {"a", "b"} and len(c.text) == 8 for c in allowed.choices)


@pytest.mark.parametrize("parameters", [
    {"type": "array", "items": [{"type": "integer"}]},  # draft 7's tuple items
    {"type": "integer", "minimum": 1, "exclusiveMinimum": True},  # draft 4's boolean exclusiveMinimum
    {"type": "object", "properties": {"w": {"type": "string", "pattern": "^\\p{L}+$"}}},  # ECMA, not Python's re
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [{"type": "integer"}]},
])  # fmt: skip
def test_tool_parameters_of_older_drafts_are_schemas_too(parameters):
    """What OpenAI and vLLM take as a tool's parameters is not refused by the metaschema check."""
    from trtpaged.server.tools import tool_choice

    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    assert tool_choice(tools, "none") is None
    assert tool_choice(tools, "required").tools == {"f": parameters}


def _chat_and_completion_texts(client, extra, chat_extra=None, **kw):
    """The texts of one chat and one completions request with these grammar fields, whole and streamed (the
    openai client's chunks joined), with their finish reasons."""
    out = []
    for stream_it in (False, True):
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream_it,
                                              extra_body={**extra, **(chat_extra or {})}, **kw)  # fmt: skip
        done = client.completions.create(model=MODEL, prompt="answer:", stream=stream_it, extra_body=extra, **kw)
        if not stream_it:
            out += [(c.message.content, c.finish_reason) for c in chat.choices]
            out += [(c.text, c.finish_reason) for c in done.choices]
            continue
        for chunks, text_of in ((list(chat), lambda c: c.delta.content), (list(done), lambda c: c.text)):
            joined: dict[int, list] = {}
            for chunk in chunks:
                for c in chunk.choices:
                    entry = joined.setdefault(c.index, ["", None])
                    entry[0] += text_of(c) or ""
                    entry[1] = c.finish_reason or entry[1]
            out += [tuple(v) for v in joined.values()]
    return out


def test_structural_tag_sequence_on_both_endpoints_whole_and_streamed(client, server):
    """vLLM's structural tag response format (xgrammar's {"type": "structural_tag", "format": ...}), its
    structured_outputs.structural_tag JSON text and chat's older structural_tag field: a sequence of const strings
    around a json_schema gives exactly begin + JSON its schema validates + end (json's decoder and jsonschema),
    greedy and sampled, whole and streamed, on chat and completions. Was: a 400 on each spelling."""
    before = metrics(server)
    spellings = [({"response_format": ANSWER_TAG}, None),
                 ({"structured_outputs": {"structural_tag": json.dumps(ANSWER_TAG)}}, None),
                 ({}, {"structural_tag": json.dumps(ANSWER_TAG)})]  # fmt: skip
    sampled = []
    for extra, chat_extra in spellings:
        if not extra:  # chat's own field: no completions
            chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
                                                  extra_body=chat_extra)  # fmt: skip
            outputs = [(chat.choices[0].message.content, chat.choices[0].finish_reason)]
        else:
            outputs = _chat_and_completion_texts(client, extra, max_tokens=80, temperature=0)
            samples = _chat_and_completion_texts(client, extra, max_tokens=80, temperature=1.0, n=3)
            sampled += [t for t, _ in samples]
            outputs += samples
        for text, reason in outputs:
            assert reason == "stop", text
            check_exactly_tagged(text, "<answer>", ANSWER, "</answer>")
    assert len(set(sampled)) > 6
    after = metrics(server)
    assert after["grammar_compilations_total"] <= before.get("grammar_compilations_total", 0) + 1  # one grammar
    wait_idle(server)


def test_legacy_structural_tag_opens_a_structure_at_every_trigger(client, server, tiny_engine_dir):
    """vLLM's legacy form, {"type": "structural_tag", "structures": [{begin, schema, end}], "triggers": [...]}, as
    response_format and as structured_outputs.structural_tag (JSON text, without type: vLLM tells the forms apart by
    `structures`): text is free until a trigger, which opens a structure (begin, JSON its schema validates, end).
    A logit bias makes the random model write the trigger often; every output is read left to right."""
    from transformers import AutoTokenizer

    lt = AutoTokenizer.from_pretrained(tiny_engine_dir / "tokenizer").convert_tokens_to_ids("<")
    without_type = {k: v for k, v in LEGACY_TAG.items() if k != "type"}
    counts = []
    for extra in ({"response_format": LEGACY_TAG},
                  {"structured_outputs": {"structural_tag": json.dumps(without_type)}}):
        outputs = _chat_and_completion_texts(client, extra, max_tokens=96, temperature=1.0, n=4,
                                             logit_bias={str(lt): 4})  # fmt: skip
        counts += [check_triggered(text, ["<"], STRUCTURES, reason == "length") for text, reason in outputs]
    assert len(counts) == 32 and sum(counts) >= 32 and sum(1 for c in counts if c) >= 24, counts
    wait_idle(server)


def test_structural_tag_is_a_chat_field_only(server):
    """chat's older top-level structural_tag is vLLM's ChatCompletionRequest field; completions have none (as
    vLLM's): an unknown field there, a 400 naming it."""
    status, _, body = request(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                          "structural_tag": json.dumps(ANSWER_TAG)})  # fmt: skip
    assert status == 400 and body["error"]["param"] == "structural_tag", body


def test_response_format_structural_tag_beside_a_forced_call_is_dropped(client):
    """As the other response_format kinds (vLLM's rule: the reply is the call, leaving no text to shape)."""
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "add"}})  # fmt: skip
    plain = client.chat.completions.create(**kw).choices[0].message.tool_calls
    both = client.chat.completions.create(response_format=ANSWER_TAG, **kw).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in both] == \
        [(c.function.name, c.function.arguments) for c in plain]  # fmt: skip
