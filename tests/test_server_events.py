"""A streamed text chunk from its per-choice template is byte for byte the chunk the pydantic models make."""

import json

import pytest

from trtpaged.server.responses import ResponseBuilder, sse

TEXTS = ["Hello", " world", "\n\n", 'say "hi"', "back\\slash", "tab\there", "\x00\x01\x1f\x7f", "é", "日本語",
         "🙂 emoji", "\u2028\u2029", "</script>", "{}", "data: x\n\ndata: [DONE]", " " * 40, "\ud800"]  # fmt: skip


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("model", ["bench", 'we"ird\\name\n', "\x01trtpaged-text\x01"])
def test_text_event_matches_the_models(chat, model):
    builder = ResponseBuilder("chatcmpl-abc" if chat else "cmpl-abc", model, 1764600000, chat)
    for index in (0, 1, 7):
        for text in TEXTS:
            fast = builder.event(index, text)
            assert fast == sse(builder.chunk(index, text))
            body = json.loads(fast.decode()[len("data: "):])
            got = body["choices"][0]["delta"]["content"] if chat else body["choices"][0]["text"]
            assert got == text and body["choices"][0]["index"] == index and body["model"] == model


@pytest.mark.parametrize("chat", [True, False])
def test_other_chunks_go_through_the_models(chat):
    builder = ResponseBuilder("id-1", "m", 1, chat)
    for text, finish in (("", None), (None, None), ("end", "stop"), ("", "length")):
        assert builder.event(2, text, finish) == sse(builder.chunk(2, text, finish))
