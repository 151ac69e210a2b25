"""How a chat template gets a message's content (vLLM's --chat-template-content-format): "auto" gives a template
that loops over the content's parts a list of text parts, as transformers renders such a template from OpenAI-style
messages; a string would be looped over character by character and the text dropped."""

from __future__ import annotations

import pytest

from tests.test_server import request
from trtpaged import LLM
from trtpaged.errors import RequestError
from trtpaged.runtime.content_format import template_content_format
from trtpaged.server import ServerOptions, start_server

# loops over the parts only (as many multimodal models' templates do): a string content renders as nothing
PARTS_ONLY = ("{% for message in messages %}<{{ message['role'] }}>{% for part in message['content'] %}"
              "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}</{{ message['role'] }}>"
              "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
# reads both forms
BOTH = ("{% for m in messages %}[{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}"
        "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}]{% endfor %}")
STRING = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] | trim }}]{% endfor %}"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"},
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]


@pytest.mark.parametrize("template, expected", [
    (PARTS_ONLY, "openai"),
    (BOTH, "openai"),
    (STRING, "string"),
    ("{% set content = messages[0]['content'] %}{% for p in content %}{{ p.text }}{% endfor %}", "openai"),
    ("{% set loop_messages = messages[1:] %}{% for m in loop_messages | reverse %}{% for p in m.content %}"
     "{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% set c = m.content %}{% for p in c | selectattr('type', 'equalto', 'text') %}"
     "{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for call in m.tool_calls %}{{ call.function.name }}{% endfor %}"
     "{{ m.content }}{% endfor %}", "string"),
    ("{% for content in contents %}{% for p in content %}{{ p }}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %}{{ m.content }", "string"),  # not Jinja: rendered (and refused) as before
    ("{% for m in messages %}{% generation %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endgeneration %}"
     "{% endfor %}", "openai"),  # transformers' generation blocks
    # macros given the content (GLM-4.5's visible_text), by position or keyword, through another macro; one that
    # loops over another parameter, or only prints its content, reads a string
    ("{% macro text(c) %}{% if c is string %}{{ c }}{% else %}{% for p in c %}{{ p.text }}{% endfor %}{% endif %}"
     "{% endmacro %}{% for m in messages %}{{ text(m.content) }}{% endfor %}", "openai"),
    ("{% macro text(sep, c) %}{% for p in c %}{{ p.text }}{{ sep }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ text(c=m['content'], sep=' ') }}{% endfor %}", "openai"),
    ("{% macro inner(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
     "{% macro outer(x) %}{{ inner(x) }}{% endmacro %}{% for m in messages %}{{ outer(m.content) }}{% endfor %}",
     "openai"),
    ("{% macro text(c, items) %}{{ c }}{% for i in items %}{{ i }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ text(m.content, m.tool_calls) }}{% endfor %}", "string"),
    ("{% macro text(c) %}{{ c }}{{ text(c) }}{% endmacro %}{% for m in messages %}{{ text(m.content) }}"
     "{% endfor %}", "string"),  # calls itself: read once, without looping forever
    # a namespace holding the content
    ("{% for m in messages %}{% set ns = namespace(c=m.content, n=0) %}{% for p in ns.c %}{{ p.text }}{% endfor %}"
     "{% endfor %}", "openai"),
    ("{% set ns = namespace(c='') %}{% for m in messages %}{% set ns.c = m.content %}{% endfor %}"
     "{% for p in ns.c %}{{ p.text }}{% endfor %}", "openai"),
    ("{% for m in messages %}{% set ns = namespace(c=m.content, n=[1]) %}{% for p in ns.n %}{{ p }}{% endfor %}"
     "{{ ns.c }}{% endfor %}", "string"),
    (None, "string"),
    ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "string"),  # too deep to parse here: rendering refuses it
    ("{% if a %}" * 900 + "{% endif %}" * 900, "string"),
])  # fmt: skip
def test_the_content_format_is_read_from_the_template(template, expected):
    assert template_content_format(template) == expected


def test_of_named_templates_the_one_rendered_is_read():
    """transformers renders "tool_use" for a request with tools (when there is one), else "default"."""
    named = {"default": STRING, "tool_use": PARTS_ONLY}
    assert template_content_format(named) == "string"
    assert template_content_format(named, tools=True) == "openai"
    assert template_content_format({"default": PARTS_ONLY, "rag": STRING}, tools=True) == "openai"


def test_an_empty_text_is_a_part(llm):
    """vLLM's openai form gives "" as [{"type": "text", "text": ""}]: a template reading the first part (Gemma 3's
    system message, transformers' continue_final_message) finds it."""
    first = "{% for m in messages %}{% for p in m.content %}{% endfor %}[{{ m.content[0].text }}]{% endfor %}"
    (out,) = llm.chat([{"role": "system", "content": ""}, {"role": "user", "content": "hi"}], use_tqdm=False,
                      chat_template=first)  # fmt: skip
    assert out.prompt == "[][hi]"
    (cont,) = llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], use_tqdm=False,
                       add_generation_prompt=False, continue_final_message=True)  # fmt: skip
    assert cont.prompt == "<user>hi</user><assistant>"  # was: a 400, no text to continue in the final message


@pytest.fixture(scope="module")
def llm(tiny_engine_dir):
    return LLM(tiny_engine_dir, device="cpu", backend="torch", chat_template=PARTS_ONLY)


def _transformers_render(llm, template, parts: bool) -> str:
    """The truth: transformers' own rendering of the conversation with the content in the given form."""
    messages = []
    for m in CONVERSATION:
        content = m["content"]
        texts = [p["text"] for p in content] if isinstance(content, list) else [content or ""]
        messages.append({**m, "content": [{"type": "text", "text": t} for t in texts if m["content"] is not None]
                         if parts else
                         "\n".join(texts)})  # fmt: skip
    return llm.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip


def test_a_template_that_loops_over_parts_gets_parts(llm):
    expected = _transformers_render(llm, PARTS_ONLY, parts=True)
    assert "hello there" in expected and "firstsecond" in expected
    assert llm.tokenizer.decode(llm.chat_prompt(CONVERSATION)) == expected
    (out,) = llm.chat(CONVERSATION, use_tqdm=False)
    assert out.prompt == expected
    (forced,) = llm.chat(CONVERSATION, use_tqdm=False, chat_template_content_format="string")
    assert forced.prompt == _transformers_render(llm, PARTS_ONLY, parts=False)  # what "string" drops
    assert "hello there" not in forced.prompt
    (both,) = llm.chat(CONVERSATION, use_tqdm=False, chat_template=BOTH)
    assert both.prompt == _transformers_render(llm, BOTH, parts=True)
    (plain,) = llm.chat(CONVERSATION, use_tqdm=False, chat_template=STRING)
    assert plain.prompt == _transformers_render(llm, STRING, parts=False)
    assert "[user:first\nsecond]" in plain.prompt  # the string form joins text parts by newlines, as vLLM's
    with pytest.raises(RequestError):  # too deep for the format's reading and for rendering: a refusal, not a crash
        llm.chat(CONVERSATION, use_tqdm=False, chat_template="{% if a %}" * 900 + "x" + "{% endif %}" * 900)
    with pytest.raises(RequestError, match="chat_template_content_format"):
        llm.chat(CONVERSATION, use_tqdm=False, chat_template_content_format="parts")
    with pytest.raises(ValueError, match="chat_template_content_format"):
        LLM(llm.engine_dir, device="cpu", backend="torch", chat_template_content_format="json")


@pytest.mark.parametrize("content_format", ["auto", "string"])
def test_the_server_renders_chat_and_tokenize_in_the_content_format(tiny_engine_dir, llm, content_format):
    """serve --chat-template-content-format: /tokenize counts and /v1/chat/completions' prompt_tokens are the
    template's rendering in that format."""
    expected = _transformers_render(llm, PARTS_ONLY, parts=content_format == "auto")
    want = len(llm.tokenizer.encode(expected, add_special_tokens=False))
    server = start_server(tiny_engine_dir, options=ServerOptions(), device="cpu", backend="torch",
                          chat_template=PARTS_ONLY, chat_template_content_format=content_format)  # fmt: skip
    try:
        status, _, out = request(server, "/tokenize", {"messages": CONVERSATION})
        assert status == 200 and out["count"] == want, out
        status, _, out = request(server, "/v1/chat/completions", {"messages": CONVERSATION, "max_tokens": 1})
        assert status == 200 and out["usage"]["prompt_tokens"] == want, out
    finally:
        server.shutdown()
