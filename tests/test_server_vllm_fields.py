"""vLLM's request fields a vLLM user of `trtpaged serve` sends, through a real server and the official `openai`
client, checked against `LLM` on the same engine: stream_options.continuous_usage_stats, truncate_prompt_tokens,
return_tokens_as_token_ids, and chat logprobs' `bytes` (the token's own bytes, as OpenAI sends them)."""

from __future__ import annotations

import json

import pytest

from tests.test_server import llm as llm, request, wait_idle  # a fixture: LLM on the same engine, the truth
from tests.test_server_scoring import MODEL, client as client, server as server  # fixtures, one server per module
from trtpaged import SamplingParams

MESSAGES = [{"role": "user", "content": "hello"}]
TEXT = "The quick brown fox jumps over the lazy dog"


def _usage(chunk) -> tuple[int, int, int]:
    return chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(client, llm, server):
    """Every chunk (the chat role chunks too) carries its choice's prompt and the tokens that choice generated so
    far, counted here from the chunks' log-prob entries; the closing chunk the request's totals."""
    prompt_len = len(llm.chat_prompt(MESSAGES))
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=7, temperature=1.0, seed=3, n=2, logprobs=True, top_logprobs=0,
        stream=True, stream_options={"continuous_usage_stats": True}, extra_body={"ignore_eos": True}))  # fmt: skip
    counted = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        counted[choice.index] += len(choice.logprobs.content) if choice.logprobs else 0
        assert _usage(chunk) == (prompt_len, counted[choice.index], prompt_len + counted[choice.index])
    assert counted == {0: 7, 1: 7}
    assert chunks[-1].choices == [] and _usage(chunks[-1]) == (prompt_len, 14, prompt_len + 14)

    prompts = ["once upon", "a much longer prompt than the first"]
    lens = [len(llm.tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, temperature=0, logprobs=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counted = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        counted[choice.index] += len(choice.logprobs.tokens)
        p = lens[choice.index]
        assert _usage(chunk) == (p, counted[choice.index], p + counted[choice.index])
    assert counted == {0: 5, 1: 5} and _usage(chunks[-1]) == (sum(lens), 10, sum(lens) + 10)

    plain = list(client.completions.create(model=MODEL, prompt="once upon", max_tokens=4, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))  # fmt: skip
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 4
    wait_idle(server)


def test_truncate_prompt_tokens_keeps_the_last_k(client, llm):
    """The completion of the prompt's last k tokens (text, token ids or a chat's templated prompt), or its first k
    with truncation_side "right", and usage counts k; echo shows the kept part; -1 (max_seq_len) and a k past the
    prompt keep it whole. priority 0 (vLLM's default) is accepted."""
    ids = llm.tokenizer.encode(TEXT, add_special_tokens=False)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    kept = llm.generate([ids[-10:]], greedy)[0].outputs[0].text
    whole = llm.generate([ids], greedy)[0].outputs[0].text
    assert kept != whole  # the cut changes the answer
    for prompt in (TEXT, ids):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={"truncate_prompt_tokens": 10})  # fmt: skip
        assert resp.choices[0].text == kept and resp.usage.prompt_tokens == 10
    first = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 10, "truncation_side": "right"})
    assert first.choices[0].text == llm.generate([ids[:10]], greedy)[0].outputs[0].text != kept
    echoed = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=0, echo=True,
                                       extra_body={"truncate_prompt_tokens": 10})  # fmt: skip
    assert echoed.choices[0].text == llm.tokenizer.decode(ids[-10:]) + kept
    for k in (-1, len(ids), 500):
        resp = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=0,
                                         extra_body={"truncate_prompt_tokens": k})  # fmt: skip
        assert resp.choices[0].text == whole and resp.usage.prompt_tokens == len(ids)

    full = llm.chat_prompt(MESSAGES)
    truth = llm.generate([full[-12:]], greedy)[0].outputs[0].text
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 12, "priority": 0})  # fmt: skip
    assert chat.choices[0].message.content == truth and chat.usage.prompt_tokens == 12


def test_truncate_prompt_tokens_minus_1_fits_a_long_prompt_beside_its_output(client, llm, server):
    """-1 keeps as many of the prompt's last tokens as max_seq_len leaves beside max_tokens (vLLM's max_model_len -
    max_tokens; unset max_tokens: the one token it needs), so a prompt longer than the context is answered; a k that
    leaves no room for max_tokens is a 400 on truncate_prompt_tokens naming the limit, as in vLLM."""
    limit = llm.config.max_seq_len
    ids = llm.tokenizer.encode("abcdefghij" * (limit // 10 + 10), add_special_tokens=False)
    assert len(ids) > limit
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                     extra_body={"truncate_prompt_tokens": -1, "ignore_eos": True})  # fmt: skip
    assert resp.usage.prompt_tokens == limit - 6
    assert resp.choices[0].text == llm.generate([ids[-(limit - 6):]], greedy)[0].outputs[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ab" * limit}],
                                          extra_body={"truncate_prompt_tokens": -1})  # fmt: skip
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (limit - 1, 1)
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=6, extra_body={"truncate_prompt_tokens": limit})
    error = bad.value.body
    assert error["param"] == "truncate_prompt_tokens" and f"at most {limit - 6}" in error["message"], error
    wait_idle(server)


def test_completions_max_tokens_absent_is_16_and_null_is_the_room_left(llm, server):
    """OpenAI's completions default of 16 applies when max_tokens is absent; an explicit null asks for what
    max_seq_len leaves after the prompt (vLLM's rule; was: 16 as well)."""
    limit = llm.config.max_seq_len
    ids = llm.tokenizer.encode("abcdefghij" * limit, add_special_tokens=False)[: limit - 20]
    for body, count in (({}, 16), ({"max_tokens": None}, 20)):
        status, _, out = request(server, "/v1/completions", {"model": MODEL, "prompt": ids, "temperature": 0,
                                                             "ignore_eos": True, **body})  # fmt: skip
        assert status == 200 and out["usage"]["completion_tokens"] == count, (body, out)
        assert out["choices"][0]["finish_reason"] == "length"
    wait_idle(server)


def test_return_tokens_as_token_ids(client, llm):
    """Tokens and top log-prob keys are "token_id:<id>" (the ids LLM.generate samples), log-probs, text offsets and
    chat bytes as without the field."""
    truth = llm.generate(["once upon"], SamplingParams(max_tokens=5, temperature=0.0, logprobs=2))[0].outputs[0]
    req = dict(model=MODEL, prompt="once upon", max_tokens=5, temperature=0, logprobs=2)
    named = client.completions.create(**req, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    plain = client.completions.create(**req).choices[0].logprobs
    assert named.tokens == [f"token_id:{t}" for t in truth.token_ids]
    assert [set(top) for top in named.top_logprobs] == [{f"token_id:{t}" for t in e} for e in truth.logprobs]
    for top, entry in zip(named.top_logprobs, truth.logprobs):
        assert all(abs(top[f"token_id:{t}"] - lp) < 1e-4 for t, lp in entry.items())
    assert named.token_logprobs == plain.token_logprobs and named.text_offset == plain.text_offset

    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    truth = llm.chat(MESSAGES, SamplingParams(max_tokens=5, temperature=0.0, logprobs=2))[0].outputs[0]
    named = client.chat.completions.create(**chat, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    plain = client.chat.completions.create(**chat).choices[0]
    assert [e.token for e in named.logprobs.content] == [f"token_id:{t}" for t in truth.token_ids]
    for e, p in zip(named.logprobs.content, plain.logprobs.content):
        assert all(t.token.startswith("token_id:") for t in e.top_logprobs)
        assert (e.logprob, e.bytes, [t.bytes for t in e.top_logprobs]) == (p.logprob, p.bytes,
                                                                            [t.bytes for t in p.top_logprobs])


def test_chat_echo_puts_the_last_message_before_an_answer_of_its_role(client, llm):
    """vLLM's chat `echo`: continuing an assistant message, the answer starts with that message's text, whole and
    streamed (a first content chunk); after a user message (the answer is the assistant's) nothing is put before."""
    continued = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Sure, "}]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    for messages, options, echoed in ((continued, {"add_generation_prompt": False, "continue_final_message": True},
                                       "Sure, "), (MESSAGES, {}, "")):  # fmt: skip
        truth = llm.chat(messages, greedy, **options)[0].outputs[0].text
        req = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"echo": True, **options})
        assert client.chat.completions.create(**req).choices[0].message.content == echoed + truth
        chunks = [c for c in client.chat.completions.create(**req, stream=True) if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == echoed + truth
        if echoed:
            assert chunks[1].choices[0].delta.content == echoed


def test_chat_logprobs_bytes_are_each_tokens_own_bytes(client, server):
    """A character split over several byte-level tokens (é, an emoji, CJK: 2-4 one-byte tokens each): each token's
    bytes are its own (OpenAI's form), so that all of them joined are the answer's UTF-8, whole and streamed; a
    free (random-model) answer's bytes decode to its text."""
    pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install xgrammar)")
    answer = "héllo 😀 世界"
    req = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=1.0, logprobs=True, top_logprobs=3,
               extra_body={"guided_choice": [answer]})  # fmt: skip
    choice = client.chat.completions.create(**req).choices[0]
    assert choice.message.content == answer
    *entries, end = choice.logprobs.content  # the grammar's end: the EOS token, which is not text
    assert end.token == "<|eos|>" and bytes(end.bytes) == b"<|eos|>"
    assert b"".join(bytes(e.bytes) for e in entries) == answer.encode("utf-8")
    assert len(entries) == len(answer.encode("utf-8"))  # the tiny tokenizer: one token per byte
    tops = [t for e in entries for t in e.top_logprobs if t.token and not t.token.startswith("<|")]  # byte tokens
    assert tops and all(len(t.bytes) == 1 for t in tops)
    streamed = client.chat.completions.create(**req, stream=True)
    joined = b"".join(bytes(e.bytes) for c in streamed for ch in c.choices if ch.logprobs for e in ch.logprobs.content)
    assert joined == answer.encode("utf-8") + b"<|eos|>"

    free = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                          logprobs=True, extra_body={"ignore_eos": True}).choices[0]  # fmt: skip
    raw = b"".join(bytes(e.bytes) for e in free.logprobs.content)
    # the text ends before a character the 24 bytes end inside of (vLLM's rule)
    assert len(raw) == 24 and raw.decode("utf-8", errors="replace").rstrip("\ufffd") == free.message.content
    wait_idle(server)


def _joined_ids(chunks) -> tuple[dict[int, list[int]], dict[int, list]]:
    """Per choice: its token ids joined from a stream's chunks; the prompt token ids its chunks carried."""
    ids: dict[int, list[int]] = {}
    prompts: dict[int, list] = {}
    for chunk in chunks:
        for c in chunk.choices:
            ids.setdefault(c.index, []).extend(c.model_extra.get("token_ids") or [])
            prompt = chunk.model_extra.get("prompt_token_ids") or c.model_extra.get("prompt_token_ids")
            if prompt is not None:
                prompts.setdefault(c.index, []).append(prompt)
    return ids, prompts


def test_return_token_ids_whole_and_streamed(client, llm):
    """The prompt's token ids (per choice on completions, on the response for chat) and each choice's generated
    ids, equal to LLM's; streamed: the prompt's with each choice's first chunk only, each chunk its new ids.
    Without the field no body carries them."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = llm.tokenizer.encode(TEXT, add_special_tokens=False)
    prompts = ["once upon", ids]
    truth = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    prompt_ids = [llm.tokenizer.encode("once upon", add_special_tokens=False), ids]
    req = dict(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    asked = {"ignore_eos": True, "return_token_ids": True}
    whole = client.completions.create(**req, extra_body=asked)
    assert [(c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]) for c in whole.choices] == list(
        zip(prompt_ids, truth))
    joined, sent = _joined_ids(client.completions.create(**req, extra_body=asked, stream=True))
    assert joined == {0: truth[0], 1: truth[1]} and sent == {0: [prompt_ids[0]], 1: [prompt_ids[1]]}
    plain = client.completions.create(**req, extra_body={"ignore_eos": True}).choices
    assert all("token_ids" not in c.model_extra and "prompt_token_ids" not in c.model_extra for c in plain)

    chat_truth = llm.chat(MESSAGES, greedy)[0].outputs[0].token_ids
    req = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
               extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    whole = client.chat.completions.create(**req)
    assert whole.model_extra["prompt_token_ids"] == llm.chat_prompt(MESSAGES)
    assert whole.choices[0].model_extra["token_ids"] == chat_truth
    joined, sent = _joined_ids(client.chat.completions.create(**req, stream=True))
    assert joined == {0: chat_truth} and sent == {0: [llm.chat_prompt(MESSAGES)]}


def test_a_requests_stream_interval_raises_the_servers(client):
    """vLLM's per-request stream_interval on a server at interval 1: the first token at once, then 3 tokens a chunk,
    the rest with the finish reason; the tokens and text are the whole answer's. A non-streamed request ignores it."""
    req = dict(model=MODEL, prompt="once upon", max_tokens=11, temperature=0, logprobs=0)
    whole = client.completions.create(**req, extra_body={"ignore_eos": True, "stream_interval": 3}).choices[0]
    chunks = list(client.completions.create(**req, stream=True, extra_body={"ignore_eos": True, "stream_interval": 3}))
    sizes = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs]
    assert sizes == [1, 3, 3, 3, 1]
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == whole.logprobs.tokens


def test_spaces_between_special_tokens_is_taken_on_both_endpoints(client, llm):
    """vLLM's field (was: 400 unknown field): taken and checked, with the answer the Python API gives with it."""
    truth = llm.generate(["once upon"],
                         SamplingParams(max_tokens=6, temperature=0, spaces_between_special_tokens=False))
    extra = {"spaces_between_special_tokens": False}
    got = client.completions.create(model=MODEL, prompt="once upon", max_tokens=6, temperature=0, extra_body=extra)
    assert got.choices[0].text == truth[0].outputs[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, extra_body=extra)  # fmt: skip
    assert chat.choices[0].message.content is not None
    import openai

    with pytest.raises(openai.BadRequestError, match="spaces_between_special_tokens"):
        client.completions.create(model=MODEL, prompt="a", max_tokens=1,
                                  extra_body={"spaces_between_special_tokens": 1})


def test_tokenize_counts_what_the_generation_endpoints_count(client, llm, server):
    """/tokenize of a prompt is the tokenizer's ids (and the `usage.prompt_tokens` /v1/completions reports for it);
    of messages, the chat template's ids (what /v1/chat/completions counts, with tools and chat options too);
    /detokenize gives the tokenizer's text back."""
    tok = llm.tokenizer
    status, _, out = request(server, "/tokenize", {"model": MODEL, "prompt": TEXT, "return_token_strs": True})
    assert status == 200, out
    assert out["tokens"] == tok.encode(TEXT) and out["count"] == len(out["tokens"])
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
    assert out["max_model_len"] == llm.config.max_seq_len
    done = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1)
    assert done.usage.prompt_tokens == out["count"]
    plain = request(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})[2]
    assert plain["tokens"] == tok.encode(TEXT, add_special_tokens=False) and plain["token_strs"] is None

    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]  # fmt: skip
    out = request(server, "/tokenize", {"messages": conversation})[2]
    assert out["tokens"] == llm.chat_prompt([conversation[0], {"role": "user", "content": "hello\nthere"}])
    done = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=1)
    assert done.usage.prompt_tokens == out["count"]
    prefill = [*conversation, {"role": "assistant", "content": "Sure"}]
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    out = request(server, "/tokenize", body)[2]
    text = tok.apply_chat_template(llm_messages(prefill), add_generation_prompt=False, continue_final_message=True,
                                   tokenize=False)  # fmt: skip
    assert out["tokens"] == tok.encode(text, add_special_tokens=False)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
    out = request(server, "/tokenize", {"messages": conversation, "tools": tools})[2]
    done = client.chat.completions.create(model=MODEL, messages=conversation, tools=tools, tool_choice="required",
                                          max_tokens=1)  # fmt: skip
    assert done.usage.prompt_tokens == out["count"]

    ids = tok.encode(TEXT) + [tok.eos_token_id]
    out = request(server, "/detokenize", {"model": MODEL, "tokens": ids})[2]
    assert out == {"prompt": tok.decode(ids, skip_special_tokens=False)}
    assert request(server, "/tokenize", {"model": "other", "prompt": "x"})[0] == 404
    wait_idle(server)


@pytest.mark.parametrize("path", ["/tokenize", "/invocations"])
def test_a_route_of_either_form_names_both_fields_when_it_gets_both_or_neither(server, path):
    """vLLM's /tokenize (and SageMaker's /invocations) take a completions body or a chat body: one with both a
    prompt and messages, or neither, is a 400 naming both and asking for one (was, on /tokenize: "prompt: unknown
    field", as if messages were the only form; with neither "prompt: Field required")."""
    prompt, messages = {"prompt": TEXT}, {"messages": MESSAGES}
    for body, got in (({**prompt, **messages}, "both"), ({"model": MODEL}, "neither")):
        status, _, out = request(server, path, body)
        assert status == 400 and out["error"]["param"] == "body", out
        assert out["error"]["message"] == (f"body: {path} takes a completions body (prompt) or a chat body (messages), "
                                           f"got {got}; send one of them")  # fmt: skip
    for body in (prompt, messages):  # each form alone is answered
        assert request(server, path, {**body, **({"max_tokens": 1} if path == "/invocations" else {})})[0] == 200
    wait_idle(server)


def llm_messages(conversation: list[dict]) -> list[dict]:
    """The conversation as the chat template sees it: text parts joined as lines."""
    return [{**m, "content": "\n".join(p["text"] for p in m["content"]) if isinstance(m["content"], list)
             else m["content"]} for m in conversation]  # fmt: skip


def test_a_request_past_the_context_says_so_as_openai_and_vllm_do(client, llm, server):
    """A prompt that leaves no room for an output, a max_tokens past the room left, and a text too long by its
    length alone are 400s with OpenAI's code `context_length_exceeded` and its sentence "This model's maximum
    context length is N tokens", which client libraries look for (LiteLLM's ContextWindowExceededError); the
    counts are the prompt's own (the tokenizer's, through LLM)."""
    openai = pytest.importorskip("openai")
    limit = llm.config.max_seq_len
    too_long = [5] * limit
    short = "hello there"
    short_len = len(llm.tokenizer.encode(short, add_special_tokens=False))
    chat_text = "ab " * limit
    chat_len = len(llm.chat_prompt([{"role": "user", "content": chat_text}]))
    cases = [
        (lambda: client.completions.create(model=MODEL, prompt=too_long, max_tokens=1), "prompt", limit),
        (lambda: client.completions.create(model=MODEL, prompt=short, max_tokens=limit), "max_tokens", short_len),
        (lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": chat_text}],
                                                max_tokens=1), "messages", chat_len),
    ]  # fmt: skip
    for send, param, tokens in cases:
        with pytest.raises(openai.BadRequestError) as err:
            send()
        body = err.value.body
        assert (body["param"], body["code"]) == (param, "context_length_exceeded"), body
        assert f"This model's maximum context length is {limit} tokens. However, your request has {tokens} input " \
            "tokens" in body["message"], body  # fmt: skip
    with pytest.raises(openai.BadRequestError) as err:  # refused by its length alone: at least that many
        client.completions.create(model=MODEL, prompt="x" * (16 * limit), max_tokens=1)
    assert err.value.body["code"] == "context_length_exceeded"
    assert f"This model's maximum context length is {limit} tokens" in err.value.body["message"]
    wait_idle(server)


def test_chat_top_logprobs_0_without_logprobs_asks_for_none(client, server):
    """Clients that always send top_logprobs: 0 (its default) get the plain answer, as vLLM gives it; a positive
    top_logprobs without logprobs is still refused."""
    openai = pytest.importorskip("openai")
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
    plain = client.chat.completions.create(**kw)
    zero = client.chat.completions.create(top_logprobs=0, **kw)
    assert zero.choices[0].message.content == plain.choices[0].message.content and zero.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(top_logprobs=1, **kw)
    assert err.value.body["param"] == "top_logprobs"
    wait_idle(server)


def test_vllms_plumbing_fields_are_taken_when_they_ask_nothing_and_refused_naming_why(client, server):
    """What vLLM clients and routers send along: a guided-decoding backend by name (the grammar is the same; xgrammar
    runs it), null or empty logits processors, KV-transfer and multimodal options; set to something, each is a 400
    naming the field and what this server lacks, as is a request's own chat template (vLLM's default too)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for backend in ("outlines", "xgrammar", "lm-format-enforcer"):
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
                                             extra_body={"guided_json": schema, "guided_decoding_backend": backend,
                                                         "kv_transfer_params": None, "vllm_xargs": {},
                                                         "logits_processors": [], "mm_processor_kwargs": {}})
        assert isinstance(json.loads(out.choices[0].message.content)["n"], int)
    for field, value, words in (("chat_template", "{{ messages }}", "--trust-request-chat-template"),
                                ("logits_processors", ["my.module:Proc"], "no custom logits processors"),
                                ("kv_transfer_params", {"do_remote_prefill": True}, "disaggregated prefill"),
                                ("vllm_xargs", {"k": 1}, "no custom logits processors"),
                                ("mm_processor_kwargs", {"fps": 2}, "read text only"),
                                ("guided_whitespace_pattern", " ", "own whitespace rule")):  # fmt: skip
        status, _, body = request(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                                   "max_tokens": 2, field: value})
        assert status == 400 and body["error"]["param"] == field and words in body["error"]["message"], body
    # vLLM's prompt embeddings (base64 tensors) on completions: was "unknown field"
    status, _, body = request(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                          "prompt_embeds": "AAAA"})  # fmt: skip
    assert status == 400 and body["error"]["param"] == "prompt_embeds", body
    assert "reads token ids (its embedding table is inside the compiled graph)" in body["error"]["message"], body
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                    extra_body={"prompt_embeds": None, "ignore_eos": True})
    assert out.usage.completion_tokens == 2
    wait_idle(server)


def test_structured_outputs_options_are_checked_beside_its_grammar(server):
    """vLLM's options in structured_outputs reach the grammar's own checks (were dropped unread: a whitespace_pattern,
    refused as guided_whitespace_pattern, ran without it, and disable_any_whitespace: "yes" was taken), and an unknown
    key's refusal lists them beside the grammar keys; true or false they change nothing, as documented: the answer is
    the one without them."""
    def ask(**options):
        return request(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 12,
                                                        "temperature": 0, "structured_outputs": {
                                                            "json": {"type": "object"}, **options}})  # fmt: skip

    for options, words in (({"whitespace_pattern": " "}, "whitespace_pattern: not supported"),
                           ({"disable_any_whitespace": "yes"}, "disable_any_whitespace: must be true or false"),
                           ({"disable_fallback": 1}, "disable_fallback: must be true or false"),
                           ({"backend": "x"}, "unknown keys ['backend'] (use one of json, regex, choice, grammar, "
                            "json_object, structural_tag; options beside it: disable_fallback, disable_any_whitespace, "
                            "disable_additional_properties, whitespace_pattern)")):  # fmt: skip
        status, _, body = ask(**options)
        assert status == 400 and body["error"]["param"].startswith("structured_outputs"), body
        assert words in body["error"]["message"], body
    plain = ask()
    assert plain[0] == 200, plain
    flags = ask(disable_any_whitespace=True, disable_fallback=False, disable_additional_properties=True)
    assert flags[0] == 200 and flags[2]["choices"][0]["message"] == plain[2]["choices"][0]["message"], flags
    wait_idle(server)


# a retrieval-augmented template (as Command R's and Granite's read `documents`) over the tiny engine's own
RAG_TEMPLATE = ("{% for d in documents or [] %}<|bos|>document {{ d.title }}\n{{ d.text }}<|eos|>\n{% endfor %}"
                "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


def test_documents_reach_the_template_as_vllm_gives_them(tiny_engine_dir, llm):
    """vLLM's chat `documents` (was: 400 unknown field): the template gets them as transformers' apply_chat_template
    passes them, so /tokenize and the chat's usage count the tokens transformers renders; /tokenize takes them too.
    A documents value that is no list of string mappings is a 400 naming it, and the server goes on."""
    import openai

    from trtpaged.server import start_server

    docs = [{"title": "Paris", "text": "The capital of France."}, {"title": "Rome", "text": "The capital of Italy."}]
    want = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        MESSAGES, documents=docs, chat_template=RAG_TEMPLATE, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)  # fmt: skip
    bare = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        MESSAGES, chat_template=RAG_TEMPLATE, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    assert len(want) > len(bare) + 20
    server = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu", chat_template=RAG_TEMPLATE)
    try:
        status, _, out = request(server, "/tokenize", {"messages": MESSAGES, "documents": docs})
        assert status == 200 and out["tokens"] == want, out
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                extra_body={"documents": docs})  # fmt: skip
        assert answer.usage.prompt_tokens == len(want)
        plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert plain.usage.prompt_tokens == len(bare)
        for bad in ("Paris", [{"title": 1}], [["Paris"]], {"title": "x"}):
            status, _, out = request(server, "/v1/chat/completions", {"messages": MESSAGES, "documents": bad})
            assert status == 400 and out["error"]["param"].startswith("documents"), (bad, out)
        wait_idle(server)
    finally:
        server.shutdown()
