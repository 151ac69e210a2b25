"""Tool-call parsers against hand-written model outputs in each format, as the formats' own documentation and chat
templates write them (hermes: Qwen2.5 / Hermes `<tool_call>` blocks; llama3_json: Llama 3.1's JSON calls after
`<|python_tag|>`; mistral: `[TOOL_CALLS]` + a JSON array; phi4_mini: `functools[...]`; pythonic: a Python list
of calls, as vLLM's Llama 3.2 and Gemma 3 pythonic templates ask for), malformed ones included;
fed whole and in pieces of every size, the streamed events join to the whole-text answer. Then which format an
engine's chat template and architecture select."""

from __future__ import annotations

import json

import pytest

from trtpaged.server.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PHI4_MINI,
    PYTHONIC,
    REQUIRED,
    ArgsPiece,
    CallStart,
    Content,
    ToolCallStream,
    call_stream,
    parse_all,
)
from trtpaged.server.tools import tool_format
from trtpaged.models.tiny_tokenizer import CHAT_TEMPLATE as TINY_TEMPLATE

TOOLS = {"get_weather", "add"}

# (format, model output, expected content, expected [(name, arguments as JSON value)])
WELL_FORMED = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    (HERMES, 'Let me check both.\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
             '<tool_call>\n{"arguments": {"city": "Rome, \\"IT\\" {x}"}, "name": "get_weather"}\n</tool_call>',
     "Let me check both.", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": 'Rome, "IT" {x}'})]),
    (HERMES, '<tool_call>{"name": "add", "arguments": {}}</tool_call>', None, [("add", {})]),
    (HERMES, 'Sure. <tool_call>{"name": "add"}</tool_call> Done. <tool_call>{"name": "add"}</tool_call>\nBye',
     "Sure.", [("add", {}), ("add", {})]),  # text between and after calls: no content (vLLM's)
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": [1, {"b": null}]}}', None,  # unclosed: accepted
     [("add", {"a": [1, {"b": None}]})]),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}; {"name": "get_weather", '
                  '"arguments": {"city": "Rome"}}', None,
     [("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Rome"})]),
    (LLAMA3_JSON, '  {"name": "add"}', None, [("add", {})]),
    (MISTRAL, '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", '
              '"arguments": {"city": "Paris"}}]', None,
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Paris"})]),
    (MISTRAL, 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 0.5e1}}]', "Sure.", [("add", {"a": 5.0})]),
    (PHI4_MINI, 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", {"city": "Paris"})]),
    (REQUIRED, '[{"name":"add","parameters":{"a":1,"b":2}},{"name":"get_weather","parameters":{"city":"Rome"}}]',
     None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]),
    (PYTHONIC, '[get_weather(city="Paris"), add(a=2, b=-40)]', None,
     [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": -40})]),
    (PYTHONIC, "\n [ add(a=1.5, b=[1, (2, 3)]) ,get_weather(city='it\\'s \"(x)\" ]', extra={'k': None})]\n", None,
     [("add", {"a": 1.5, "b": [1, [2, 3]]}), ("get_weather", {"city": 'it\'s "(x)" ]', "extra": {"k": None}})]),
    (PYTHONIC, "[add(a='''two\nlines''', b=True), add(a=true, b=null)] Done.", None,  # after calls: no content
     [("add", {"a": "two\nlines", "b": True}), ("add", {"a": True, "b": None})]),
    (PYTHONIC, "[add()]", None, [("add", {})]),
]  # fmt: skip

# Outputs that are not (only) calls in their format: the whole text is content, unless a call went out before the
# text failed (a stream sent it): then that call stands, its arguments as far as they were written.
MALFORMED = [
    (HERMES, "It is sunny in Paris today."),
    (HERMES, 'a < b and <tool_ call>'),
    (HERMES, '<tool_call>\n{"name": "fly", "arguments": {}}\n</tool_call>'),  # not one of the tools
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1,, }}\n</tool_call>'),  # arguments not JSON
    (HERMES, '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'),  # arguments a string
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1'),  # cut off
    (HERMES, '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'),  # no name
    (HERMES, 'Wait <tool_call>\n{"na'),  # cut off before the name
    (HERMES, '<tool_call>\nadd(a=1)\n</tool_call>'),
    (LLAMA3_JSON, 'Here: {"name": "add", "parameters": {"a": 1}}'),  # calls only at the start
    (LLAMA3_JSON, '{"name": "add", "parameters": {"a": 1}} and more words'),
    (LLAMA3_JSON, '{"answer": 42}'),
    (MISTRAL, '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, oops]'),
    (PHI4_MINI, 'functools{"name": "add", "arguments": {}}'),
    (REQUIRED, '[{"name":"add","parameters":{"a":1'),
    (PYTHONIC, "I will call add(a=1, b=2)."),  # calls only as the output's list
    (PYTHONIC, "[add(1, 2)]"),  # positional arguments
    (PYTHONIC, "[fly(a=1)]"),  # not one of the tools
    (PYTHONIC, "[add(a=float('nan'))]"),  # not a literal
    (PYTHONIC, "[add(a=1, b=2)"),  # cut off
    (PYTHONIC, "[add(a='one\nline')]"),  # a one-quote string across lines
    (PYTHONIC, "[add(a=1)) ]"),
    (PYTHONIC, "[1, 2, 3]"),
    (PYTHONIC, "[] x"),  # a list of no calls (was: streamed as " x", the list dropped)
    (PYTHONIC, "[add (a=1)]"),  # vLLM's regex: the '(' right after the name (was: a call when streamed, else text)
]  # fmt: skip


def _stream(fmt, text, size, named=None):
    """Events of feeding `text` in pieces of `size` characters, then the end."""
    reader = call_stream(fmt, TOOLS, named)
    events = []
    for i in range(0, len(text), size):
        events += reader.feed(text[i : i + size])
    return reader, events + reader.finish()


def _joined(events):
    content = "".join(e.text for e in events if isinstance(e, Content))
    starts = [e for e in events if isinstance(e, CallStart)]
    args = {e.index: "" for e in starts}
    for e in events:
        if isinstance(e, ArgsPiece):
            args[e.index] += e.text
    return content, [(s.name, args[s.index]) for s in starts]


@pytest.mark.parametrize("fmt, text, content, calls", WELL_FORMED)
def test_well_formed_calls(fmt, text, content, calls):
    got_content, got, ok = parse_all(fmt, TOOLS, text)
    assert got_content == content and ok
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)
    # the model's own JSON text (a Python call's arguments are written as JSON here)
    assert all(c.arguments in text for c in got if c.arguments != "{}" and not fmt.python)
    for size in range(1, len(text) + 1):
        reader, events = _stream(fmt, text, size)
        assert reader.ok, size
        assert _joined(events) == (content or "", [(c.name, c.arguments) for c in got]), size


def test_arguments_stream_as_they_are_written():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    reader = ToolCallStream(HERMES, TOOLS)
    seen = []
    for ch in text:
        seen.append(reader.feed(ch))
    start = next(i for i, ev in enumerate(seen) if any(isinstance(e, CallStart) for e in ev))
    assert text[: start + 1].endswith('"add"')  # the call starts as soon as its name is read
    pieces = [e.text for ev in seen for e in ev if isinstance(e, ArgsPiece)]
    assert len(pieces) == len('{"a": 1, "b": 2}') and "".join(pieces) == '{"a": 1, "b": 2}'


@pytest.mark.parametrize("fmt, text", MALFORMED)
def test_malformed_outputs_read_whole_as_their_stream(fmt, text):
    """The whole answer is the stream's events joined, at any piece size (was: the whole text as content, no call,
    beside a stream that had sent a call); with no call, all of it is content."""
    content, calls, ok = parse_all(fmt, TOOLS, text)
    assert not ok and (calls or content == text)
    for size in (1, 2, 7, len(text)):
        reader, events = _stream(fmt, text, size)
        assert not reader.ok
        assert _joined(events) == (content or "", [(c.name, c.arguments) for c in calls]), size


def test_streamed_text_before_a_marker_is_held_only_while_it_may_start_one():
    reader = ToolCallStream(HERMES, TOOLS)
    assert reader.feed("Hi <tool") == [Content("Hi")]  # " <tool" may open a call
    assert reader.feed("kit") == [Content(" <toolkit")]
    assert reader.finish() == []


def test_named_function_arguments_stream():
    reader, events = _stream(None, '{"a":1,"b":2}', 3, named="add")
    assert reader.ok and _joined(events) == ("", [("add", '{"a":1,"b":2}')])
    content, calls, ok = parse_all(None, TOOLS, '{"a":1', named="add")  # cut: the call as far as it was written
    assert (content, [(c.name, c.arguments) for c in calls], ok) == (None, [("add", '{"a":1')], False)


HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Return calls as <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)
LLAMA31_TEMPLATE = (  # the parts of Llama 3.1's template that matter here
    "{%- if tools is not none %}{%- set tools_in_user_message = true %}{% endif %}<|start_header_id|>system"
    "<|end_header_id|>\n\n{%- if builtin_tools is defined %}Environment: ipython{% endif %}"
    "{%- for tool_call in message.tool_calls %}<|python_tag|>{{- '{\"name\": \"' + tool_call.name + '\", ' }}"
    "{{- '\"parameters\": ' }}{% endfor %}"
)
LLAMA32_TEMPLATE = (
    "{%- if tools is not none %}Given the following functions, respond with a JSON for a function call with its "
    "proper arguments.Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name "
    "and its value}.{% endif %}<|start_header_id|>user<|end_header_id|>"
)
MISTRAL_TEMPLATE = "{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS] "
SMOLLM2_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']}}"
                    "{% endfor %}")


@pytest.mark.parametrize("template, architecture, expected", [
    (HERMES_TEMPLATE, "Qwen2ForCausalLM", "hermes"),
    (HERMES_TEMPLATE, "LlamaForCausalLM", "hermes"),  # the template decides
    (LLAMA31_TEMPLATE, "LlamaForCausalLM", "llama3_json"),
    (LLAMA32_TEMPLATE, "LlamaForCausalLM", "llama3_json"),
    (MISTRAL_TEMPLATE, "MistralForCausalLM", "mistral"),
    ("{% if tools %}Write [func_name1(params_name1=params_value1), func_name2(params)]: {{ tools }}{% endif %}",
     "Gemma3ForCausalLM", "pythonic"),  # vLLM's Gemma 3 / Llama 3.2 pythonic templates
    ("{% if tools %}{{ tools }}{% endif %}", "Phi3ForCausalLM", "phi4_mini"),  # no marker: the family's format
    ("{% if tools %}{{ tools }}{% endif %}", "SmolLM3ForCausalLM", "hermes"),
    ({"default": SMOLLM2_TEMPLATE, "tool_use": HERMES_TEMPLATE}, "LlamaForCausalLM", "hermes"),
])  # fmt: skip
def test_format_from_template_and_family(template, architecture, expected):
    assert tool_format(template, architecture).format.name == expected


@pytest.mark.parametrize("template, architecture, reason", [
    (SMOLLM2_TEMPLATE, "LlamaForCausalLM", "does not take tools"),
    (TINY_TEMPLATE, "LlamaForCausalLM", "does not take tools"),
    ("{{ 'tools are nice' }}{% for m in messages %}{{ m.content }}{% endfor %}", "LlamaForCausalLM", "does not take"),
    (None, "LlamaForCausalLM", "no chat template"),
    ("{% if tools %}{{ tools }}{% endif %}", "Gemma2ForCausalLM", "no tool-call parser"),
])  # fmt: skip
def test_no_format_says_why(template, architecture, reason):
    auto = tool_format(template, architecture)
    assert auto.format is None and reason in auto.reason


def test_arguments_with_nan_or_infinity_are_not_json():
    """Python's json reads NaN and Infinity, which JSON (RFC 8259) has not (was: a complete call)."""
    for value in ("NaN", "Infinity", "-Infinity"):
        text = '<tool_call>\n{"name": "add", "arguments": {"a": %s, "b": 1}}\n</tool_call>' % value
        assert not parse_all(HERMES, TOOLS, text)[2]
