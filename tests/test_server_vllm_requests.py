"""vLLM's per-request fields about the prompt and the request itself, through a real server and the official `openai`
client (`extra_body=`): add_special_tokens, request_id (and the X-Request-Id header), cache_salt.

The engine is the tiny one with a tokenizer that adds a BOS to a text (as Llama's does), so that add_special_tokens
changes the prompt; the truths are that tokenizer loaded by transformers, `LLM` on the same engine and the server's
own prefix-cache counters (exact block accounting).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import openai
import pytest

from conftest import save_manifest

from tests.test_server import metrics, request, stream, wait_idle
from trtpaged import LLM, SamplingParams
from trtpaged.engine_files import sha256_file
from trtpaged.manifest import MANIFEST_NAME
from trtpaged.server import start_server

from runtime_helpers import openai_client

MODEL = "tiny-bos"
BOS = 256  # the tiny tokenizer's <|bos|>
TEXT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "hello"}]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def _adds_a_bos(tokenizer_json: Path) -> None:
    data = json.loads(tokenizer_json.read_text())
    bos = {"SpecialToken": {"id": "<|bos|>", "type_id": 0}}
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [BOS], "tokens": ["<|bos|>"]}},
    }
    tokenizer_json.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def engine_dir(tiny_engine_dir, tmp_path_factory) -> Path:
    """A copy of the tiny engine whose tokenizer adds a BOS, with the manifest's file hashes made to match."""
    out = tmp_path_factory.mktemp("bos") / "engine"
    shutil.copytree(tiny_engine_dir, out)
    _adds_a_bos(out / "tokenizer" / "tokenizer.json")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["files"] = {name: sha256_file(out / name) for name in manifest["files"]}
    save_manifest(out, manifest)
    return out


@pytest.fixture(scope="module")
def tok(engine_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(engine_dir / "tokenizer"))


@pytest.fixture(scope="module")
def llm(engine_dir):
    return LLM(engine_dir, device="cpu")


@pytest.fixture(scope="module")
def server(engine_dir):
    handle = start_server(engine_dir, port=0, served_model_name=MODEL, device="cpu")
    yield handle
    handle.shutdown(timeout=0)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def _greedy_text(llm, ids: list[int]) -> str:
    return llm.generate([ids], GREEDY)[0].outputs[0].text


def _template_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_add_special_tokens_decides_the_prompts_bos(client, llm, tok, server):
    """Completions add the tokenizer's BOS by default and not with add_special_tokens false; chat adds none on top
    of its template's text by default and one with true; a token-id prompt is taken as given either way. The prompt
    ids (return_token_ids, whole and streamed), usage and the answer are those of the tokenizer's ids, and /tokenize
    counts the same for the same setting."""
    with_bos, without = tok.encode(TEXT), tok.encode(TEXT, add_special_tokens=False)
    assert with_bos == [BOS] + without  # the tokenizer does add one
    for extra, ids in (({}, with_bos), ({"add_special_tokens": True}, with_bos),
                       ({"add_special_tokens": False}, without)):  # fmt: skip
        resp = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
        choice = resp.choices[0]
        assert choice.model_extra["prompt_token_ids"] == ids and resp.usage.prompt_tokens == len(ids), extra
        assert choice.text == _greedy_text(llm, ids)
        counted = request(server, "/tokenize", {"prompt": TEXT, **extra})[2]
        assert counted["tokens"] == ids
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, stream=True,
                                            extra_body={"add_special_tokens": False, "return_token_ids": True}))
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == without
    for flag in (True, False):  # token ids are not tokenized again
        resp = client.completions.create(model=MODEL, prompt=without, max_tokens=1,
                                         extra_body={"add_special_tokens": flag, "return_token_ids": True})
        assert resp.choices[0].model_extra["prompt_token_ids"] == without

    templated = _template_ids(tok, MESSAGES)
    assert templated[0] == BOS and templated[1] != BOS  # the template writes its own BOS
    for extra, ids in (({}, templated), ({"add_special_tokens": False}, templated),
                       ({"add_special_tokens": True}, [BOS] + templated)):  # fmt: skip
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                              extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
        assert resp.model_extra["prompt_token_ids"] == ids and resp.usage.prompt_tokens == len(ids), extra
        assert resp.choices[0].message.content == _greedy_text(llm, ids)
        assert request(server, "/tokenize", {"messages": MESSAGES, **extra})[2]["tokens"] == ids
    wait_idle(server)


def test_request_id_names_the_answer(client, server):
    """The answer's id is "cmpl-<request_id>" ("chatcmpl-" for chat), every chunk's too, and its X-Request-Id header
    the caller's id; the X-Request-Id header wins over the body's field (vLLM's order); without either the id is a
    random one, which the header repeats."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2,
                                                      extra_body={"request_id": "job-42/a b"})  # fmt: skip
    assert raw.parse().id == "cmpl-job-42/a b" and raw.headers["x-request-id"] == "job-42/a b"
    chat = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                            extra_body={"request_id": "job-43"})  # fmt: skip
    assert chat.parse().id == "chatcmpl-job-43" and chat.headers["x-request-id"] == "job-43"
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True,
                                                 extra_body={"request_id": "job-44"}))  # fmt: skip
    assert {c.id for c in chunks} == {"chatcmpl-job-44"}
    both = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2,
                                                       extra_headers={"X-Request-Id": "from-header"},
                                                       extra_body={"request_id": "from-body"})  # fmt: skip
    assert both.parse().id == "cmpl-from-header" and both.headers["x-request-id"] == "from-header"
    events = stream(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "s-1"})
    assert {e["id"] for e in events[:-1]} == {"cmpl-s-1"}
    plain = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", plain.parse().id) and plain.headers["x-request-id"] == plain.parse().id
    wait_idle(server)


def test_two_requests_under_one_request_id_run_side_by_side(client, llm, tok, server):
    """A caller's id need not be unique (vLLM's neither): a second request under the id of one still running (two
    prompts of n 2 each) runs beside it, and both answers are LLM's."""
    prompts = ["one prompt", "and another"]
    ids = [tok.encode(p) for p in prompts]
    long_truth = [o.outputs[0].text for o in llm.generate(ids, SamplingParams(max_tokens=300, temperature=0.0,
                                                                              ignore_eos=True))]  # fmt: skip
    short_truth = [o.outputs[0].text for o in llm.generate(ids, GREEDY)]
    body = {"request_id": "same", "ignore_eos": True}
    first = client.completions.create(model=MODEL, prompt=prompts, max_tokens=300, temperature=0, n=2, stream=True,
                                      extra_body=body)  # fmt: skip
    texts: dict[int, str] = {}
    chunks = iter(first)
    for chunk in chunks:  # the first request is in the engine once its first tokens are out
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
        if len(texts) == 4:
            break
    assert server.loop.num_in_flight == 2  # one engine request per prompt
    second = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2,
                                       extra_body=body)  # fmt: skip
    assert second.id == "cmpl-same" and [c.text for c in second.choices] == [t for t in short_truth for _ in (0, 1)]
    for chunk in chunks:
        if chunk.choices:
            texts[chunk.choices[0].index] += chunk.choices[0].text
    assert [texts[i] for i in range(4)] == [t for t in long_truth for _ in (0, 1)]
    wait_idle(server)


def _hits(server) -> float:
    return metrics(server)["prefix_cache_hits_total"]


def test_cache_salt_shares_cached_blocks_only_under_the_same_salt(client, llm, server):
    """A 50-token prompt (3 full blocks of 16): sent again it finds its 48 cached tokens under the same salt (or
    none), none under another, exactly (the server's prefix-cache hit counter); chat's templated prompt too. The
    answers are LLM's whatever the salt."""
    prompt = list(range(40, 90))
    truth = _greedy_text(llm, prompt)
    found = []
    for salt in (None, None, "tenant-a", "tenant-a", "tenant-b", None, "tenant-a"):
        before = _hits(server)
        extra = {"ignore_eos": True} | ({} if salt is None else {"cache_salt": salt})
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body=extra)
        assert resp.choices[0].text == truth
        found.append(_hits(server) - before)
    assert found == [0, 48, 0, 48, 0, 48, 48]

    messages = [{"role": "user", "content": "a conversation long enough to fill two blocks of sixteen tokens"}]
    chat_truth = llm.chat(messages, GREEDY)[0].outputs[0].text
    found = []
    for salt in ("chat-a", "chat-a", "chat-b"):
        before = _hits(server)
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                              extra_body={"ignore_eos": True, "cache_salt": salt})  # fmt: skip
        assert resp.choices[0].message.content == chat_truth
        found.append(_hits(server) - before)
    full_blocks = (resp.usage.prompt_tokens - 1) // 16 * 16
    assert full_blocks >= 32 and found == [0, full_blocks, 0]
    wait_idle(server)


def test_every_answer_carries_a_request_id(client, server):
    """Errors and the routes that make no answer id carry X-Request-Id too (the openai client's `request_id` of a
    failed call): the caller's header when it is one the server takes, else a random one; a header the server
    refuses is not echoed."""
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": -1}), ("/v1/models", None),
                       ("/health", None), ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES})):
        status, headers, _ = request(server, path, body, headers={"X-Request-Id": "trace-7"})
        assert headers["X-Request-Id"] == "trace-7", (path, status)
        status, headers, _ = request(server, path, body)
        assert re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"]), (path, status, headers["X-Request-Id"])
    status, headers, _ = request(server, "/v1/completions", {"prompt": "hi"}, headers={"X-Request-Id": "y" * 257})
    assert status == 400 and re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"])
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt="hi", max_tokens=2, extra_headers={"X-Request-Id": "job-9"})
    assert caught.value.request_id == "job-9"
    assert "request-id" not in request(server, "/v1/models")[1]  # Anthropic's header only on its routes
    wait_idle(server)


BAD = [  # (body, header, path, param, words in the message)
    ({"prompt": "hi", "request_id": ""}, None, "/v1/completions", "request_id", "1 to 256 characters, got 0"),
    ({"prompt": "hi", "request_id": "x" * 257}, None, "/v1/completions", "request_id", "1 to 256 characters, got 257"),
    ({"prompt": "hi", "request_id": "a\nb"}, None, "/v1/completions", "request_id", "printable ASCII"),
    ({"messages": MESSAGES, "request_id": "é"}, None, "/v1/chat/completions", "request_id", "printable ASCII"),
    ({"prompt": "hi", "request_id": 5}, None, "/v1/completions", "request_id", ""),
    ({"prompt": "hi"}, "y" * 257, "/v1/completions", "X-Request-Id", "1 to 256 characters, got 257"),
    ({"prompt": "hi", "cache_salt": ""}, None, "/v1/completions", "cache_salt", "1 to 128 characters"),
    ({"messages": MESSAGES, "cache_salt": "s" * 129}, None, "/v1/chat/completions", "cache_salt", "1 to 128"),
    ({"prompt": "hi", "cache_salt": "\ud800"}, None, "/v1/completions", "cache_salt", "not valid Unicode"),
    ({"prompt": "hi", "cache_salt": ["a"]}, None, "/v1/completions", "cache_salt", ""),
    ({"prompt": "hi", "add_special_tokens": "no"}, None, "/v1/completions", "add_special_tokens", ""),
    ({"messages": MESSAGES, "add_special_tokens": 1}, None, "/v1/chat/completions", "add_special_tokens", ""),
]


def test_bad_values_are_400s_naming_the_field_and_the_limit(server):
    for body, header, path, param, words in BAD:
        status, _, out = request(server, path, {"max_tokens": 2, **body},
                                 headers={"X-Request-Id": header} if header else None)  # fmt: skip
        assert status == 400 and out["error"]["param"] == param and words in out["error"]["message"], (body, out)
    assert wait_idle(server)["kv_cache_blocks_used"] == 0
