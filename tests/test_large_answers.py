"""The bound on an answer's log-prob entries (told from the request's fields) and the sliced JSON of a large answer."""

from __future__ import annotations

import pytest
from fastapi.responses import JSONResponse

from trtpaged.server.errors import ApiError
from trtpaged.server.large_answers import (
    MAX_LOGPROB_ENTRIES,
    check_logprob_entries,
    logprob_entries,
    logprob_entry_bound,
    render_json,
)
from trtpaged.server.protocol import parse_generation
from trtpaged.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptLogprob,
    TokenLogprob,
    TopLogprob,
    Usage,
    dump,
)


def _entries(body: dict, prompt_lens: list[int], max_tokens: int, chat: bool = False):
    req = parse_generation(body, chat, ["tiny"], 320)
    n = body.get("n", 1)
    return logprob_entries(req, n, prompt_lens, [max_tokens] * len(prompt_lens))


def test_the_red_teams_request_is_over_the_default_bound_and_named_by_its_fields():
    # 256 prompts of 500 token ids, echo, logprobs 20, prompt_logprobs 20, max_tokens 1: a 216 MB answer, 17 s of
    # a frozen event loop before the bound
    body = {"prompt": [[5] * 500] * 256, "echo": True, "logprobs": 20, "prompt_logprobs": 20, "max_tokens": 1}
    entries = _entries(body, [500] * 256, 1)
    assert entries.total == 2 * 256 * 500 * 21 + 256 * 21
    bound = logprob_entry_bound(512, 20)
    with pytest.raises(ApiError) as caught:
        check_logprob_entries(entries, bound)
    message = caught.value.message
    assert caught.value.param == "prompt_logprobs"
    assert f"could hold {entries.total} log-prob entries" in message and f"at most {bound}" in message
    for words in ("128000 prompt tokens x (prompt_logprobs 20 + 1)", "128000 echoed prompt tokens x (logprobs 20 + 1)",
                  "256 choices of up to 1 tokens (max_tokens) x (logprobs 20 + 1)"):  # fmt: skip
        assert words in message
    # the second shape: 32 prompts, n 8, 500 tokens, logprobs 20 (36 MB)
    many = _entries({"prompt": ["x"] * 32, "n": 8, "max_tokens": 500, "logprobs": 20}, [2] * 32, 500)
    assert many.total == 32 * 8 * 500 * 21 > bound and many.field == "logprobs"


def test_ordinary_requests_are_within_the_bound():
    bound = logprob_entry_bound(512, 20)
    assert bound == MAX_LOGPROB_ENTRIES
    assert _entries({"prompt": "x", "logprobs": 5, "max_tokens": 400}, [10], 400).total <= bound
    assert _entries({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 20,
                     "n": 4, "max_tokens": 2000}, [20], 2000, chat=True).total <= bound  # fmt: skip
    # one prompt of the whole context scored at the most top log-probs fits whatever the context
    for context in (512, 32768, 131072):
        scored = _entries({"prompt": [5] * 3, "prompt_logprobs": 20, "max_tokens": 1}, [context - 1], 1)
        assert scored.total <= logprob_entry_bound(context, 20)
    assert logprob_entry_bound(512, 20, given=10) == 10  # serve --max-logprob-entries


def test_chat_names_its_own_fields_and_counts_prompt_logprobs_once():
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3, "n": 2,
            "max_completion_tokens": 100, "prompt_logprobs": 1}  # fmt: skip
    entries = _entries(body, [50], 100, chat=True)
    assert entries.total == 50 * 2 + 2 * 100 * 4 and entries.field == "top_logprobs"
    assert "2 choices of up to 100 tokens (max_completion_tokens) x (top_logprobs 3 + 1)" in entries.terms
    assert _entries({"messages": body["messages"]}, [50], 100, chat=True).total == 0  # no log-probs asked for


def _completion(n_choices: int, tokens: int) -> CompletionResponse:
    choices = []
    for i in range(n_choices):
        logprobs = CompletionLogprobs(tokens=["é\"x"] * tokens, token_logprobs=[None] + [-0.5] * (tokens - 1),
                                      top_logprobs=[None] + [{"a": -0.5, "\u2028b": -1.0}] * (tokens - 1),
                                      text_offset=list(range(tokens)))  # fmt: skip
        prompt = [None] + [{"7": PromptLogprob(logprob=-1.5, rank=2, decoded_token="\"choices\":[]")}] * (tokens - 1)
        choices.append(CompletionChoice(index=i, text="\"choices\":[] ü", logprobs=logprobs, finish_reason="length",
                                        prompt_logprobs=prompt if i % 2 else None,
                                        prompt_token_ids=[1, 2] if i % 2 else None))  # fmt: skip
    return CompletionResponse(id='cmpl-"choices":[]', created=1, model="tiny", choices=choices,
                              usage=Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7))  # fmt: skip


def _chat(n_choices: int, tokens: int, prompt_positions: int) -> ChatCompletionResponse:
    top = [TopLogprob(token="ö", logprob=-0.25, bytes=[195, 182])] * 3
    content = [TokenLogprob(token="ö", logprob=-0.25, bytes=[195, 182], top_logprobs=top)] * tokens
    choices = [ChatChoice(index=i, message=AssistantMessage(content="\"prompt_logprobs\":[]"),
                          logprobs=ChatLogprobs(content=content), finish_reason="stop") for i in range(n_choices)]
    prompt = [None] + [{"3": PromptLogprob(logprob=-2.0, rank=1, decoded_token="x")}] * (prompt_positions - 1)
    return ChatCompletionResponse(id="chatcmpl-1", created=1, model="tiny", choices=choices,
                                  usage=Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7),
                                  prompt_logprobs=prompt if prompt_positions else None)  # fmt: skip


@pytest.mark.parametrize("body", [_completion(0, 1), _completion(3, 40), _chat(2, 30, 0), _chat(2, 30, 700),
                                  _chat(1, 2, 1)], ids=["no choices", "completions", "chat", "chat prompt_logprobs",
                                                        "chat one prompt position"])  # fmt: skip
def test_a_large_answer_is_written_as_json_response_writes_it(body):
    assert render_json(body) == JSONResponse(dump(body)).body
