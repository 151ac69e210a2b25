"""vLLM's serve flags a vLLM launch script passes: --chat-template (a file or the text; replaces the engine's for
chat and /tokenize), --tool-call-parser (the format tool_choice "auto" reads), --enable-auto-tool-choice and
--seed. Truth: the template rendered here with jinja2 and the engine's tokenizer, and vLLM's documented rules."""

from __future__ import annotations

import os

import jinja2
import pytest
from click.testing import CliRunner

from runtime_helpers import openai_client
from tests.test_server import request, wait_idle
from tests.test_server_tools import HERMES_TEMPLATE, TOOLS
from trtpaged import LLM, SamplingParams
from trtpaged.cli import main
from trtpaged.commands.option_types import ChatTemplate
from trtpaged.server import ServerOptions, start_server

openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install openai)")
MODEL = "tiny"
TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")  # fmt: skip
MESSAGES = [{"role": "user", "content": "what is two plus two"}]


def _rendered_ids(llm: LLM, template: str, messages: list[dict]) -> list[int]:
    text = jinja2.Template(template).render(messages=messages, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_a_chat_template_replaces_the_engines_for_chat_and_tokenize(tiny_engine_dir, tmp_path):
    plain = LLM(tiny_engine_dir, device="cpu")
    want_ids = _rendered_ids(plain, TEMPLATE, MESSAGES)
    assert want_ids != plain.chat_prompt(MESSAGES)  # the engine's own template makes other tokens
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    template = ChatTemplate().convert(str(tmp_path / "t.jinja"), None, None)  # a file's path, as serve reads it
    assert template == TEMPLATE
    llm = LLM(tiny_engine_dir, device="cpu", chat_template=template)
    assert llm.chat_prompt(MESSAGES) == want_ids
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    truth = llm.generate([want_ids], greedy, use_tqdm=False)[0].outputs[0].text
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu", chat_template=template)
    try:
        status, _, body = request(handle, "/tokenize", {"model": MODEL, "messages": MESSAGES})
        assert status == 200 and body["tokens"] == want_ids
        r = openai_client(handle.url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                                              temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == len(want_ids) and r.choices[0].message.content == truth
        wait_idle(handle)
    finally:
        handle.shutdown(timeout=0)


def test_a_chat_template_value_is_a_file_first_then_text_with_its_escapes(tmp_path):
    """vLLM's order: a path that opens is read, braces in its name or not; else a value with a brace or a newline
    is the template's text, its backslash escapes decoded (a template typed on one command line)."""
    folder = tmp_path / "tmpl{v2}"
    folder.mkdir()
    (folder / "chat.jinja").write_text(TEMPLATE)
    assert ChatTemplate().convert(str(folder / "chat.jinja"), None, None) == TEMPLATE
    typed = r"{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert ChatTemplate().convert(typed, None, None) == "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def test_a_broken_chat_template_is_refused_before_the_weights_load(tiny_engine_dir):
    with pytest.raises(ValueError, match=r"chat_template: not a Jinja template \(line 1"):
        LLM(tiny_engine_dir, device="cpu", chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="chat_template: must be a Jinja template's text"):
        LLM(tiny_engine_dir, device="cpu", chat_template="  ")


@pytest.mark.parametrize("value, words", [
    ("/no/such/template", "looks like a file's path (no braces), and it cannot be read: No such file"),
    (".", "cannot be read: Is a directory"),
    ("fifo", "is not a regular file"),  # was: open() waited for a writer, forever
])  # fmt: skip
def test_serve_refuses_a_chat_template_it_cannot_read_naming_the_flag(tiny_engine_dir, tmp_path, value, words):
    import os

    if value == "fifo":
        value = str(tmp_path / "fifo")
        os.mkfifo(value)
    r = CliRunner().invoke(main, ["serve", str(tiny_engine_dir), "--chat-template", value])
    assert r.exit_code == 2 and "--chat-template" in r.output and words in r.output, r.output


def test_serve_refuses_a_template_file_that_is_not_utf8_or_too_large(tiny_engine_dir, tmp_path):
    (tmp_path / "latin1.jinja").write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    (tmp_path / "huge.jinja").write_bytes(b"x" * ((1 << 20) + 1))
    for name, words in (("latin1.jinja", "is not UTF-8 text"), ("huge.jinja", "holds more than 1048576 bytes")):
        r = CliRunner().invoke(main, ["serve", str(tiny_engine_dir), "--chat-template", str(tmp_path / name)])
        assert r.exit_code == 2 and words in r.output, r.output


def test_tool_choice_auto_follows_the_template_or_the_named_parser(tiny_engine_dir):
    """The tiny engine's template does not take tools: auto is refused. With a hermes template given by
    --chat-template, or with --tool-call-parser hermes (vLLM's rule: the parser decides), auto is served."""
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 4}
    for overrides, options, served in (({}, {}, False), ({"chat_template": HERMES_TEMPLATE}, {}, True),
                                       ({}, {"tool_call_parser": "hermes"}, True)):  # fmt: skip
        handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                              options=ServerOptions(**options), **overrides)  # fmt: skip
        try:
            status, _, answer = request(handle, "/v1/chat/completions", body)
            assert (status == 200) == served, (overrides, options, answer)
            if not served:
                assert answer["error"]["param"] == "tool_choice"
        finally:
            handle.shutdown(timeout=0)


@pytest.mark.parametrize("args, words", [
    (["--tool-call-parser", "bogus"], "--tool-call-parser: 'bogus' is not a parser this server has"),
    (["--seed", "-1"], "--seed"),
    (["--reasoning-parser", "granite"], "--reasoning-parser: 'granite' is not a parser this server has"),
    (["--default-chat-template-kwargs", "{bad"], "--default-chat-template-kwargs': not JSON"),
    (["--default-chat-template-kwargs", "[1]"], "must be a JSON object ({...}), got list"),
    (["--default-chat-template-kwargs", '{"tools": []}'],
     "--default-chat-template-kwargs: may not set ['tools'] (each request's own fields)"),
])  # fmt: skip
def test_serve_refuses_bad_vllm_flags_before_loading(tiny_engine_dir, args, words):
    r = CliRunner().invoke(main, ["serve", str(tiny_engine_dir), *args])
    assert r.exit_code in (1, 2) and words in r.output, r.output


def test_default_chat_template_kwargs_reach_every_chat_request_under_its_own(tiny_engine_dir):
    """vLLM's --default-chat-template-kwargs: the template sees them in chat, Responses and /tokenize; a request's
    chat_template_kwargs override them key by key. Truth: the template rendered here with jinja2."""
    template = "{{ mood }}/{{ tone }}:{% for m in messages %}{{ m['content'] }}{% endfor %}"
    defaults = {"mood": "calm", "tone": "dry"}
    llm = LLM(tiny_engine_dir, device="cpu")
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu", chat_template=template,
                          options=ServerOptions(default_chat_template_kwargs=defaults))  # fmt: skip
    try:
        client = openai_client(handle.url)
        for own, want in ((None, "calm/dry:hi"), ({"tone": "wry"}, "calm/wry:hi")):
            ids = llm.tokenizer.encode(jinja2.Template(template).render(messages=[{"content": "hi"}], **{
                **defaults, **(own or {})}), add_special_tokens=False)  # fmt: skip
            assert llm.tokenizer.decode(ids) == want
            extra = {"chat_template_kwargs": own} if own else {}
            status, _, body = request(handle, "/tokenize", {"model": MODEL, "messages": [{"role": "user",
                                                                                           "content": "hi"}], **extra})
            assert status == 200 and body["tokens"] == ids
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                               extra_body=extra)  # fmt: skip
            assert r.usage.prompt_tokens == len(ids)
        r = client.responses.create(model=MODEL, input="hi", max_output_tokens=1)
        assert r.usage.input_tokens == len(llm.tokenizer.encode("calm/dry:hi", add_special_tokens=False))
    finally:
        handle.shutdown(timeout=0)


def test_max_logprobs_sets_the_bound_a_request_meets(tiny_engine_dir):
    """vLLM's --max-logprobs (default 20): a chat request may ask for that many top log-probs per token, and one
    more is refused naming top_logprobs; --max-logprobs -1 is the whole vocabulary, which a request asks for as
    -1 too (vLLM's), within the server's bound."""
    for limit, asked, ok in ((30, 25, True), (30, 31, False), (-1, 320, True), (-1, -1, True), (30, -1, False)):
        handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu", max_logprobs=limit)
        try:
            status, _, body = request(handle, "/v1/chat/completions", {
                "model": MODEL, "messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": asked})
            want = 320 if asked == -1 else asked  # the tiny model's vocabulary
            if ok:
                entries = body["choices"][0]["logprobs"]["content"]
                assert status == 200 and entries and all(len(e["top_logprobs"]) == want for e in entries)
                status, _, body = request(handle, "/v1/completions", {  # token ids as names: none collapse
                    "model": MODEL, "prompt": "hi", "max_tokens": 1, "logprobs": asked, "prompt_logprobs": asked,
                    "return_tokens_as_token_ids": True})  # fmt: skip
                # the top `want`, and the token's own when it is not among them (vLLM's)
                assert status == 200 and want <= len(body["choices"][0]["logprobs"]["top_logprobs"][0]) <= want + 1
                assert all(want <= len(e) <= want + 1 for e in body["choices"][0]["prompt_logprobs"][1:])
            else:
                assert status == 400 and body["error"]["param"] == "top_logprobs", body
                assert (f"must be in [0, {limit}]" if asked >= 0 else f"-1 (the whole vocabulary, 320) exceeds this "
                        f"server's max_logprobs ({limit}") in body["error"]["message"]  # fmt: skip
        finally:
            handle.shutdown(timeout=0)


@pytest.mark.parametrize("failure, words", [
    (MemoryError(), "out of memory while loading the engine (an allocation failed)"),
    (RuntimeError("llama_layers: out of memory: qlinear_cpu: out of memory (std::bad_alloc)"),
     "out of memory while loading the engine (llama_layers: out of memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 1048576 bytes"), "out of memory while loading the engine ([enforce fail"),  # torch's
    (RuntimeError("can't start new thread"), "cannot start the server's threads"),
])  # fmt: skip
def test_serve_names_a_memory_or_thread_limit_hit_while_loading_in_one_line(tiny_engine_dir, monkeypatch, failure,
                                                                           words):  # fmt: skip
    """Under a memory or thread limit (ulimit -v, a cgroup), loading failed with a traceback from wherever the
    allocation or thread start failed (the kernels' warm-up, the tokenizer lanes); it is one line naming it."""
    import trtpaged.server as server_package

    def fails(*args, **kwargs):
        raise failure

    monkeypatch.setattr(server_package, "start_server", fails)
    r = CliRunner().invoke(main, ["serve", str(tiny_engine_dir)])
    assert r.exit_code == 1 and words in r.output and "Traceback" not in r.output, r.output


def test_a_vllm_launch_line_starts_the_server_unchanged(tiny_engine_dir):
    """`trtpaged serve` run as a vLLM launch script runs it: VLLM_API_KEY guards the server, --max-model-len takes
    vLLM's human-readable integers (0.3k = 300 tokens, which /v1/models reports), --num-gpu-blocks-override sizes
    the pool, the engine's own settings (block size, KV dtype, tokenizer) and this server's only values pass, the
    flags with nothing to set here start it with one line naming them, and SageMaker's /ping and /invocations
    answer as vLLM's do (an invocation is the chat or completions request its body is)."""
    import json
    import signal
    import socket
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TRTPAGED_API_KEY"} | {"VLLM_API_KEY": "sk-vllm"}
    proc = subprocess.Popen([sys.executable, "-m", "trtpaged.cli", "serve", str(tiny_engine_dir), "--port", str(port),
                             "--device", "cpu", "--served-model-name", MODEL, "tiny-alias", "--max-model-len", "0.3k",
                             "--trust-remote-code", "--disable-log-requests", "--enforce-eager", "--max-log-len",
                             "100", "--block-size", "16", "--kv-cache-dtype", "auto", "--tokenizer",
                             str(tiny_engine_dir), "--pipeline-parallel-size", "1", "--num-gpu-blocks-override", "37",
                             "--swap-space", "0.001", "--uvicorn-log-level", "warning", "--async-scheduling",
                             "--no-enable-chunked-prefill", "--distributed-executor-backend", "mp",
                             "--chat-template-content-format", "string"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def call(path, body=None, key="sk-vllm"):
        req = urllib.request.Request(url + path, json.dumps(body).encode() if body is not None else None,
                                     {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        assert b"ready at" in proc.stdout.readline()
        assert call("/v1/models", key="wrong")[0] == 401
        status, models = call("/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [MODEL, "tiny-alias"], models
        assert models["data"][0]["max_model_len"] == 300, models
        aliased = call("/v1/completions", {"model": "tiny-alias", "prompt": "hi", "max_tokens": 2})[1]
        assert aliased["model"] == MODEL  # answers carry the first name, as vLLM's
        assert call("/ping")[0] == 200 and call("/ping", {})[0] == 200
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
        completion = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "temperature": 0}
        for body, path in ((chat, "/v1/chat/completions"), (completion, "/v1/completions")):
            want, got = call(path, body)[1], call("/invocations", body)[1]
            assert (got["object"], got["choices"], got["usage"]) == (want["object"], want["choices"], want["usage"])
        status, out = call("/invocations", {"model": MODEL})
        assert status == 400 and out["error"]["param"] == "body"
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            assert "trtpaged:kv_cache_blocks 37.0" in r.read().decode()  # --num-gpu-blocks-override
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-600:]
    line = next(line for line in err.decode().splitlines() if "vLLM flags without an effect" in line)
    for flag in ("--trust-remote-code", "--disable-log-requests", "--enforce-eager", "--max-log-len",
                 "--uvicorn-log-level", "--async-scheduling", "--no-enable-chunked-prefill",
                 "--distributed-executor-backend", "--pipeline-parallel-size 1"):
        assert flag in line, line


def test_enable_prompt_tokens_details_counts_the_cached_prompt_tokens(tiny_engine_dir):
    """vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, whole and in a stream's
    usage chunk: every whole block of a repeated prompt but the one holding its last token (the prefix cache's
    rule: that token's logits must be computed); null when none was cached (vLLM's) and without the flag."""
    prompt = "a prompt long enough to fill a few blocks " * 3
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(enable_prompt_tokens_details=True))  # fmt: skip
    try:
        client = openai_client(handle.url)
        block = handle.llm.config.block_size
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        length = first.usage.prompt_tokens
        assert length > 2 * block and first.usage.prompt_tokens_details is None  # none cached: vLLM leaves it out
        second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert second.usage.prompt_tokens_details.cached_tokens == (length - 1) // block * block
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                                stream_options={"include_usage": True}))  # fmt: skip
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (length - 1) // block * block
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.usage.prompt_tokens_details is None
        wait_idle(handle)
    finally:
        handle.shutdown(timeout=0)
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu")
    try:
        plain = openai_client(handle.url).completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert plain.usage.prompt_tokens_details is None
    finally:
        handle.shutdown(timeout=0)


def test_vllm_flags_of_several_values_read_as_argparse_reads_them(tiny_engine_dir):
    """`--served-model-name a b` and `--api-key k1 k2` after the engine are several values (vLLM's nargs="+");
    before it a flag takes one word, so the engine is never taken for a name. The server takes any of the keys
    and any of the names."""
    from trtpaged.commands.vllm_flags import spread_nargs

    valued = {"--port", "--served-model-name", "--api-key"}
    assert spread_nargs(["E", "--served-model-name", "a", "b", "--port", "1"], valued) == \
        ["E", "--served-model-name", "a", "--served-model-name", "b", "--port", "1"]  # fmt: skip
    assert spread_nargs(["--api-key", "k", "E", "x"], valued) == ["--api-key", "k", "E", "x"]
    assert spread_nargs(["--port", "5", "E", "--api-key", "k1", "k2"], valued) == \
        ["--port", "5", "E", "--api-key", "k1", "--api-key", "k2"]  # fmt: skip
    handle = start_server(tiny_engine_dir, port=0, device="cpu",
                          options=ServerOptions(api_key=("k1", "k2"), served_model_name=("a", "b")))  # fmt: skip
    try:
        for key, status in (("k1", 200), ("k2", 200), ("k3", 401)):
            assert request(handle, "/v1/models", headers={"Authorization": f"Bearer {key}"})[0] == status
        for name, status in (("a", 200), ("b", 200), ("c", 404)):
            got, _, out = request(handle, "/v1/completions", {"model": name, "prompt": "x", "max_tokens": 1},
                                  headers={"Authorization": "Bearer k2"})  # fmt: skip
            assert got == status and (status != 200 or out["model"] == "a"), out
    finally:
        handle.shutdown(timeout=0)


def test_template_variables_stack_defaults_then_reasoning_effort_then_the_requests_own():
    """--default-chat-template-kwargs, then a request's reasoning_effort (chat's field, and what a Responses
    request's reasoning.effort becomes), then its own chat_template_kwargs, each over the one before."""
    from trtpaged.server.protocol import chat_options
    from trtpaged.server.schemas import ChatCompletionRequest

    def kwargs(**body):
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)
        return chat_options(req, {"reasoning_effort": "low", "enable_thinking": False})["template_kwargs"]

    assert kwargs() == {"reasoning_effort": "low", "enable_thinking": False}
    assert kwargs(reasoning_effort="high") == {"reasoning_effort": "high", "enable_thinking": False}
    assert kwargs(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "mid"}) == \
        {"reasoning_effort": "mid", "enable_thinking": False}  # fmt: skip
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat_options(req)["template_kwargs"] is None  # nothing set: none


@pytest.mark.parametrize("args, words", [
    (["--block-size", "32"], "--block-size: 32, but the engine was built with 16"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype: 'fp8', but the engine was built with"),
    (["--quantization", "awq"], "--quantization: 'awq', but the engine was built with"),
    (["--tokenizer", "/elsewhere"], "--tokenizer: '/elsewhere'; an engine dir carries its own tokenizer"),
    (["--pipeline-parallel-size", "2"], "only 1 here (layers are not split into pipeline stages"),
    (["--data-parallel-size", "4"], "only 1 here (one engine per server"),
    (["--tokenizer-mode", "mistral"], "only auto or hf here"),
    (["--guided-decoding-backend", "outlines"], "only auto or xgrammar here"),
])  # fmt: skip
def test_vllm_flags_fixed_by_the_build_or_this_server_are_refused_unless_they_match(tiny_engine_dir, args, words):
    """A vLLM launch line's engine settings are checked against the engine dir (built with block size 16, no
    quantization, its own tokenizer) and its other settings against what this server does: a value that matches
    starts the server (below), any other is refused before serving, naming the flag."""
    result = CliRunner().invoke(main, ["serve", str(tiny_engine_dir), "--device", "cpu", "--port", "0", *args])
    assert result.exit_code != 0 and words in result.output, result.output


def test_force_include_usage_and_tokens_as_ids_by_default(tiny_engine_dir):
    """vLLM's --enable-force-include-usage: a stream that did not ask for usage ends with the usage chunk, counting
    what it streamed; --return-tokens-as-token-ids: log-probs name tokens "token_id:<id>" (the ids the answer's
    return_token_ids gives), unless the request's own field is false."""
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(enable_force_include_usage=True, return_tokens_as_token_ids=True))
    try:
        client = openai_client(handle.url)
        chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=5, stream=True,
                                                extra_body={"ignore_eos": True}))  # fmt: skip
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        assert all(c.usage is None for c in chunks[:-1])
        out = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, logprobs=1,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        ids = out.choices[0].token_ids
        assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
        plain = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, logprobs=1,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": False})
        assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)
        wait_idle(handle)
    finally:
        handle.shutdown(timeout=0)
