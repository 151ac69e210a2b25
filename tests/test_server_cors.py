"""CORS (vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials) on a real server: a
browser's preflight and its request, checked against the Fetch standard's headers. By default only pages served
from this machine may call the API; vLLM's "*" and a named list are what the flags set."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tests.test_server import request
from trtpaged.cli import main
from trtpaged.commands.option_types import JsonStringList
from trtpaged.server import ServerOptions, start_server

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _preflight(handle, origin: str, headers: str = "authorization, content-type"):
    return request(handle, "/v1/chat/completions", method="OPTIONS",
                   headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                            "Access-Control-Request-Headers": headers})  # fmt: skip


@pytest.fixture(scope="module")
def default_server(tiny_engine_dir):
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(api_key="sk-cors"))  # fmt: skip
    yield handle
    handle.shutdown(timeout=0)


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:8080", "https://localhost",
                                    "http://[::1]:3000"])  # fmt: skip
def test_pages_of_this_machine_may_call_by_default(default_server, origin):
    """A preflight from a loopback page is allowed without the key (browsers send none on it); the request itself
    still needs the key and carries the origin and the exposed X-Request-Id."""
    status, headers, _ = _preflight(default_server, origin)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == origin
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
    status, headers, _ = request(default_server, "/v1/chat/completions", CHAT, headers={"Origin": origin})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == origin
    status, headers, out = request(default_server, "/v1/chat/completions", CHAT,
                                   headers={"Origin": origin, "Authorization": "Bearer sk-cors"})  # fmt: skip
    assert status == 200 and headers["Access-Control-Allow-Origin"] == origin, out
    assert "x-request-id" in headers["Access-Control-Expose-Headers"].lower() and headers["X-Request-Id"]


@pytest.mark.parametrize("origin", ["https://example.com", "http://localhost.example.com", "http://127.0.0.1.nip.io",
                                    "null"])  # fmt: skip
def test_other_origins_are_refused_by_default(default_server, origin):
    """Any other page (a look-alike host name included) gets no allowance: its preflight fails and a simple request
    is answered without Access-Control-Allow-Origin, so the browser keeps the answer from the page."""
    status, headers, _ = _preflight(default_server, origin)
    assert status == 400 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = request(default_server, "/v1/models", headers={"Origin": origin,
                                                                        "Authorization": "Bearer sk-cors"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_vllm_flags_allow_any_or_named_origins(tiny_engine_dir):
    """--allowed-origins '["*"]' (vLLM's default) allows every page; a list allows those, and with
    --allow-credentials the origin is echoed (a browser refuses "*" with credentials); --allowed-methods limits
    what a preflight may ask."""
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(allowed_origins=("*",)))  # fmt: skip
    try:
        status, headers, _ = _preflight(handle, "https://example.com")
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
        status, headers, _ = request(handle, "/v1/chat/completions", CHAT, headers={"Origin": "https://example.com"})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    finally:
        handle.shutdown(timeout=0)
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(allowed_origins=("https://app.example",), allowed_methods=("GET",),
                                                allow_credentials=True))  # fmt: skip
    try:
        status, headers, _ = request(handle, "/v1/models", headers={"Origin": "https://app.example"})
        assert headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert headers["Access-Control-Allow-Credentials"] == "true"
        assert _preflight(handle, "https://app.example")[0] == 400  # POST is not among the allowed methods
        assert _preflight(handle, "http://localhost:5173")[0] == 400  # a list replaces the loopback default
    finally:
        handle.shutdown(timeout=0)


@pytest.mark.parametrize("typed,parsed", [('["*"]', ("*",)), ('["https://a.example", "http://b:1"]',
                                          ("https://a.example", "http://b:1")), ("https://a.example,http://b:1",
                                          ("https://a.example", "http://b:1")), ("*", ("*",))])  # fmt: skip
def test_origin_lists_read_as_vllm_writes_them_or_comma_separated(typed, parsed):
    assert JsonStringList().convert(typed, None, None) == parsed


@pytest.mark.parametrize("value,words", [("[1]", "list of strings"), ('["a", ""]', "no empty"), ("[", "not JSON"),
                                         (",", "no empty")])  # fmt: skip
def test_serve_refuses_a_bad_origin_list_naming_the_flag(tiny_engine_dir, value, words):
    result = CliRunner().invoke(main, ["serve", str(tiny_engine_dir), "--allowed-origins", value])
    assert result.exit_code == 2 and "--allowed-origins" in result.output and words in result.output, result.output
