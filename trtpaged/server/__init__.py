"""The OpenAI-compatible HTTP server: `trtpaged serve ENGINE` or `start_server(engine_dir)`.

schemas (pydantic bodies) -> protocol (request -> prompts and sampling fields) -> generation (one
request against the engine) -> engine_loop (the one thread that owns the LLMEngine); app routes
(FastAPI), server runs it on uvicorn, metrics exposes prometheus-client metrics.
"""

from __future__ import annotations

from trtpaged.server.options import ServerOptions
from trtpaged.server.server import AddressInUse, ServerHandle, start_server

__all__ = ["AddressInUse", "ServerHandle", "ServerOptions", "start_server"]
