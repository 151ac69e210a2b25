"""`trtpaged serve`: a real server (uvicorn) on 127.0.0.1 (port 0) over the tiny engine, checked against `LLM`.

Shared helpers for the other test_server_* modules live here too.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from click.testing import CliRunner

from trtpaged import LLM, SamplingParams
from trtpaged.cli import main
from trtpaged.errors import RequestError
from trtpaged.server import start_server
from trtpaged.runtime.output_processor import held_back

from runtime_helpers import slowed_steps

MODEL = "tiny-served"


@pytest.fixture(scope="module")
def llm(tiny_engine_dir):
    return LLM(tiny_engine_dir, device="cpu")


@pytest.fixture(scope="module")
def server(tiny_engine_dir):
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu")
    yield handle
    handle.shutdown()



@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS thread names are read from /proc (Linux)")
def test_server_threads_carry_their_os_names(server):
    """`bench serve-ratio` splits the server's CPU by its threads' OS names: the engine's and the event loop's."""
    names = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.add(f.read().strip())
        except OSError:
            continue
    assert {"trtpaged-engine", "trtpaged-http"} <= names, names

def request(server, path, body=None, method=None, raw=None, headers=None):
    """(status, headers, parsed JSON or text) of one HTTP request."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(server.url + path, data=data, method=method or ("POST" if data is not None else "GET"))
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, headers, text = resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, headers, text = e.code, e.headers, e.read().decode()
    is_json = headers.get("Content-Type", "").startswith("application/json")
    return status, headers, json.loads(text) if is_json else text


def stream(server, path, body, headers=None):
    """The `data:` payloads of a streamed response, JSON-decoded except the final [DONE]."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = [line[len(b"data: "):].decode() for line in resp.read().split(b"\n\n") if line.startswith(b"data: ")]
    conn.close()
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def metrics(server):
    """Unlabelled samples and labelled ones keyed by their full `name{labels}` (names without `trtpaged:`; vLLM's
    load gauges keep `vllm:`)."""
    status, headers, text = request(server, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = [line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#"]
    assert all(name.startswith(("trtpaged:", "vllm:")) for name, _ in samples)
    return {name.removeprefix("trtpaged:"): float(value) for name, value in samples}


def wait_idle(server, timeout=10.0):
    """Metrics once no request runs or waits; asserts no KV block is left in use."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["num_requests_running"] == m["num_requests_waiting"] == 0 and m["kv_cache_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, f"server did not go idle: {m}"
        time.sleep(0.05)


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_completions_match_llm(server, llm):
    prompts = ["hello there", [5, 6, 7, 8, 9, 10]]
    status, _, body = request(server, "/v1/completions",
                              {"model": MODEL, "prompt": prompts, "max_tokens": 10, "temperature": 0})
    assert status == 200, body
    truth = llm.generate(prompts, greedy(10))
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    assert abs(body["created"] - time.time()) < 60
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice, out in zip(body["choices"], truth):
        assert choice["text"] == out.outputs[0].text and choice["finish_reason"] == out.outputs[0].finish_reason
    assert body["usage"] == {
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in truth),
        "completion_tokens": sum(len(o.outputs[0].token_ids) for o in truth),
        "total_tokens": sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in truth),
        "prompt_tokens_details": None,  # vLLM's field, null without --enable-prompt-tokens-details
    }
    status, _, body = request(server, "/v1/completions",
                              {"prompt": "abc", "max_tokens": 4, "logprobs": 2, "temperature": 0})
    lp = body["choices"][0]["logprobs"]
    expected = llm.generate(["abc"], greedy(4, logprobs=2))[0].outputs[0]
    assert len(lp["tokens"]) == len(expected.token_ids) == len(lp["text_offset"])
    assert lp["token_logprobs"] == pytest.approx([d[t] for d, t in zip(expected.logprobs, expected.token_ids)],
                                                 abs=1e-5)
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])  # keyed by text: U+FFFD tokens collide
    status, _, body = request(server, "/v1/completions",
                              {"prompt": "abc", "max_tokens": 4, "use_beam_search": True, "best_of": 3})
    beam = llm.generate(["abc"], SamplingParams(max_tokens=4, beam_width=3))[0].outputs[0]
    assert status == 200 and [c["text"] for c in body["choices"]] == [beam.text]


def test_chat_matches_llm(server, llm):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    status, _, body = request(server, "/v1/chat/completions",
                              {"messages": messages, "max_completion_tokens": 8, "temperature": 0, "logprobs": True,
                               "top_logprobs": 1})
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    (truth,) = llm.chat(plain, greedy(8))
    assert status == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": truth.outputs[0].text, "refusal": None}
    assert body["usage"]["prompt_tokens"] == len(llm.chat_prompt(plain))
    assert body["usage"]["completion_tokens"] == len(truth.outputs[0].token_ids) == len(choice["logprobs"]["content"])
    assert all(len(item["top_logprobs"]) == 1 for item in choice["logprobs"]["content"])


def test_streaming_equals_non_streamed(server, llm):
    body = {"prompt": "stream me", "max_tokens": 12, "temperature": 0, "stream_options": {"include_usage": True}}
    events = stream(server, "/v1/completions", body)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    truth = llm.generate(["stream me"], greedy(12))[0].outputs[0]
    assert text == truth.text and events[-3]["choices"][0]["finish_reason"] == truth.finish_reason
    assert events[-2]["usage"]["completion_tokens"] == len(truth.token_ids)
    chat = stream(server, "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": "yo"}], "max_tokens": 6, "temperature": 0})
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant" and chat[-1] == "[DONE]"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in chat[:-1])
    assert content == llm.chat([{"role": "user", "content": "yo"}], greedy(6))[0].outputs[0].text
    stop = truth.text[3:5]  # a stop string inside the greedy text: streamed text must stop before it too
    events = stream(server, "/v1/completions", {**body, "stop": stop})
    status, _, plain = request(server, "/v1/completions", {**body, "stop": stop, "stream_options": None})
    assert ("".join(e["choices"][0]["text"] for e in events[:-2]) == plain["choices"][0]["text"]
            == truth.text[: truth.text.index(stop)])


def test_held_back_stop_prefixes():
    assert held_back("abc", ["cd"]) == 1 and held_back("abc", ["bcx", "z"]) == 2 and held_back("abc", ["xyz"]) == 0


def test_concurrent_requests_share_steps(server, llm):
    prompts = ["first prompt", "second one here", [7, 8, 9], "a fourth prompt that is longer than one block of sixteen"]
    before = wait_idle(server)["engine_steps_total"]
    results: dict[int, dict] = {}

    def run(i):
        results[i] = request(server, "/v1/completions",
                             {"prompt": prompts[i], "max_tokens": 16, "temperature": 0, "ignore_eos": True})[2]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    truth = llm.generate(prompts, greedy(16, ignore_eos=True))
    assert [results[i]["choices"][0]["text"] for i in range(4)] == [o.outputs[0].text for o in truth]
    steps = wait_idle(server)["engine_steps_total"] - before
    assert 16 <= steps < 4 * 16, f"{steps} steps for 4 x 16 tokens: requests did not share steps"


def test_parallel_sampling_n2(server, llm):
    body = {"prompt": "sample", "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2}
    status, _, out = request(server, "/v1/completions", body)
    truth = llm.generate(["sample"], SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2))[0]
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["text"] for c in out["choices"]] == [c.text for c in truth.outputs]


# Refused by the server itself: (path, body, status, param, text the message must contain).
BAD = [
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model", "tiny-served"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "top_k": 1.5}, 400, "top_k", "integer"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", "use_beam_search"),
    # the beam width the client gave, by its name (was: "at most beam_width (2)", a field it never sent)
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 3, "best_of": 2}, 400, "n",
     "n: at most best_of (2) with beam search, got 3"),
    ("/v1/completions", {"prompt": [5] * 500, "max_tokens": 20}, 400, "max_tokens", "max_seq_len (512)"),
    ("/v1/completions", {"prompt": [999999]}, 400, "prompt", "vocabulary [0, 320)"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "required"),
    # was: the first accepted form's rule only ("a valid string")
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", "expected one of str, list[str]"),
    # several bad values (list items, dict values, fields) are not a union's forms: the first is named
    ("/v1/chat/completions", {"messages": [{"role": 5, "content": "x"}, {"role": "user", "content": 5}]}, 400,
     "messages", "messages[0].role: Input should be a valid string"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": "a", "2": "b"}}, 400, "logit_bias", "logit_bias[1]: "),
    ("/v1/completions", {"prompt": "x", "early_stopping": "x"}, 400, "early_stopping",
     "expected one of bool, literal['never']"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"Foo": 1, "Bar": 2}}, 400,
     "stream_options", "stream_options.Foo: unknown field"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "bogus": 1}, 400, "bogus", "unknown field"),
    ("/v1/completions", [1, 2], 400, "body", "object"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs",
     "logprobs"),
]
# Refused by the runtime: (path, body, field, a probe that makes the runtime raise the same error directly).
# The server names the field when the runtime raises RequestError, and no field for a plain ValueError.
RUNTIME_BAD = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", lambda llm: SamplingParams(max_tokens=0)),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", lambda llm: SamplingParams(temperature=-1)),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", lambda llm: SamplingParams(top_p=0)),
    ("/v1/completions", {"prompt": "x", "n": 9}, "n", lambda llm: llm.engine.add_request([5], SamplingParams(n=9))),
    ("/v1/completions", {"prompt": [5] * 600}, "prompt", lambda llm: llm.engine.add_request([5] * 600)),
    ("/v1/completions", {"prompt": ["ok", [5] * 600]}, "prompt", lambda llm: llm.engine.add_request([5] * 600)),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 600}]}, "messages",
     lambda llm: llm.engine.add_request([5] * 600)),
]


def expected_param(probe, llm, field):
    """`field` if the runtime raises RequestError for this input, None if a plain ValueError."""
    with pytest.raises(ValueError) as info:
        probe(llm)
    return field if isinstance(info.value, RequestError) else None


def test_bad_input_is_4xx_and_leaks_nothing(server, llm):
    key = 'http_requests_total{route="/v1/completions",status="400"}'
    before = metrics(server).get(key, 0)
    for path, body, code, param, text in BAD:
        status, _, out = request(server, path, body)
        assert status == code, (body, out)
        assert out["error"]["param"] == param, (body, out)
        assert out["error"]["type"] == ("not_found_error" if code == 404 else "invalid_request_error"), (body, out)
        assert out["error"]["message"].startswith(param) and text in out["error"]["message"], (body, out)
    for path, body, field, probe in RUNTIME_BAD:
        status, _, out = request(server, path, body)
        assert status == 400 and out["error"]["type"] == "invalid_request_error", (body, out)
        assert out["error"]["param"] == expected_param(probe, llm, field), (body, out)
        assert field.split("/")[0] in out["error"]["message"] or field == "messages", (body, out)
    status, _, out = request(server, "/v1/completions", raw=b'{"prompt": "x",')
    assert status == 400 and out["error"]["param"] == "body"
    assert request(server, "/nope")[0] == 404 and request(server, "/v1/completions", method="GET")[0] == 405
    assert request(server, "/v1/completions", {"prompt": "still up", "max_tokens": 2})[0] == 200
    m = wait_idle(server)
    sent = ([c for p, _, c, *_ in BAD if p == "/v1/completions"]
            + [400 for p, *_ in RUNTIME_BAD if p == "/v1/completions"])
    assert m[key] - before == sent.count(400) + 1  # + the malformed JSON


# picks the roles it knows, as Qwen2.5's and Phi-3's templates do: a message of another role is dropped unseen
KNOWN_ROLES_ONLY = ("{% for m in messages %}{% if m.role in ['system', 'developer', 'user', 'assistant', 'tool', "
                    "'function'] %}<|bos|>{{ m.role }}\n{{ m.content }}<|eos|>\n{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


def test_a_chat_role_the_template_drops_is_refused_naming_it(server, tiny_engine_dir):
    """A role outside OpenAI's that the chat template drops (the prompt renders the same without it) is a 400 naming
    messages[i].role (OpenAI's invalid_value) on chat completions (streamed too) and /tokenize: the message vanished
    from the prompt unseen. A role the template renders (this engine's renders any, as ChatML's and Llama 3's do) is
    taken as vLLM takes it, and counts; OpenAI's roles are taken under both; the server goes on."""
    said = [{"role": "user", "content": "x"}]
    alone = request(server, "/tokenize", {"messages": said})[2]["count"]
    for role in ("robot", "ipython", ""):
        status, _, out = request(server, "/tokenize", {"messages": said + [{"role": role, "content": "y"}]})
        assert status == 200 and out["count"] > alone + 1, (role, out)
    picky = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu", chat_template=KNOWN_ROLES_ONLY)
    try:
        for role in ("robot", "ipython", "User"):
            messages = said + [{"role": role, "content": "y"}, {"role": "assistant", "content": "z"}]
            for path, body in (("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
                               ("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "stream": True}),
                               ("/tokenize", {"messages": messages})):  # fmt: skip
                status, _, out = request(picky, path, body)
                assert status == 400 and out["error"]["param"] == "messages[1].role", (role, path, out)
                assert out["error"]["type"] == "invalid_request_error" and out["error"]["code"] == "invalid_value"
                assert out["error"]["message"].startswith(f"messages[1].role: {role!r}: this model's chat template "
                                                          "renders no message of this role"), out  # fmt: skip
        for role in ("system", "developer", "user", "assistant", "tool", "function"):
            named = {"name": "f"} if role == "function" else {}  # OpenAI's function message names its function
            status, _, out = request(picky, "/tokenize", {"messages": said + [{"role": role, "content": "y", **named}]})
            assert status == 200 and out["count"] > 0, (role, out)
        assert request(picky, "/v1/chat/completions", {"messages": said, "max_tokens": 2})[0] == 200
        wait_idle(picky)
    finally:
        picky.shutdown()
    assert request(server, "/v1/chat/completions", {"messages": said, "max_tokens": 2})[0] == 200
    wait_idle(server)


def test_a_dropped_role_is_refused_offline_whatever_shape_the_template_checks(llm):
    """LLM.chat refuses a role the template drops as the server does, also where the template checks the
    conversation's shape (a template that wants two messages) or the role's message is the only one (was: taken,
    since the conversation without it did not render, and the user's text never reached the prompt). A template that
    renders the role's text keeps it."""
    def chat(messages: list[dict], template: str):
        return llm.chat(messages, SamplingParams(max_tokens=1, ignore_eos=True), chat_template=template)

    needs_two = "{% if messages | length < 2 %}{{ raise_exception('two messages') }}{% endif %}" + KNOWN_ROLES_ONLY
    for messages, template, first in (([{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}],
                                       KNOWN_ROLES_ONLY, 1),
                                      ([{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}],
                                       needs_two, 1),
                                      ([{"role": "robot", "content": "y"}], KNOWN_ROLES_ONLY, 0),
                                      ([{"role": "robot", "content": [{"type": "text", "text": "y"}]}],
                                       KNOWN_ROLES_ONLY, 0)):  # fmt: skip
        with pytest.raises(RequestError, match=rf"messages\[{first}\]\.role: 'robot': this model's chat template "
                                               "renders no"):  # fmt: skip
            chat(messages, template)
    renders_all = KNOWN_ROLES_ONLY.replace("{% if m.role in ['system', 'developer', 'user', 'assistant', 'tool', "
                                           "'function'] %}", "{% if true %}")  # fmt: skip
    assert renders_all != KNOWN_ROLES_ONLY
    (out,) = chat([{"role": "robot", "content": "y"}], renders_all)
    assert len(out.outputs[0].token_ids) == 1


def test_many_roles_outside_openais_cost_a_bounded_number_of_renderings():
    """The dropped-role check renders the conversation again per role outside OpenAI's: with a distinct role on each
    of 200 messages that was 200 more renderings of 200 messages (quadratic: 3000 such messages, 65 kB, held a
    tokenizer thread 27 s). Past the first few roles the rest are checked together: a bounded number of renderings,
    the roles a template renders still taken, the ones a template drops still refused."""
    from trtpaged.models.tiny_tokenizer import make_tiny_tokenizer
    from trtpaged.runtime.llm import chat_prompt_text

    class Counting:
        def __init__(self, tokenizer):
            self.tokenizer, self.chat_template, self.calls = tokenizer, None, 0

        def apply_chat_template(self, *args, **kwargs):
            self.calls += 1
            return self.tokenizer.apply_chat_template(*args, **kwargs)

    messages = [{"role": "user", "content": "x"}] + [{"role": f"r{i}", "content": "y"} for i in range(200)]
    every_role = ("{% for m in messages %}<|bos|>{{ m.role }}\n{{ m.content }}<|eos|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
    tok = Counting(make_tiny_tokenizer())
    assert "<|bos|>r199\ny" in chat_prompt_text(tok, messages, chat_template=every_role)
    assert tok.calls <= 12, tok.calls
    tok = Counting(make_tiny_tokenizer())
    with pytest.raises(RequestError, match=r"messages\[1\]\.role: 'r0': this model's chat template renders no"):
        chat_prompt_text(tok, messages, chat_template=KNOWN_ROLES_ONLY)
    later = messages[:1] + [{"role": "user", "content": f"u{i}"} for i in range(20)] + messages[1:]
    with pytest.raises(RequestError, match=r"messages\[21\]\.role: 'r0'"):  # the first message of a role dropped
        chat_prompt_text(Counting(make_tiny_tokenizer()), later, chat_template=KNOWN_ROLES_ONLY)
    only_late = [{"role": "user", "content": "x"}] + [{"role": f"r{i}", "content": "y"} for i in range(20)]
    late = "{% for m in messages if m.role[1:] | int < 8 %}"  # renders r0-r7 (checked one by one), drops the rest
    with pytest.raises(RequestError, match=r"messages\[9\]\.role: 'r8'"):  # those checked together: all dropped
        chat_prompt_text(Counting(make_tiny_tokenizer()), only_late,
                         chat_template=every_role.replace("{% for m in messages %}", late))  # fmt: skip
    with pytest.raises(RequestError, match=r"messages\[4\]\.role: 'r3'"):  # one of the first roles: apart
        chat_prompt_text(Counting(make_tiny_tokenizer()), only_late, chat_template=every_role.replace(
            "{% for m in messages %}", "{% for m in messages if m.role != 'r3' %}"))  # fmt: skip


def test_engine_exception_is_500_for_that_request_only(server):
    backend = server.llm.engine.runner

    def boom(batch):
        del backend.step  # fail once, then the real method again
        raise RuntimeError("secret detail")

    server.loop.call(lambda e: setattr(backend, "step", boom))
    status, _, out = request(server, "/v1/completions", {"prompt": "x", "max_tokens": 3})
    assert status == 500 and out["error"]["type"] == "server_error" and "RuntimeError" in out["error"]["message"]
    assert "secret detail" not in out["error"]["message"] and "Traceback" not in out["error"]["message"]
    assert request(server, "/v1/completions", {"prompt": "x", "max_tokens": 3})[0] == 200
    wait_idle(server)


def test_client_disconnect_aborts_and_frees_blocks(server):
    restore = slowed_steps(server, 0.005)  # 500 tokens take >= 2.5 s: the disconnect is seen long before the end
    aborted = metrics(server).get('request_success_total{finished_reason="abort"}', 0)
    try:
        for streamed in (True, False):
            body = json.dumps({"prompt": "long", "max_tokens": 500, "ignore_eos": True, "stream": streamed}).encode()
            sock = socket.create_connection((server.host, server.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            received = b""
            while streamed and b"data: " not in received:
                received += sock.recv(4096)
            while metrics(server)["num_requests_running"] != 1:
                time.sleep(0.02)
            sock.close()
            m = wait_idle(server)
            assert m['request_success_total{finished_reason="abort"}'] == aborted + 1
            assert m["kv_cache_blocks_used"] == 0
            aborted += 1
    finally:
        restore()


def test_models_health_metrics(server):
    status, _, models = request(server, "/v1/models")
    assert status == 200 and [d["id"] for d in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 512
    assert request(server, f"/v1/models/{MODEL}")[2]["id"] == MODEL
    assert request(server, "/v1/models/other")[0] == 404
    assert request(server, "/health")[:1] == (200,)
    request(server, "/v1/completions", {"prompt": "metrics", "max_tokens": 3})
    m = wait_idle(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "kv_cache_utilisation_perc",
                 "kv_cache_blocks_saved_by_sharing", "prompt_tokens_total", "generation_tokens_total",
                 "request_prompt_tokens_count", "request_generation_tokens_count", "e2e_request_latency_seconds_count"):
        assert name in m, name
    assert m["kv_cache_blocks"] == 256 and m["kv_cache_usage_perc"] == 0
    assert m["time_to_first_token_seconds_count"] >= 1 and m["inter_token_latency_seconds_count"] >= 1
    assert m['time_to_first_token_seconds_bucket{le="+Inf"}'] == m["time_to_first_token_seconds_count"]
    assert m['request_success_total{finished_reason="length"}'] >= 1
    assert m["prefix_cache_queries_total"] >= m["prefix_cache_hits_total"]
    # diagnose --metrics reads these gauges by their full names (it read trtpaged_* names no server exposes)
    from trtpaged.bench.server_metrics import gauges, parse_prometheus

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        assert gauges(parse_prometheus(resp.read().decode())) == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    plans = {k: v for k, v in m.items() if k.startswith("execution_plan_info")}  # the tiny engine: float32, fused
    assert plans == {f'execution_plan_info{{layers="{mode}"}}': float(mode == "fused")
                     for mode in ("c_layers", "fused", "torch")}  # fmt: skip


def test_engine_is_loaded_on_the_thread_that_steps_it(server, tiny_engine_dir):
    """One thread builds and steps the engine (so only its OpenMP pool exists); a failed load is raised."""
    from trtpaged.server.engine_loop import EngineLoop
    from trtpaged.server.metrics import ServerMetrics

    loaded_on = []

    def load():
        loaded_on.append(threading.current_thread())
        return LLM(tiny_engine_dir, device="cpu")

    llm, loop = EngineLoop.start_loaded(load, lambda llm: llm.engine, ServerMetrics())
    try:
        assert loop.call(lambda engine: threading.current_thread()) is loaded_on[0] is not threading.main_thread()
        assert loop.call(lambda engine: engine) is llm.engine and loop.alive
    finally:
        loop.shutdown()
    assert not loop.alive
    with pytest.raises(FileNotFoundError):
        EngineLoop.start_loaded(lambda: LLM(tiny_engine_dir / "missing"), lambda llm: llm.engine, ServerMetrics())
    steps = server.loop.call(lambda engine: threading.current_thread())
    assert steps.name == "trtpaged-engine" and steps is not threading.main_thread()


def test_cli_serve_help():
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--host", "--port", "--served-model-name", "--max-batch-size", "--max-num-tokens", "--num-kv-blocks",
                   "--api-key", "--max-waiting", "--shutdown-timeout", "--request-timeout", "--max-body-bytes"):
        assert option in result.output


def test_cli_serve_port_in_use_fails_before_loading(tiny_engine_dir):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        start = time.monotonic()
        result = CliRunner().invoke(main, ["serve", str(tiny_engine_dir), "--port", str(port), "--device", "cpu"])
        assert result.exit_code != 0
        assert f"127.0.0.1:{port}" in result.output and "already in use" in result.output
        assert len(result.output.strip().splitlines()) == 1
        assert time.monotonic() - start < 5
    finally:
        taken.close()


def test_keep_alive_serves_several_requests_on_one_connection(server):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None
        first = conn.sock
        for streamed in (False, True):
            conn.request("POST", "/v1/completions", json.dumps({"prompt": "ka", "max_tokens": 2, "stream": streamed}),
                         {"Content-Type": "application/json"})  # fmt: skip
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read()
        assert conn.sock is first  # http.client reopens a closed connection: the same socket means keep-alive
    finally:
        conn.close()



@pytest.mark.parametrize("soft, hard", [(256, None), (256, 512), (70000, 70000)])
def test_serve_raises_a_low_open_files_limit_up_to_the_hard_one(soft, hard):
    """Each connection holds a descriptor: serve lifts a soft limit of a few hundred towards 65536 (as vLLM's server
    does), within the hard limit (None: the machine's), and never lowers one that is higher."""
    import resource

    system_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = system_hard if hard is None else hard
    if system_hard != resource.RLIM_INFINITY and hard > system_hard:
        pytest.skip(f"this machine's hard open-files limit is {system_hard}")
    code = ("import resource; from trtpaged.commands.serve import raise_open_files_limit; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); raise_open_files_limit(); "
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    capped = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
    assert [int(v) for v in out] == [max(soft, capped), hard]


def test_serve_that_cannot_write_its_ready_line_serves_on(tiny_engine_dir):
    """stdout on a full disk (or a closed pipe): the ready line cannot be written; the server says so on stderr
    and serves on, and a SIGTERM drains and stops it with exit 0 (it exited 1 just after /health said 200)."""
    import signal as signals

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open("/dev/full", "w") as full:
        proc = subprocess.Popen([sys.executable, "-m", "trtpaged.cli", "serve", str(tiny_engine_dir), "--port",
                                 str(port), "--device", "cpu"], stdout=full, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-600:]
            time.sleep(0.2)
        time.sleep(1.0)  # past the ready line: the server must still be up
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200
        proc.send_signal(signals.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and b"Traceback" not in err, (proc.returncode, err[-600:])
    assert b"cannot write the ready line to stdout (No space left on device); serving on" in err


def test_a_sigterm_drains_when_stderr_cannot_be_written(tiny_engine_dir):
    """stderr on a full disk (or closed, or its reader gone): the "draining" line cannot be written; the drain
    still runs, so a stream in flight at SIGTERM ends whole and the command exits 0 (the failed line skipped the
    drain: the stream got "the server is shutting down" and the exit was 1)."""
    import signal as signals

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open("/dev/full", "w") as full:
        proc = subprocess.Popen([sys.executable, "-m", "trtpaged.cli", "serve", str(tiny_engine_dir), "--port",
                                 str(port), "--device", "cpu"], stdout=subprocess.PIPE, stderr=full)  # fmt: skip
    try:
        proc.stdout.readline()  # the ready line
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 400, "ignore_eos": True,
                                                            "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = resp.readline()
        assert first.startswith(b"data: "), first
        proc.send_signal(signals.SIGTERM)
        rest = first + resp.read()
        conn.close()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [json.loads(line[6:]) for line in rest.split(b"\n") if line.startswith(b"data: {")]
    assert not any("error" in e for e in events), events[-1]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and proc.returncode == 0
