"""Wiring: bind the socket -> load the engine -> engine thread -> tokenizer threads -> uvicorn; and a handle to
stop them."""

from __future__ import annotations

import errno
import logging
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import uvicorn

from trtpaged.runtime.llm import LLM
from trtpaged.server.app import Draining, create_app
from trtpaged.server.engine_loop import EngineLoop
from trtpaged.server.generation import GenerationService
from trtpaged.server.http_protocol import BoundedHeadProtocol
from trtpaged.server.metrics import ServerMetrics
from trtpaged.server.options import ServerOptions, one_or_many
from trtpaged.server.request_log import RequestLog
from trtpaged.server import thread_names, thread_pinning
from trtpaged.server.schemas import ModelCard
from trtpaged.server.tls import check_tls, uvicorn_tls
from trtpaged.server.tokenizer_worker import TokenizerWorker

log = logging.getLogger("trtpaged.server")


class AddressInUse(OSError):
    """The host:port to serve on is taken (checked before the model loads)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port); names the address when it fails."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise AddressInUse(exc.errno,
                               f"cannot serve on {where}: address already in use (pick another --port)") from None
        raise OSError(exc.errno, f"cannot serve on {where}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


class ServerHandle:
    """A running server: its URL, the `LLM` it serves, and `shutdown()`."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, loop: EngineLoop, tokens: TokenizerWorker,
                 llm: LLM, model_name: str, options: ServerOptions, draining: Draining,
                 https: bool = False) -> None:  # fmt: skip
        self.server, self.loop, self.tokens, self.llm, self.model_name = server, loop, tokens, llm, model_name
        self.request_log = loop.request_log
        self.options, self.draining = options, draining
        host, port = sock.getsockname()[:2]
        self.host, self.port = str(host), int(port)
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"{'https' if https else 'http'}://{shown}:{self.port}"
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name=thread_names.HTTP, daemon=True)
        self._closed = False
        self._drain_cut = threading.Event()  # set: the drain ends now (a second Ctrl-C)
        self.pinning: Optional[thread_pinning.Pinning] = None  # set by start()

    def _serve(self) -> None:
        thread_names.name_this_thread(thread_names.HTTP)
        self.server.run(sockets=[self._sock])

    def start(self, timeout: float = 30.0) -> "ServerHandle":
        """Starts uvicorn's thread and returns once it accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.loop.shutdown()
                self.tokens.shutdown()
                if self.request_log is not None:
                    self.request_log.close()
                raise RuntimeError("the HTTP server did not start (see the log)")
            time.sleep(0.01)
        self.pinning = thread_pinning.pin_server_threads(self.options.pin_threads, self.loop.thread_id,
                                                         self._thread.native_id)  # fmt: skip
        if self.pinning is not None:  # a team the CPU thread budget grows again starts workers on the front core
            self.loop.after_step = thread_pinning.WorkerPins(self.pinning, self.loop.thread_id).after_step
        return self

    @property
    def failure(self) -> Optional[str]:
        """Why the engine stopped for good (a tensor-parallel rank died), or None while it can run."""
        return self.loop.fatal

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Refuses new requests (503), lets those in flight finish for up to `timeout` seconds (default:
        options.shutdown_timeout_s), aborts the rest, then stops the engine thread and the HTTP server."""
        if self._closed:
            return
        self._closed = True
        self.draining.event.set()
        deadline = time.monotonic() + (self.options.shutdown_timeout_s if timeout is None else timeout)
        while self.loop.num_in_flight and time.monotonic() < deadline and not self._drain_cut.is_set():
            self._drain_cut.wait(0.05)
        if self.loop.num_in_flight:
            log.warning("shutdown: aborting %d requests still in flight", self.loop.num_in_flight)
        self.loop.shutdown()  # what is left ends with ShuttingDown (an error event / 503) and frees its blocks
        self.tokens.shutdown(1.0)  # its queued jobs end with ShuttingDown; one running a long text is left to end
        if self.request_log is not None:
            self.request_log.close()
        self.server.should_exit = True
        self._thread.join(10.0)
        self._sock.close()
        self.llm.close()  # the other tensor-parallel ranks

    def cut_drain(self) -> None:
        """Ends a `shutdown`'s wait for the requests in flight at once: they are aborted (what a second Ctrl-C or
        SIGTERM to `trtpaged serve` does, as uvicorn's own second signal forces its exit)."""
        self._drain_cut.set()

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def start_server(
    engine_dir: Union[str, Path],
    host: str = "127.0.0.1",
    port: int = 0,
    served_model_name: Union[str, Sequence[str], None] = None,
    options: Optional[ServerOptions] = None,
    **llm_overrides: Any,
) -> ServerHandle:
    """Binds host:port, loads the engine and serves it in background threads; returns once it accepts connections.

    The address is bound before the model loads, so a port in use fails at once (`AddressInUse`).
    `port=0` picks a free port (see `handle.url`). `llm_overrides` go to `LLM(...)`: backend, device,
    num_kv_blocks, max_num_tokens, max_batch_size, max_seq_len, enable_prefix_caching, ...
    """
    options = options or ServerOptions()
    tls = (options.ssl_keyfile, options.ssl_certfile, options.ssl_ca_certs, options.ssl_cert_reqs)
    https = check_tls(*tls)  # before the model loads: a wrong file fails at once
    if options.reasoning_parser is not None:  # the engine's too: thinking_token_budget reads its tags
        llm_overrides.setdefault("reasoning_parser", options.reasoning_parser)
    sock = bind(host, port)
    request_log = None
    metrics = ServerMetrics()
    try:
        # opened before the model loads, so a path that cannot be written fails at once
        request_log = RequestLog(options.request_log, options.request_log_prompts) if options.request_log else None
        # loaded on the engine thread: the one thread whose OpenMP pool runs the kernels (see start_loaded)
        llm, loop = EngineLoop.start_loaded(lambda: LLM(engine_dir, **llm_overrides), lambda llm: llm.engine,
                                            metrics, options.max_waiting, request_log)  # fmt: skip
    except BaseException:
        sock.close()
        if request_log is not None:
            request_log.close()
        raise
    # vLLM's --served-model-name a b: a request may name any; answers carry the first
    names = one_or_many(served_model_name) or options.served_model_names or (llm.engine_dir.resolve().name,)
    name = names[0]
    metrics.set_model_name(name, llm.engine.config.max_seq_len)
    tokens: Optional[TokenizerWorker] = None
    try:  # the front end's own tokenizer copies, loaded from the engine dir as LLM loaded the engine's
        tokens = TokenizerWorker.start(llm.new_tokenizer, options.max_waiting)
        service = GenerationService(llm, loop, tokens, names, options.max_prompt_tokens, options.request_timeout_s,
                                    options.stream_interval, options.tool_call_parser,
                                    options.default_chat_template_kwargs,
                                    options.enable_prompt_tokens_details, options.enable_force_include_usage,
                                    options.return_tokens_as_token_ids,
                                    options.trust_request_chat_template,
                                    options.max_logprob_entries)  # fmt: skip
    except BaseException:
        if tokens is not None:
            tokens.shutdown()
        loop.shutdown()
        llm.close()
        sock.close()
        if request_log is not None:
            request_log.close()
        raise
    cards = [ModelCard(id=n, created=int(time.time()), root=str(llm.engine_dir), max_model_len=llm.config.max_seq_len)
             for n in names]  # fmt: skip
    draining = Draining()
    app = create_app(service, loop, metrics, cards, options, draining)
    # "auto": uvloop's event loop and httptools' parser (installed with trtpaged), which spend less CPU per
    # streamed chunk than asyncio's loop and h11, CPU the kernels' threads share (docs/benchmarks.md)
    # a closed stdout (a daemon's `>&-`) is no terminal: uvicorn's default asks sys.stdout.isatty() of None and fails
    config = uvicorn.Config(app, loop="auto", http=BoundedHeadProtocol, log_level="warning", access_log=False,
                            lifespan="off", timeout_keep_alive=30, timeout_graceful_shutdown=5,
                            use_colors=False if sys.stdout is None else None, **uvicorn_tls(*tls))  # fmt: skip
    server = uvicorn.Server(config)
    return ServerHandle(server, sock, loop, tokens, llm, name, options, draining, https).start()
