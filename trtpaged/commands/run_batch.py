"""`trtpaged run-batch ENGINE -i requests.jsonl -o results.jsonl`: OpenAI's batch file format, as vLLM's run-batch.

The engine is served on a loopback port for the run (behind a random key), and each line's request goes through
that server, so a batch line is answered exactly as the same request to `trtpaged serve` would be
(`trtpaged.server.batch_file`).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import click

from trtpaged.commands.option_types import ChatTemplate, HumanInt, flag_error
from trtpaged.commands.stdout import echo
from trtpaged.manifest import BACKENDS

FLAGS = {"device": "--device", "backend": "--backend", "num_kv_blocks": "--num-kv-blocks",
         "max_batch_size": "--max-num-seqs", "max_seq_len": "--max-model-len", "chat_template": "--chat-template",
         "tool_call_parser": "--tool-call-parser", "reasoning_parser": "--reasoning-parser"}  # fmt: skip


@click.command(name="run-batch")
@click.argument("engine", type=click.Path(exists=True), required=False)
@click.option("--model", "model", type=click.Path(exists=True), default=None,
              help="vLLM's spelling of ENGINE (the engine dir).")
@click.option("-i", "--input-file", required=True, metavar="PATH",
              help="JSON Lines of requests (custom_id, method, url, body); - reads stdin.")
@click.option("-o", "--output-file", required=True, metavar="PATH",
              help="JSON Lines of results, one per request in the input's order; - writes stdout. Written whole "
                   "at the end (never half a file).")
@click.option("--served-model-name", default=None, help="The model name requests give (default: the engine's).")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None,
              help="Requests in flight at once (default: twice the engine's batch size).")
@click.option("--max-num-seqs", "max_batch_size", type=click.IntRange(min=1), default=None,
              help="Sequences in a batch (at most the build limit).")
@click.option("--max-model-len", "max_seq_len", type=HumanInt(), default=None,
              help="Prompt + output tokens per sequence (at most the build limit).")
@click.option("--num-kv-blocks", type=click.IntRange(min=1), default=None, help="KV-cache blocks in the pool.")
@click.option("--chat-template", type=ChatTemplate(), default=None, metavar="FILE_OR_TEXT",
              help="A Jinja chat template (a file, or the text) replacing the engine's.")
@click.option("--tool-call-parser", default=None, metavar="NAME", help="vLLM's name of the model's tool-call format.")
@click.option("--reasoning-parser", default=None, metavar="NAME", help="vLLM's name of the model's reasoning format.")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when present).")
def command(engine, model, input_file, output_file, served_model_name, max_concurrency, max_batch_size, max_seq_len,
            num_kv_blocks, chat_template, tool_call_parser, reasoning_parser, backend, device) -> None:  # fmt: skip
    """Answer a file of OpenAI batch requests (chat, completions, responses, messages), as vLLM's run-batch."""
    if (engine is None) == (model is None):
        raise click.UsageError("give the engine dir once: ENGINE or --model")
    engine = engine or model
    lines = _read(input_file)
    _check_writable(output_file)  # before the batch runs, not after (hours of answers lost to a typo)
    from trtpaged.server import ServerOptions, batch_file, start_server

    requests = batch_file.parse_lines(lines)
    key = secrets.token_hex(16)
    try:
        options = ServerOptions(api_key=key, max_waiting=None, request_timeout_s=None,
                                tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)  # fmt: skip
        handle = start_server(engine, port=0, served_model_name=served_model_name, options=options, backend=backend,
                              device=device, num_kv_blocks=num_kv_blocks, max_batch_size=max_batch_size,
                              max_seq_len=max_seq_len, chat_template=chat_template)  # fmt: skip
    except (ValueError, FileNotFoundError, OSError) as e:
        raise click.ClickException(flag_error(str(e), FLAGS)) from None
    start = time.monotonic()
    try:
        concurrency = max_concurrency or 2 * handle.llm.config.max_batch_size
        outputs = _run(requests, handle.url, concurrency, key)
    finally:
        handle.shutdown(timeout=0)
    _write(output_file, outputs)
    ok = sum(1 for o in outputs if o["response"] is not None and o["response"]["status_code"] == 200)
    click.echo(f"run-batch: {len(outputs)} requests, {ok} answered, {len(outputs) - ok} failed, "
               f"{time.monotonic() - start:.1f} s -> {output_file}", err=True)


def _read(path: str) -> list[str]:
    """The input's lines; BadParameter naming --input-file for a file that cannot be read, is not UTF-8 text (a
    compressed one named as such, with the command that gives its text) or holds no request."""
    from trtpaged.bench.workload import not_utf8, packed_form

    expected = "JSON Lines of batch requests"
    try:
        # stdin's bytes, decoded strictly: its text stream replaces what is not UTF-8 (surrogateescape in a C.UTF-8
        # locale), and a gzip'd file piped in was read as lines of garbage, each answered "not JSON", exit 0
        text = sys.stdin.buffer.read().decode("utf-8") if path == "-" else Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        if path != "-":
            raise click.BadParameter(str(not_utf8(path, expected)), param_hint="--input-file") from None
        what, advice = packed_form(e.object[:6]) or ("", "")
        raise click.BadParameter(f"stdin: {what + ', ' if what else ''}not UTF-8 text ({e.reason} at byte {e.start})"
                                 f"{': ' + advice.replace(' FILE', '') if advice else ''}; expected {expected}",
                                 param_hint="--input-file") from None  # fmt: skip
    except OSError as e:
        raise click.BadParameter(f"cannot read {path!r}: {e}", param_hint="--input-file") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark (Windows editors write one) is no part of line 1's JSON
    if not text.strip():
        raise click.BadParameter(f"{path!r} holds no request (a batch file is JSON Lines, one request a line)",
                                 param_hint="--input-file")  # fmt: skip
    # lines end at "\n" (JSON Lines) only: str.splitlines also cut at U+2028, U+2029, U+0085 and \x1c-\x1e, which a
    # JSON string may hold unescaped (json.dumps(ensure_ascii=False)), one request read as several broken lines
    return [line.removesuffix("\r") for line in text.split("\n")]


def _check_writable(path: str) -> None:
    if path == "-":
        if sys.stdout is None:  # started with stdout closed (>&-): was an obscure uvicorn logging error
            raise click.BadParameter("'-' is stdout, which is closed: nowhere to write the results",
                                     param_hint="--output-file")  # fmt: skip
        return
    target = Path(path)
    parent = target.parent  # "." for a bare file name
    if target.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise click.BadParameter(f"cannot write {path!r} (a directory, or a folder that is missing or not writable)",
                                 param_hint="--output-file")  # fmt: skip


def _run(requests: list[Any], url: str, concurrency: int, key: str) -> list[dict[str, Any]]:
    from tqdm import tqdm

    from trtpaged.server import batch_file

    with tqdm(total=len(requests), desc="run-batch", unit="req", file=sys.stderr, disable=None) as bar:
        return asyncio.run(batch_file.run(requests, url, concurrency, {"Authorization": f"Bearer {key}"},
                                          lambda: bar.update(1)))  # fmt: skip


def _write(path: str, outputs: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(o) + "\n" for o in outputs)  # ASCII: a lone surrogate an answer echoes stays valid
    if path == "-":
        echo(text, nl=False)
        return
    target = Path(path)
    tmp: Optional[str] = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        os.fchmod(fd, _file_mode(target))  # mkstemp's 0600 would leave the results readable by their owner alone
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise click.ClickException(f"--output-file: cannot write {path!r}: {e.strerror or e}") from None


def _file_mode(target: Path) -> int:
    """The mode open(target, "w") would leave: the existing file's, or 0666 less the umask for a new one."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
