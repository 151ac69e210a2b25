"""Clients the server must work with unchanged: the official `openai` package, and `trtpaged bench serve`."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from click.testing import CliRunner

from tests.test_server import wait_idle
from trtpaged import LLM, SamplingParams
from trtpaged.bench.serve_bench import ServeRequest, format_report, run_serve_bench
from trtpaged.cli import main
from trtpaged.server import ServerOptions, start_server

from runtime_helpers import openai_client

KEY = "sk-clients-test"


@pytest.fixture(scope="module")
def server(tiny_engine_dir):
    handle = start_server(tiny_engine_dir, port=0, served_model_name="tiny", device="cpu",
                          options=ServerOptions(api_key=KEY))  # fmt: skip
    yield handle
    handle.shutdown(timeout=0)


@pytest.fixture(scope="module")
def llm(tiny_engine_dir):
    return LLM(tiny_engine_dir, device="cpu")


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url, KEY)


def test_openai_client_chat_completions_streaming_n(client, llm):
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == llm.chat(messages, greedy)[0].outputs[0].text
    assert chat.usage.prompt_tokens == len(llm.chat_prompt(messages))

    comp = client.completions.create(model="tiny", prompt="once upon", max_tokens=8, temperature=0)
    assert comp.choices[0].text == llm.generate(["once upon"], greedy)[0].outputs[0].text

    obfuscation = {"include_obfuscation": False}  # OpenAI's (SDK 3.63): no padding is sent here either way
    pieces = client.completions.create(model="tiny", prompt="once upon", max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True, **obfuscation})  # fmt: skip
    chunks = list(pieces)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    assert chunks[-1].usage.completion_tokens == comp.usage.completion_tokens

    deltas = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_obfuscation": True})  # OpenAI's: no padding here
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == chat.choices[0].message.content

    many = client.completions.create(model="tiny", prompt="sample", max_tokens=6, temperature=1.0, n=3, seed=5)
    truth = llm.generate(["sample"], SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=5))[0]
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == [c.text for c in truth.outputs]
    assert [m.id for m in client.models.list().data] == ["tiny"]


def _stream_end(chunks) -> tuple[str, object, object]:
    """(joined text, finish_reason, stop_reason) of a streamed single choice (completions or chat)."""
    text, finish, stop = "", None, None
    for chunk in chunks:
        for c in chunk.choices:
            text += (c.delta.content or "") if hasattr(c, "delta") else c.text
            if c.finish_reason:
                finish, stop = c.finish_reason, getattr(c, "stop_reason", None)
    return text, finish, stop


def test_stop_token_ids_and_stop_reasons_streamed_and_whole(client, llm):
    """A stop token id ends the text before its own text (the text of the first k tokens, cut by max_tokens),
    or after it with include_stop_str_in_output; its id is the stop_reason, streamed or not, completions or
    chat, and so is a stop string."""
    greedy = llm.generate(["once upon"], SamplingParams(max_tokens=16, temperature=0.0))[0].outputs[0]
    ids = greedy.token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # the stop token's first appearance
    def first(n: int) -> str:
        return llm.generate(["once upon"], SamplingParams(max_tokens=n, temperature=0.0))[0].outputs[0].text
    for include, expected in ((False, first(k)), (True, first(k + 1))):
        kw = dict(model="tiny", prompt="once upon", max_tokens=16, temperature=0,
                  extra_body={"stop_token_ids": [ids[k]], "include_stop_str_in_output": include})  # fmt: skip
        whole = client.completions.create(**kw).choices[0]
        assert (whole.text, whole.finish_reason, whole.stop_reason) == (expected, "stop", ids[k])
        assert _stream_end(client.completions.create(stream=True, **kw)) == (expected, "stop", ids[k])
    stop = greedy.text[len(first(k)):][:2]
    kw = dict(model="tiny", prompt="once upon", max_tokens=16, temperature=0, stop=[stop])
    whole = client.completions.create(**kw).choices[0]
    assert (whole.finish_reason, whole.stop_reason) == ("stop", stop) and stop not in whole.text
    assert _stream_end(client.completions.create(stream=True, **kw)) == (whole.text, "stop", stop)

    messages = [{"role": "user", "content": "hello"}]
    chat_ids = llm.chat(messages, SamplingParams(max_tokens=16, temperature=0.0))[0].outputs[0].token_ids
    j = next(i for i in range(1, len(chat_ids)) if chat_ids[i] not in chat_ids[:i])
    kw = dict(model="tiny", messages=messages, max_tokens=16, temperature=0,
              extra_body={"stop_token_ids": [chat_ids[j]]})
    whole = client.chat.completions.create(**kw).choices[0]
    assert (whole.finish_reason, whole.stop_reason) == ("stop", chat_ids[j])
    assert _stream_end(client.chat.completions.create(stream=True, **kw)) == (whole.message.content, "stop",
                                                                            chat_ids[j])  # fmt: skip


def test_openai_platform_fields_and_text_parts(client, llm):
    """store / metadata / service_tier / prompt_cache_key / prompt_cache_retention / safety_identifier (what SDKs
    send for OpenAI's platform) are accepted and change nothing;
    a message's text parts are its lines."""
    import openai

    messages = [{"role": "user", "content": "hello\nworld"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    tagged = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, store=False,
                                            metadata={"run": "a"}, service_tier="auto",
                                            extra_body={"prompt_cache_key": "k", "safety_identifier": "u1",
                                                        "prompt_cache_retention": "in-memory"})  # fmt: skip
    assert tagged.choices[0].message.content == plain.choices[0].message.content
    # what the SDK declares for reasoning models and predicted outputs: a 400 each before ("unknown field")
    hinted = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                            reasoning_effort="low", verbosity="low", modalities=["text"],
                                            prediction={"type": "content", "content": "hello"})  # fmt: skip
    assert hinted.choices[0].message.content == plain.choices[0].message.content
    for field, value in (("modalities", ["text", "audio"]), ("web_search_options", {"search_context_size": "low"}),
                         ("audio", {"voice": "alloy", "format": "wav"})):
        with pytest.raises(openai.BadRequestError, match=f"{field}: .*not supported by this server"):
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, **{field: value})
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    joined = client.chat.completions.create(model="tiny", messages=parts, max_tokens=6, temperature=0)
    assert joined.usage.prompt_tokens == len(llm.chat_prompt(messages)) == plain.usage.prompt_tokens
    assert joined.choices[0].message.content == plain.choices[0].message.content
    # Anthropic's prompt-cache hint on a part (LiteLLM passes it through) is another provider's: it changes nothing
    parts[0]["content"][1]["cache_control"] = {"type": "ephemeral"}
    hinted = client.chat.completions.create(model="tiny", messages=parts, max_tokens=6, temperature=0)
    assert hinted.choices[0].message.content == plain.choices[0].message.content
    # OpenAI's prompt-cache settings (SDK 3.63): a breakpoint on a part, the request's options; the cache here is
    # automatic, so they change nothing; moderation: null asks for none
    parts[0]["content"][0]["prompt_cache_breakpoint"] = {"mode": "explicit", "ttl": "12h"}
    hinted = client.chat.completions.create(model="tiny", messages=parts, max_tokens=6, temperature=0, moderation=None,
                                            prompt_cache_options={"mode": "explicit", "ttl": "30m"})  # fmt: skip
    assert hinted.choices[0].message.content == plain.choices[0].message.content
    refused = (({"moderation": {"model": "omni-moderation-latest"}}, "moderation", ": this server runs no moderation"),
               ({"prompt_cache_options": {"ttl": "12h"}}, "prompt_cache_options", r"\.ttl: Input should be '30m'"),
               ({"prompt_cache_options": {"mode": "auto"}}, "prompt_cache_options", r"\.mode: Input should be"))
    for extra, field, why in refused:
        with pytest.raises(openai.BadRequestError, match=f"- {field}{why}") as err:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, **extra)
        assert err.value.body["param"] == field
    for breakpoint in ({"mode": "implicit"}, {"mode": "explicit", "ttl": "1h"}, {"mode": "explicit", "x": 1}, "yes"):
        parts[0]["content"][0]["prompt_cache_breakpoint"] = breakpoint
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\]\.prompt_cache_breakpoint: "):
            client.chat.completions.create(model="tiny", messages=parts, max_tokens=6)
    parts[0]["content"][0].pop("prompt_cache_breakpoint")
    parts[0]["content"][1]["bogus"] = 1
    with pytest.raises(openai.BadRequestError, match=r"unknown keys \['bogus'\]"):
        client.chat.completions.create(model="tiny", messages=parts, max_tokens=6)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == plain.choices[0].message.content  # the refusals left it serving


def test_every_request_field_of_the_openai_sdk_is_known():
    """Every field of the installed SDK's create params (completions, chat completions, Responses) is one this
    server reads (an unknown one is a 400, OpenAI's rule), taken at least as null; what a value does is each field's
    own test."""
    from openai.types import completion_create_params as completion
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as responses
    from trtpaged.server import responses_api
    from trtpaged.server.protocol import parse_generation

    def chat_of_responses(body: dict) -> None:
        parse_generation(responses_api.translate(body, ["tiny"]).chat_body, True, ["tiny"], 320)

    cases = ((completion.CompletionCreateParamsBase, {"prompt": "hi"},
              lambda body: parse_generation(body, False, ["tiny"], 320)),
             (chat.CompletionCreateParamsBase, {"messages": [{"role": "user", "content": "hi"}]},
              lambda body: parse_generation(body, True, ["tiny"], 320)),
             (responses.ResponseCreateParamsBase, {"input": "hi"}, chat_of_responses))  # fmt: skip
    for params, required, parse in cases:
        for name in params.__annotations__:
            if name not in required:
                parse({**required, name: None})


def test_chat_answers_carry_the_keys_openais_schema_requires(client):
    """OpenAI's API reference (its OpenAPI schema) requires a chat completion's message to carry `refusal` and a
    choice's (and a chunk choice's) logprobs `content` and `refusal`, null where there is none; a client that checks
    bodies against that schema refused ours, which left both `refusal` keys out (the SDK parses either way: the
    keys it was sent are its models' fields_set)."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2, logprobs=True,
              top_logprobs=1, temperature=1.0, seed=2)
    chat = client.chat.completions.create(**kw)
    for choice in chat.choices:
        assert {"role", "content", "refusal"} <= choice.message.model_fields_set and choice.message.refusal is None
        assert {"index", "message", "finish_reason", "logprobs"} <= choice.model_fields_set
        assert {"content", "refusal"} <= choice.logprobs.model_fields_set and choice.logprobs.refusal is None
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert all({"index", "delta", "finish_reason"} <= c.choices[0].model_fields_set for c in chunks)
    sampled = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert sampled and all({"content", "refusal"} <= lp.model_fields_set and lp.refusal is None for lp in sampled)


def test_continue_final_message_extends_the_assistants_text(client, llm):
    """vLLM's chat options: the last assistant message left open is continued; the prompt is the template's text
    up to that message's end (the tiny template written out by hand)."""
    import openai

    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Once upon"}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body=body)
    prompt = llm.tokenizer.encode("<|bos|>user\nhello<|eos|>\n<|bos|>assistant\nOnce upon", add_special_tokens=False)
    truth = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].text
    assert (got.choices[0].message.content, got.usage.prompt_tokens) == (truth, len(prompt))
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),  # with a generation prompt
                         ({"add_generation_prompt": False, "continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs")):
        msgs = messages if len(extra) == 1 or "chat_template_kwargs" in extra else messages[:1]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, extra_body=extra)
        assert err.value.body["param"] == param, extra


def test_a_developer_message_is_the_system_message_under_a_template_without_that_role(client, server, llm):
    """OpenAI's developer role (its SDK's name for the system instructions) reaches a template that never names it as
    the system message; was: rendered as a "developer" turn (after the default system prompt of a template that adds
    one, SmolLM2's; dropped by one that picks its roles, Qwen2.5's). Truth: the tiny template written out by hand; a
    template that names the role gets it as sent."""
    from tests.test_server import KNOWN_ROLES_ONLY, request
    from trtpaged.runtime.llm import chat_prompt_text

    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hello"}]
    text = "<|bos|>system\nbe brief<|eos|>\n<|bos|>user\nhello<|eos|>\n<|bos|>assistant\n"
    prompt = llm.tokenizer.encode(text, add_special_tokens=False)
    truth = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].text
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert (got.choices[0].message.content, got.usage.prompt_tokens) == (truth, len(prompt))
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == truth
    assert chunks[-1].usage.prompt_tokens == len(prompt)
    counted = request(server, "/tokenize", {"messages": messages}, headers={"Authorization": f"Bearer {KEY}"})[2]
    assert counted["count"] == len(prompt), counted
    kept = chat_prompt_text(llm.tokenizer, messages, chat_template=KNOWN_ROLES_ONLY)
    assert kept.startswith("<|bos|>developer\nbe brief<|eos|>"), kept
    prose = "{# written by the developers #}" + KNOWN_ROLES_ONLY.replace("'developer', ", "")  # the word, not the role
    assert chat_prompt_text(llm.tokenizer, messages, chat_template=prose).startswith("<|bos|>system\nbe brief"), prose


@pytest.fixture(scope="module")
def client3(tiny_engine_dir):
    """The official client of a second server on the same engine at `--stream-interval 3`."""
    openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install openai)")
    handle = start_server(tiny_engine_dir, port=0, served_model_name="tiny", device="cpu",
                          options=ServerOptions(api_key=KEY, stream_interval=3))  # fmt: skip
    yield openai.OpenAI(base_url=handle.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    wait_idle(handle)
    handle.shutdown(timeout=0)


def _token_entries(logprobs, chat: bool) -> list[tuple]:
    """One (token, logprob, top log-probs[, text offset]) per token of a choice's logprobs field (either format)."""
    if logprobs is None:
        return []
    if chat:
        return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in logprobs.content]
    return list(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset))


def _assembled(chunks, chat: bool) -> tuple[dict[int, tuple], dict[int, list[int]], object]:
    """Per choice index: (text, token entries, finish reasons of its chunks in order, finish reason) joined from
    a stream; per choice the tokens of each chunk that carried any; the usage chunk's usage."""
    joined: dict[int, list] = {}
    sizes: dict[int, list[int]] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text, entries, finishes = joined.setdefault(c.index, ["", [], []])
            joined[c.index][0] = text + ((c.delta.content or "") if chat else c.text)
            new = _token_entries(c.logprobs, chat)
            entries += new
            finishes.append(c.finish_reason)
            if new:
                sizes.setdefault(c.index, []).append(len(new))
    # the finish reason comes once, with the choice's last chunk
    for index, (_, _, finishes) in joined.items():
        assert all(f is None for f in finishes[:-1]) and finishes[-1] is not None, (index, finishes)
    return {i: (t, e, f[-1]) for i, (t, e, f) in joined.items()}, sizes, usage


def _whole(body, chat: bool) -> dict[int, tuple]:
    """Per choice index: (text, token entries, finish reason) of a non-streamed body."""
    return {c.index: ((c.message.content if chat else c.text), _token_entries(c.logprobs, chat), c.finish_reason)
            for c in body.choices}  # fmt: skip


def test_stream_interval_changes_only_the_chunking(client, client3):
    """`--stream-interval 3` through a real server and the official client: per choice, the first token's chunk at
    once, then 3 tokens a chunk (all their log-prob entries in it), the rest with the finish reason; assembled,
    texts, log-probs (tokens, values, top-k, text offsets), finish reasons and usage equal the same request
    streamed at interval 1 and answered whole: n=2 sampled, a stop string, and chat."""
    sampled = dict(model="tiny", prompt="once upon", max_tokens=11, temperature=1.0, seed=7, n=2, logprobs=2,
                   extra_body={"ignore_eos": True})  # fmt: skip
    stream = dict(stream=True, stream_options={"include_usage": True})
    whole = client.completions.create(**sampled)
    one, sizes1, usage1 = _assembled(client.completions.create(**sampled, **stream), chat=False)
    three, sizes3, usage3 = _assembled(client3.completions.create(**sampled, **stream), chat=False)
    assert one == three == _whole(whole, chat=False)
    assert len(three) == 2 and three[0][0] != three[1][0]  # two different samples, each chunked on its own
    assert all(finish == "length" and len(entries) == 11 for _, entries, finish in three.values())
    assert sizes1 == {0: [1] * 11, 1: [1] * 11} and sizes3 == {0: [1, 3, 3, 3, 1], 1: [1, 3, 3, 3, 1]}
    assert usage1 == usage3 == whole.usage

    greedy = dict(model="tiny", prompt="once upon", max_tokens=11, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})  # fmt: skip
    text = client.completions.create(**greedy).choices[0].text
    stop = text[5:7]
    cut = client.completions.create(**greedy, stop=stop)
    one, _, _ = _assembled(client.completions.create(**greedy, stop=stop, **stream), chat=False)
    three, _, _ = _assembled(client3.completions.create(**greedy, stop=stop, **stream), chat=False)
    assert one == three == _whole(cut, chat=False)
    assert three[0][0] == text[: text.index(stop)] and three[0][2] == "stop"  # nothing past the stop was sent

    chat = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=9, temperature=0,
                logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.chat.completions.create(**chat)
    one, _, _ = _assembled(client.chat.completions.create(**chat, **stream), chat=True)
    three, sizes3, usage3 = _assembled(client3.chat.completions.create(**chat, **stream), chat=True)
    assert one == three == _whole(whole, chat=True) and len(three[0][1]) == 9
    assert sizes3 == {0: [1, 3, 3, 2]} and usage3 == whole.usage


def test_stream_interval_is_checked(tiny_engine_dir):
    """A bad interval is refused naming it: by `trtpaged serve` before the engine loads, and by ServerOptions."""
    for bad in ("0", "-2", "two", "1.5"):
        result = CliRunner().invoke(main, ["serve", str(tiny_engine_dir), "--stream-interval", bad])
        assert result.exit_code == 2 and "--stream-interval" in result.output, (bad, result.output)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="stream_interval: must be an integer >= 1"):
            ServerOptions(stream_interval=bad)


def test_openai_client_sees_typed_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=10**9)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def _hf_client(server) -> object:
    """huggingface_hub's InferenceClient (a dependency of transformers) on the test server, as its docs show for a
    non-Hub OpenAI-compatible endpoint."""
    hub = pytest.importorskip("huggingface_hub", reason="huggingface_hub is not installed")
    return hub.InferenceClient(base_url=server.url + "/v1", api_key=KEY, timeout=60)


def test_huggingface_hub_response_formats_follow_the_schema(server, client):
    """huggingface_hub's chat_completion sends OpenAI's json_schema response_format as TGI's grammar
    {"type": "json_object", "value": schema}, and documents TGI's {"type": "json", "value": schema}: both follow the
    schema (the same text as the openai client's json_schema form, streamed or whole), and TGI's
    {"type": "regex", "value": pattern} the pattern; a malformed one is a 400 naming response_format."""
    import openai
    from huggingface_hub.errors import BadRequestError

    hf = _hf_client(server)
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    messages = [{"role": "user", "content": "Where to?"}]
    kw = dict(model="tiny", max_tokens=16, temperature=0)
    openai_form = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    truth = client.chat.completions.create(messages=messages, response_format=openai_form, **kw)
    assert json.loads(truth.choices[0].message.content)["city"] in ("Paris", "Rome", "Oslo")
    for fmt in (openai_form, {"type": "json_object", "value": schema}, {"type": "json", "value": schema}):
        whole = hf.chat_completion(messages, response_format=fmt, **kw)
        assert whole.choices[0].message.content == truth.choices[0].message.content, fmt
        chunks = hf.chat_completion(messages, response_format=fmt, stream=True, **kw)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.choices[0].message.content, fmt
    regex = hf.chat_completion(messages, response_format={"type": "regex", "value": "(yes|no)[0-9]"}, **kw)
    assert re.fullmatch("(yes|no)[0-9]", regex.choices[0].message.content)
    for bad in ({"type": "json"}, {"type": "json", "value": "{}"}, {"type": "regex", "value": 3},
                {"type": "text", "value": "x"}, {"type": "json", "value": schema, "x": 1}):
        with pytest.raises(BadRequestError) as err:
            hf.chat_completion(messages, response_format=bad, model="tiny", max_tokens=4)
        assert err.value.response.json()["error"]["param"] == "response_format", bad
    with pytest.raises(openai.BadRequestError, match=r"unknown keys \['value'\]"):  # huggingface_hub rewrites this one
        client.chat.completions.create(messages=messages, response_format={**openai_form, "value": schema}, **kw)
    wait_idle(server)


def test_huggingface_hub_named_tool_choice_without_a_type(server, client):
    """huggingface_hub's named tool choice, ChatCompletionInputToolChoiceClass, is sent as {"function": {"name": N}}
    without "type" (TGI's form; vLLM defaults the type to "function"): the same call as the openai client's typed
    form, whole and streamed; a tool without "type" is a function tool too (vLLM's default)."""
    from huggingface_hub import ChatCompletionInputFunctionName, ChatCompletionInputToolChoiceClass
    from trtpaged.server.tools import shown_tools

    hf = _hf_client(server)
    params = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "pick", "parameters": params}}]
    messages = [{"role": "user", "content": "Pick one."}]
    kw = dict(model="tiny", max_tokens=16, temperature=0)
    typed = client.chat.completions.create(messages=messages, tools=tools, **kw,
                                           tool_choice={"type": "function", "function": {"name": "pick"}})  # fmt: skip
    truth = [(c.function.name, c.function.arguments) for c in typed.choices[0].message.tool_calls]
    choice = ChatCompletionInputToolChoiceClass(function=ChatCompletionInputFunctionName(name="pick"))
    for given in (tools, [{"function": tools[0]["function"]}]):
        whole = hf.chat_completion(messages, tools=given, tool_choice=choice, **kw)
        assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == truth
        args = "".join(call.function.arguments or "" for chunk in
                       hf.chat_completion(messages, tools=given, tool_choice=choice, stream=True, **kw)
                       for call in (chunk.choices[0].delta.tool_calls or [] if chunk.choices else []))  # fmt: skip
        assert args == truth[0][1]
    assert shown_tools([{"function": tools[0]["function"]}]) == tools  # what the chat template is shown
    wait_idle(server)


def test_bench_serve_against_the_server(server):
    requests = [ServeRequest(f"word {i} " * (4 + i), 8 + i) for i in range(6)]
    wait_idle(server)

    def steps_and_seconds(engine):
        return engine.num_steps, sum(engine.phase_seconds.values())

    steps0, seconds0 = server.loop.call(steps_and_seconds)
    # no warm-up: the engine's steps between these two reads are then the run's alone, as the report's are
    report = asyncio.run(run_serve_bench(server.url, requests, float("inf"), max_concurrency=3, api_key=KEY,
                                         warmup=False))  # fmt: skip
    steps1, seconds1 = server.loop.call(steps_and_seconds)
    assert report["engine_step_ms"] == pytest.approx(1000 * (seconds1 - seconds0) / (steps1 - steps0), rel=1e-6)
    # after each step that streamed tokens the engine waited for the event loop to run their readers
    assert report["handoff_wait_ms"] > 0
    assert "Mean hand-over wait (ms):" in format_report(report)
    assert 0 < report["server_tpot_ms"] and "Mean engine step (ms):" in format_report(report)
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["total_output_tokens"] == sum(r.max_tokens for r in requests)  # ignore_eos: exact lengths
    assert report["total_input_tokens"] > 0
    assert 0 < report["p50_ttft_ms"] <= report["p99_ttft_ms"] and report["mean_itl_ms"] > 0
    assert report["mean_tpot_ms"] > 0 and report["p90_e2el_ms"] >= report["p50_e2el_ms"]
    assert "Successful requests:" in format_report(report)
    wait_idle(server)
    wrong = asyncio.run(run_serve_bench(server.url, requests[:2], 100.0, api_key="wrong"))
    assert wrong["completed"] == 0 and wrong["errors"] == {"HTTP 401": 2}


def test_cli_bench_serve_json(server):
    result = CliRunner().invoke(main, ["bench", "serve", "--base-url", server.url, "--num-requests", "4",
                                       "--prompt-len", "3:6", "--output-len", "4", "--request-rate", "50",
                                       "--api-key", KEY, "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["completed"] == 4 and report["total_output_tokens"] == 16 and report["request_rate"] == 50.0


def test_bare_reader_refuses_an_error_answer(server):
    """The bare reader of `bench serve-ratio` reports a refused stream by its status, not as an empty text
    (this server wants an API key, which the reader does not send)."""
    from trtpaged.bench.sse_reader import bare_batch_rate

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    with pytest.raises(ValueError, match="401"):
        bare_batch_rate(server.url, [body])


def test_bench_serve_ratio_runs_both_sides_on_the_same_prompts(tiny_engine_dir):
    """`bench serve-ratio` on the tiny engine, at stream intervals 1 and 3 (one `trtpaged serve` child each):
    both servers and the Python API give the same greedy texts, and every figure is a measured rate."""
    from trtpaged.bench.serve_ratio import format_ratio, run_serve_ratio

    report = run_serve_ratio(tiny_engine_dir, repeats=2, max_tokens=6, concurrency=3, stream_intervals=(1, 3))
    assert sorted(report["series"]) == sorted(["api_single", "api_batch"] + [
        f"serve_{m}@{n}" for m in ("single", "batch", "bare") for n in (1, 3)])  # fmt: skip
    assert all(len(v) == 2 and min(v) > 0 for v in report["series"].values())
    assert all(min(v) > 0 for v in report["step_ms"].values())
    assert sorted(report["handoff_ms"]) == sorted(k for k in report["series"] if k.startswith("serve_"))
    assert all(min(v) > 0 for v in report["handoff_ms"].values())  # every serve run streamed, so waited
    assert list(report["by_interval"]) == ["1", "3"]
    text = format_ratio(report)
    for interval, r in report["by_interval"].items():
        assert r["same_text_single"] is True and r["same_text_batch"] == "3/3", interval
        assert r["same_text_bare"] == "3/3" and r["bare_ratio"] > 0  # the bare reader's texts are the API's
        assert r["single_ratio"] > 0 and r["batch_ratio"] > 0
        # CPU per token by side (the server's threads from /proc's schedstat, in ns; the API's and the client's from
        # 10 ms clock ticks: only the 3-stream runs are long enough to be sure of one)
        us = r["cpu_us_per_token"]["batch"]
        assert us["api"] > 0 and us["engine"] > 0 and us["client"] > 0, us
        assert r["cpu_us_per_token"]["bare"]["engine"] > 0
        assert f"--stream-interval {interval}:" in text
    assert "serve / LLM.generate" in text and "HTTP/event loop" in text and "bare reader" in text
    assert "hand-over wait" in text


def test_bench_serve_ratio_refuses_bad_stream_intervals(tiny_engine_dir):
    """Refused before any engine loads, naming the option: below 1, repeated, or also passed to the server."""
    for args, message in ((["--stream-interval", "0"], "--stream-interval"),
                          (["--stream-interval", "2", "--stream-interval", "2"], "stream_interval: each value"),
                          (["--server-arg=--stream-interval=4"], "--stream-interval is set by the benchmark")):
        result = CliRunner().invoke(main, ["bench", "serve-ratio", str(tiny_engine_dir), *args])
        assert result.exit_code != 0 and message in result.output, (args, result.output)


def test_bench_serve_ratio_names_why_its_server_did_not_start(tiny_engine_dir):
    """A server argument that trtpaged serve refuses: one line quoting the server's own error, exit 1 (was: a
    traceback ending "did not start (exit 2)", the server's reason sent to /dev/null)."""
    result = CliRunner().invoke(main, ["bench", "serve-ratio", str(tiny_engine_dir), "--server-arg", "--bogus",
                                       "--repeats", "1", "--max-tokens", "2"])  # fmt: skip
    assert result.exit_code == 1 and result.exception.__class__ is SystemExit, result.output
    assert "did not start (exit 2)" in result.output and "--bogus" in result.output, result.output


def test_bench_serve_with_no_request_completed_exits_1_and_shows_no_zeros():
    """Nothing reachable: the latency rows read n/a (not 0.00 ms) and the command fails naming the first error."""
    result = CliRunner().invoke(main, ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--num-requests", "2"])
    assert result.exit_code == 1, result.output
    assert "no request completed (2 failed; first: " in result.output
    assert "Mean TTFT (ms):" in result.output and "0.00" not in result.output.split("Mean TTFT (ms):")[1].split("\n")[0]

