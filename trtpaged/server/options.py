"""The server's own settings (the engine's are `LLM(...)` arguments)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from trtpaged.runtime.llm import TEMPLATE_ARGUMENTS
from trtpaged.runtime.reasoning import REASONING_PARSERS
from trtpaged.server.tool_parsers import PARSER_NAMES

API_KEY_ENVS = ("TRTPAGED_API_KEY", "VLLM_API_KEY")  # the first set wins; vLLM's name, so that a vLLM deployment's
# secret still guards the server (it served without a key)
PIN_MODES = ("auto", "on", "off")  # ServerOptions.pin_threads
VLLM_STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
DEFAULT_RESPONSES_STORE_SIZE = 256 << 20  # what vLLM's switch keeps here (vLLM's own store has no bound)
# the browser origins allowed by default: pages served from this machine (any port), as Ollama's default; vLLM
# allows every origin ("*"), which lets any web page a user opens read the answers of a server on their loopback.
# (A page that rebinds its own host name to 127.0.0.1 is same-origin and needs no CORS: --api-key guards that.)
LOOPBACK_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]{1,5})?"


@dataclass(frozen=True)
class ServerOptions:
    """Limits, security and shutdown behaviour of one server.

    `api_key` (default: $TRTPAGED_API_KEY, else vLLM's $VLLM_API_KEY) is required as `Authorization: Bearer KEY`
    on /v1/*, /tokenize, /detokenize and /invocations when set.
    `max_waiting` bounds the engine's waiting queue (beyond it: 503 with Retry-After); None: no bound.
    `request_timeout_s` aborts a request that runs longer (504); `body_timeout_s` ends a request whose
    body arrives slower (408). `shutdown_timeout_s` is how long shutdown lets requests in flight finish.
    `request_log`: a JSON Lines file that gets one line per request that ended, finished or aborted (appended; see
    `trtpaged.server.request_log`); `request_log_prompts` adds the prompt token ids to each line.
    `max_logprob_entries`: the most log-prob entries (a token's own, or one of its top-k) one answer may hold,
    checked before a request runs (400 beyond; `trtpaged.server.large_answers`); None: MAX_LOGPROB_ENTRIES, or
    one prompt of the whole context at up to 20 top log-probs where that is more.
    `stream_interval`: tokens per streamed chunk (a stream's first token and its end go at once): fewer,
    longer chunks cost the server's event loop and the clients less CPU per token; 1 (default): one per token.
    `pin_threads` ("auto", "on", "off"): the engine thread and the event loop's thread on one core, the kernels'
    OpenMP workers on the others (`trtpaged.server.thread_pinning`); "auto" when the team fills every core.
    `tool_call_parser` (vLLM's --tool-call-parser: hermes, llama3_json, mistral, phi4_mini_json, pythonic) is the format
    `tool_choice: "auto"` reads calls in; None: the one the chat template shows (`trtpaged.server.tools`).
    `reasoning_parser` (vLLM's --reasoning-parser: deepseek_r1, qwen3) splits a chat answer's reasoning from its
    content (`trtpaged.server.reasoning`); None: the whole text is content.
    `default_chat_template_kwargs` (vLLM's --default-chat-template-kwargs): chat template variables every chat
    request (and /tokenize of messages) gets; a request's own chat_template_kwargs override them key by key.
    `enable_prompt_tokens_details` (vLLM's --enable-prompt-tokens-details): chat and completions usage carries
    `prompt_tokens_details.cached_tokens`, the prompt's tokens found in the prefix cache (else null).
    `enable_force_include_usage` (vLLM's --enable-force-include-usage): every stream ends with its usage chunk, as
    `stream_options.include_usage` asks; `return_tokens_as_token_ids` (vLLM's flag of that name): log-probs name
    tokens "token_id:<id>" unless a request's own field says otherwise.
    `allowed_origins` (vLLM's --allowed-origins): the web origins whose pages may call the API from a browser
    (CORS), "*" for any; None: pages served from this machine only (LOOPBACK_ORIGINS). `allowed_methods`,
    `allowed_headers` and `allow_credentials` (cookies, HTTP auth) are the rest of vLLM's CORS settings.
    `ssl_certfile` and `ssl_keyfile` (vLLM's --ssl-certfile, --ssl-keyfile: PEM files, the key without a passphrase)
    serve HTTPS; `ssl_ca_certs` and `ssl_cert_reqs` (0 none, 1 optional, 2 required) ask clients for certificates
    signed by those CAs (`trtpaged.server.tls`). `root_path` (vLLM's --root-path): the path prefix a reverse proxy
    serves this server under; requests are answered with or without it. `trust_request_chat_template` (vLLM's
    --trust-request-chat-template): a chat request's own `chat_template` renders its conversation (else refused).
    `responses_store_size`: bytes of finished Responses kept in memory for GET /v1/responses/{id},
    `previous_response_id` and `background` (`trtpaged.server.responses_store`); None: none are kept, unless
    $VLLM_ENABLE_RESPONSES_API_STORE (vLLM's switch) is 1, which keeps DEFAULT_RESPONSES_STORE_SIZE.
    """

    served_model_name: Union[str, tuple[str, ...], None] = None  # several: aliases, any of which a request may name
    api_key: Union[str, tuple[str, ...], None] = None  # several: any of them is accepted (vLLM's --api-key k1 k2)
    max_waiting: Optional[int] = 256
    max_body_bytes: int = 8 << 20
    max_prompt_tokens: Optional[int] = None
    max_logprob_entries: Optional[int] = None
    request_timeout_s: Optional[float] = 600.0
    body_timeout_s: float = 30.0
    shutdown_timeout_s: float = 30.0
    retry_after_s: int = 1
    request_log: Optional[str] = None
    request_log_prompts: bool = False
    stream_interval: int = 1
    pin_threads: str = "auto"
    tool_call_parser: Optional[str] = None  # vLLM's name of the tool-call format; None: read from the chat template
    reasoning_parser: Optional[str] = None  # vLLM's name of the reasoning format; None: no reasoning is split off
    default_chat_template_kwargs: Optional[dict[str, Any]] = None  # e.g. {"enable_thinking": False}
    responses_store_size: Optional[int] = None
    enable_prompt_tokens_details: bool = False  # vLLM's: usage.prompt_tokens_details.cached_tokens in answers
    enable_force_include_usage: bool = False  # vLLM's: every stream ends with a usage chunk, asked for or not
    return_tokens_as_token_ids: bool = False  # vLLM's: the default of the request field of that name
    allowed_origins: Optional[tuple[str, ...]] = None  # CORS; None: LOOPBACK_ORIGINS
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    ssl_keyfile: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_ca_certs: Optional[str] = None
    ssl_cert_reqs: int = 0
    root_path: str = ""
    trust_request_chat_template: bool = False

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys a request may send, any of them (none: no key required)."""
        return one_or_many(self.api_key)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The names a request may give as its model (none: the server's default name)."""
        return one_or_many(self.served_model_name)

    def __post_init__(self) -> None:
        key = next((os.environ[name] for name in API_KEY_ENVS if os.environ.get(name)), None)
        if self.api_key is None and key:
            object.__setattr__(self, "api_key", key)
        if self.responses_store_size is None and os.environ.get(VLLM_STORE_ENV, "").strip().lower() in ("1", "true"):
            object.__setattr__(self, "responses_store_size", DEFAULT_RESPONSES_STORE_SIZE)
        checks = [
            ("max_waiting", self.max_waiting is None or self.max_waiting >= 1),
            ("max_body_bytes", self.max_body_bytes >= 1),
            ("max_prompt_tokens", self.max_prompt_tokens is None or self.max_prompt_tokens >= 1),
            ("max_logprob_entries", self.max_logprob_entries is None or self.max_logprob_entries >= 1),
            ("request_timeout_s", self.request_timeout_s is None or self.request_timeout_s > 0),
            ("body_timeout_s", self.body_timeout_s > 0),
            ("shutdown_timeout_s", self.shutdown_timeout_s >= 0),
            ("responses_store_size", self.responses_store_size is None or self.responses_store_size >= 1),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)!r}")
        interval = self.stream_interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"stream_interval: must be an integer >= 1 (tokens per streamed chunk), got {interval!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSER_NAMES:
            raise ValueError(f"tool_call_parser: {self.tool_call_parser!r:.40} is not a parser this server has; one "
                             f"of {', '.join(sorted(PARSER_NAMES))}")  # fmt: skip
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: {self.reasoning_parser!r:.40} is not a parser this server has; one "
                             f"of {', '.join(sorted(REASONING_PARSERS))}")  # fmt: skip
        defaults = self.default_chat_template_kwargs
        if defaults is not None:
            if not isinstance(defaults, dict) or not all(isinstance(k, str) for k in defaults):
                raise ValueError(f"default_chat_template_kwargs: must be a JSON object, got {defaults!r:.80}")
            reserved = sorted(set(defaults) & TEMPLATE_ARGUMENTS)
            if reserved:
                raise ValueError(f"default_chat_template_kwargs: may not set {reserved} (each request's own fields)")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            values = getattr(self, name)
            if values is not None and (not values or not all(isinstance(v, str) and v.strip() for v in values)):
                raise ValueError(f"{name}: must be a non-empty list of non-empty strings, got {values!r:.80}")
        if self.pin_threads not in PIN_MODES:
            raise ValueError(f"pin_threads: must be one of {', '.join(PIN_MODES)}, got {self.pin_threads!r}")
        if self.api_key is not None and not all(self.api_keys or [""]):
            raise ValueError("api_key: must not be empty")
        if self.served_model_name is not None and not all(n.strip() for n in self.served_model_names or [""]):
            raise ValueError("served_model_name: must not be empty")
        if self.request_log is not None and not str(self.request_log):
            raise ValueError("request_log: must not be empty")
        root = self.root_path
        if root == "/":  # no prefix (vLLM accepts it)
            root = ""
            object.__setattr__(self, "root_path", root)
        if not isinstance(root, str) or (root and (not root.startswith("/") or root.endswith("/") or "//" in root)):
            raise ValueError(f"root_path: must be a path such as /api (a leading /, no trailing /), got {root!r:.80}")
        if self.request_log_prompts and self.request_log is None:
            raise ValueError("request_log_prompts: needs request_log (a file to write the prompts to)")


def one_or_many(value: Union[str, Sequence[str], None]) -> tuple[str, ...]:
    """A name (or key) or several, as a tuple; () for None."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)
