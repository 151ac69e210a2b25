"""`trtpaged serve ENGINE`: an OpenAI-compatible HTTP server over an engine dir."""

from __future__ import annotations

import logging
import signal
import threading

import click


@click.command(name="serve")
@click.argument("engine", type=click.Path(exists=True))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to bind (0: any free port).")
@click.option("--served-model-name", default=None, help="Model name clients send and /v1/models lists (default: the engine dir's name).")
@click.option("--max-batch-size", type=int, default=None, help="Sequences per step (at most the engine's build limit).")
@click.option("--max-num-tokens", type=int, default=None, help="Tokens per step (at most the engine's build limit).")
@click.option("--max-seq-len", type=int, default=None, help="Prompt + output tokens per sequence (at most the build limit).")
@click.option("--kv-blocks", type=int, default=None, help="KV-cache blocks in the pool (default: the manifest's budget).")
@click.option("--backend", type=click.Choice(["auto", "torch", "tensorrt"]), default="auto", show_default=True)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when present).")
def command(engine, host, port, served_model_name, max_batch_size, max_num_tokens, max_seq_len, kv_blocks, backend, device) -> None:
    """Serve ENGINE over /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics."""
    from trtpaged.server import start_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        handle = start_server(
            engine, host=host, port=port, served_model_name=served_model_name, backend=backend, device=device,
            num_kv_blocks=kv_blocks, max_num_tokens=max_num_tokens, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
        )
    except (ValueError, FileNotFoundError, OSError) as e:
        raise click.ClickException(str(e)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    click.echo(f"trtpaged serve: {handle.model_name} ready at {handle.url} (Ctrl-C to stop)")
    while not stop.wait(0.5):
        pass
    click.echo("trtpaged serve: shutting down", err=True)
    handle.shutdown()
