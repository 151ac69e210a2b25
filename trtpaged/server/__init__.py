"""The OpenAI-compatible HTTP server: `trtpaged serve ENGINE` or `start_server(engine_dir)`.

protocol (request parsing) -> generation (one request against the engine) -> engine_loop (the one
thread that owns the LLMEngine); http_app routes and streams, metrics writes Prometheus text.
"""

from __future__ import annotations

from trtpaged.server.server import ServerHandle, start_server

__all__ = ["ServerHandle", "start_server"]
