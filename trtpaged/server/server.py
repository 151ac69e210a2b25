"""Wiring: an engine dir -> LLM -> engine thread -> HTTP server, and a handle to stop them."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Optional, Union

from trtpaged.runtime.llm import LLM
from trtpaged.server.engine_loop import EngineLoop
from trtpaged.server.generation import GenerationService
from trtpaged.server.http_app import AppServer, ModelCard, OpenAIApp
from trtpaged.server.metrics import ServerMetrics


class ServerHandle:
    """A running server: its URL, the `LLM` it serves, and `shutdown()`."""

    def __init__(self, httpd: AppServer, loop: EngineLoop, llm: LLM, model_name: str) -> None:
        self.httpd = httpd
        self.loop = loop
        self.llm = llm
        self.model_name = model_name
        host, port = httpd.server_address[:2]
        self.host, self.port = str(host), int(port)
        self.url = f"http://{self.host}:{self.port}"
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="trtpaged-http", daemon=True)
        self._closed = False

    def start(self) -> "ServerHandle":
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stops accepting requests, ends those in flight (they get an error) and stops the engine thread."""
        if self._closed:
            return
        self._closed = True
        self.httpd.shutdown()
        self.loop.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def start_server(
    engine_dir: Union[str, Path],
    host: str = "127.0.0.1",
    port: int = 0,
    served_model_name: Optional[str] = None,
    **llm_overrides: Any,
) -> ServerHandle:
    """Loads the engine and serves it in background threads; returns once it accepts connections.

    `port=0` picks a free port (see `handle.url`). `llm_overrides` go to `LLM(...)`: backend, device,
    num_kv_blocks, max_num_tokens, max_batch_size, max_seq_len, enable_prefix_caching, ...
    """
    llm = LLM(engine_dir, **llm_overrides)
    name = served_model_name or llm.engine_dir.resolve().name
    metrics = ServerMetrics()
    loop = EngineLoop(llm.engine, metrics)
    service = GenerationService(llm, loop, name)
    card = ModelCard(name, str(llm.engine_dir), int(time.time()), llm.config.max_seq_len)
    httpd = AppServer((host, port), OpenAIApp(service, loop, metrics, card))
    loop.start()
    return ServerHandle(httpd, loop, llm, name).start()
