"""`trtpaged serve ENGINE`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over an engine dir."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any, Iterator, Optional, Sequence

import click

from trtpaged.commands.option_types import (ChatTemplate, FiniteFloatRange, HumanInt, JsonObject, JsonStringList,
                                            OutputFile, Size, flag_error)
from trtpaged.commands.stdout import echo
from trtpaged.commands.vllm_flags import VllmArgsCommand, no_effect_note, vllm_no_effect_options
from trtpaged.errors import FatalEngineError, is_out_of_memory
from trtpaged.manifest import BACKENDS
from trtpaged.runtime.runtime_config import SCHEDULING_POLICIES


def _not_empty(value, param):
    """An empty --host bound every interface without a word (the default is loopback); an empty model name is no
    name a client can send."""
    values = value if isinstance(value, tuple) else (value,)
    if any(v is not None and not v.strip() for v in values):
        raise click.BadParameter("must not be empty", param=param)
    return value


@click.command(name="serve", cls=VllmArgsCommand)
@click.argument("engine", type=click.Path(exists=True))
@click.option("--host", default="127.0.0.1", show_default=True, callback=lambda ctx, p, v: _not_empty(v, p),
              help="Address to bind (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to bind (0: any free port).")
@click.option("--served-model-name", multiple=True, callback=lambda ctx, p, v: _not_empty(v, p),
              help="Model name clients send and /v1/models lists (default: the engine dir's name); several (vLLM's "
                   "`--served-model-name a b`): any of them, answers carry the first.")
@click.option("--api-key", multiple=True,
              help="Require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and /invocations (/health, "
                   "/ping, /metrics and /version stay open); several (vLLM's `--api-key k1 k2`): any of them. "
                   "Default: $TRTPAGED_API_KEY, else $VLLM_API_KEY.")
@click.option("--max-waiting", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests that may wait for admission (counted as they arrive, before the next step admits "
                   "any); beyond it: 503 with Retry-After.")
@click.option("--request-timeout", type=FiniteFloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds from a request's arrival, its wait for admission included, until it is aborted "
                   "(504).")
@click.option("--shutdown-timeout", type=FiniteFloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM/Ctrl-C: seconds requests in flight may finish before the rest are aborted (a "
                   "second signal aborts them at once).")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=8 << 20, show_default=True,
              help="Largest request body (413 beyond).")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=None,
              help="Longest prompt accepted (default and most: max_seq_len - 1).")
@click.option("--max-logprob-entries", type=click.IntRange(min=1), default=None,
              help="The most log-prob entries (each token's own and its top-k) one answer may hold, checked before "
                   "the request runs (400 beyond); default: 262144, or one prompt of max_seq_len tokens at 20 top "
                   "log-probs where that is more.")
@click.option("--max-batch-size", "--max-num-seqs", "max_batch_size", type=int, default=None,
              help="Sequences per step (at most the engine's build limit; --max-num-seqs: vLLM's spelling).")
@click.option("--max-num-tokens", "--max-num-batched-tokens", "max_num_tokens", type=HumanInt(), default=None,
              help="Tokens per step (at most the engine's build limit; --max-num-batched-tokens: vLLM's spelling).")
@click.option("--max-seq-len", "--max-model-len", "max_seq_len", type=HumanInt(), default=None,
              help="Prompt + output tokens per sequence (at most the build limit; --max-model-len: vLLM's spelling).")
@click.option("--num-kv-blocks", "--num-gpu-blocks-override", "num_kv_blocks", type=click.IntRange(min=1),
              default=None,
              help="KV-cache blocks in the pool (default: the manifest's budget); refused beyond the device's free "
                   "memory.")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True,
              help="Share the KV blocks of equal prompt prefixes between requests (vLLM's flag).")
@click.option("--scheduling-policy", type=click.Choice(SCHEDULING_POLICIES), default="fcfs", show_default=True,
              help="vLLM's: fcfs serves requests in arrival order (a request's priority must be 0); priority serves "
                   "lower `priority` values first, then arrival, and preempts the highest first.")
@click.option("--chat-template", type=ChatTemplate(), default=None,
              help="vLLM's: a Jinja chat template (a file's path, or the template's text) that replaces the engine's "
                   "for every chat request and /tokenize.")
@click.option("--chat-template-content-format", type=click.Choice(["auto", "string", "openai"]), default="auto",
              show_default=True,
              help="vLLM's: how the chat template gets a message's content: string (text parts joined by newlines) "
                   "or openai (a list of text parts); auto gives the parts to a template that loops over them.")
@click.option("--tool-call-parser", default=None, metavar="NAME",
              help="vLLM's: the format tool_choice \"auto\" reads calls in: hermes, llama3_json, mistral, "
                   "phi4_mini_json or pythonic (default: the one the chat template shows, else the model family's).")
@click.option("--reasoning-parser", default=None, metavar="NAME",
              help="vLLM's: split a reasoning model's thinking (<think>...</think>) from its answer in chat and "
                   "Responses answers: deepseek_r1 or qwen3 (qwen3 also reads chat_template_kwargs' enable_thinking).")
@click.option("--default-chat-template-kwargs", type=JsonObject(), default=None, metavar="JSON",
              help="vLLM's: chat template variables for every chat request, e.g. '{\"enable_thinking\": false}'; "
                   "a request's chat_template_kwargs override them key by key.")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="vLLM's: accepted; tool_choice \"auto\" is on wherever the model's tool-call format is known.")
@click.option("--max-logprobs", type=click.IntRange(min=-1), default=20, show_default=True,
              help="vLLM's: the most top log-probs per token a request may ask for (logprobs, top_logprobs, "
                   "prompt_logprobs); -1: the whole vocabulary.")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True,
              help="vLLM's: seeds the random generators once at start-up, so that requests without a seed of their "
                   "own draw the same tokens run after run.")
@click.option("--generation-config", type=click.Choice(["auto", "vllm"]), default="auto", show_default=True,
              help="vLLM's: auto samples with the model's recommended settings (its generation_config.json, recorded "
                   "by the build) where a request sets none, and caps max_tokens at its max_new_tokens; vllm uses "
                   "the API's defaults.")
@click.option("--gpu-memory-utilization", type=FiniteFloatRange(0.0, 1.0, min_open=True), default=None,
              help="vLLM's: accepted and checked, without effect: the KV pool is the engine's kv_cache budget "
                   "(--num-kv-blocks sets it).")
@click.option("--dtype", default=None, help="vLLM's: 'auto' or the engine's own dtype (set when it was built).")
@click.option("--kv-cache-dtype", default=None, help="vLLM's: 'auto' or the engine's own (set when it was built).")
@click.option("--quantization", "-q", default=None,
              help="vLLM's: the engine's own weight format (set when it was built).")
@click.option("--block-size", type=click.IntRange(min=1), default=None,
              help="vLLM's: the engine's own KV block size (set when it was built).")
@click.option("--tokenizer", default=None, help="vLLM's: the engine dir itself (it carries the tokenizer it was built "
              "with).")
@click.option("--swap-space", type=FiniteFloatRange(min=0), default=None, metavar="GIB",
              help="vLLM's: GiB of host memory for the KV blocks of preempted requests.")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when present).")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=None,
              help="Ranks of an engine built with tensor_parallel: N (default: the engine's). Local processes; with "
                   "torchrun's MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK set, the ranks join from other machines "
                   "and RANK > 0 serves no HTTP.")
@click.option("--speculative-config", default=None, metavar="JSON",
              help='Speculative decoding, a JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                   "(fields: method (ngram or draft_model), model (the draft engine dir), num_speculative_tokens, "
                   "prompt_lookup_min, prompt_lookup_max, disable_by_batch_size, verify_row_cost, draft_token_cost, "
                   "min_acceptance_rate; "
                   "docs/speculative.md).")
@click.option("--kv-host-memory", type=Size(), default=None, metavar="SIZE",
              help="KV tier: host memory for prefix blocks the pool evicts, e.g. 8GiB (docs/kv_tiers.md).")
@click.option("--kv-disk-path", type=click.Path(file_okay=False), default=None,
              help="KV tier: a directory for prefix blocks, kept across restarts (with --kv-disk-size).")
@click.option("--kv-disk-size", type=Size(), default=None, metavar="SIZE",
              help="KV tier: the disk directory's bound, e.g. 100GiB.")
@click.option("--kv-secret-file", type=click.Path(dir_okay=False), default=None,
              help="KV tiers: a file of 16+ secret bytes shared by the replicas; disk and Redis entries are signed "
                   "with it, so that no one without it can change answers through the store.")
@click.option("--kv-remote", default=None, metavar="URL",
              help="KV tier: a Redis server shared by replicas, redis://HOST:PORT[/DB].")
@click.option("--enable-prompt-tokens-details", is_flag=True,
              help="vLLM's: chat and completions usage carries prompt_tokens_details.cached_tokens, the prompt's "
                   "tokens found in the prefix cache.")
@click.option("--enable-force-include-usage", is_flag=True,
              help="vLLM's: every streamed chat or completions answer ends with its usage chunk, asked for or not.")
@click.option("--return-tokens-as-token-ids", is_flag=True,
              help="vLLM's: log-probs name tokens 'token_id:<id>' unless a request's own return_tokens_as_token_ids "
                   "says otherwise.")
@click.option("--responses-store-size", type=Size(), default=None, metavar="SIZE",
              help="Keep finished /v1/responses answers in memory, up to SIZE (e.g. 256MiB; least recently used "
                   "out), for GET /v1/responses/{id}, previous_response_id and background requests (default: none "
                   "kept, unless VLLM_ENABLE_RESPONSES_API_STORE=1, vLLM's switch: 256MiB).")
@click.option("--allowed-origins", type=JsonStringList(), default=None, metavar="LIST",
              help="vLLM's CORS setting: web origins whose pages may call the API from a browser, as a JSON list "
                   "or comma-separated; '[\"*\"]' for any (vLLM's default; default here: pages served from this "
                   "machine, http(s)://localhost, 127.0.0.1 or [::1] at any port).")
@click.option("--allowed-methods", type=JsonStringList(), default="*", show_default=True, metavar="LIST",
              help="vLLM's CORS setting: HTTP methods a browser page may use.")
@click.option("--allowed-headers", type=JsonStringList(), default="*", show_default=True, metavar="LIST",
              help="vLLM's CORS setting: request headers a browser page may send.")
@click.option("--allow-credentials", is_flag=True, help="vLLM's CORS setting: browser pages may send cookies and "
              "HTTP authentication.")
@click.option("--ssl-certfile", type=click.Path(dir_okay=False), default=None,
              help="vLLM's: serve HTTPS with this PEM certificate (chain) file.")
@click.option("--ssl-keyfile", type=click.Path(dir_okay=False), default=None,
              help="vLLM's: the certificate's private key, a PEM file without a passphrase (if not in the "
                   "certificate file).")
@click.option("--ssl-ca-certs", type=click.Path(dir_okay=False), default=None,
              help="vLLM's: CA certificates (PEM) that clients' certificates are checked against.")
@click.option("--ssl-cert-reqs", type=click.IntRange(0, 2), default=0, show_default=True,
              help="vLLM's: client certificates: 0 not asked for, 1 optional, 2 required (checked against "
                   "--ssl-ca-certs).")
@click.option("--root-path", default="", metavar="PATH",
              help="vLLM's: the path prefix a reverse proxy serves this server under (e.g. /api); requests are "
                   "answered with or without it.")
@click.option("--trust-request-chat-template", is_flag=True,
              help="vLLM's: a chat request's own chat_template renders its conversation (else such requests are "
                   "refused); only for clients trusted to run template code (sandboxed, time-limited).")
@click.option("--request-log", type=OutputFile(), default=None,
              help="Append one JSON line per request that ended (finished or aborted) to this file (arrival s, "
                   "lengths, n, beam width, prefix hits, finish reasons, latencies, step time): what `trtpaged "
                   "diagnose` reads.")
@click.option("--request-log-prompts", is_flag=True,
              help="With --request-log: also log each prompt's token ids (off by default: prompts may be private).")
@click.option("--stream-interval", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tokens per streamed chunk (a stream's first token and its end go at once); above 1, the server "
                   "and its clients spend less CPU per token.")
@click.option("--pin-threads", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="The engine thread and the event loop on one core, the kernels' OpenMP workers on the others; "
                   "auto: when the workers and the engine thread fill every core the process may use.")
@vllm_no_effect_options
def command(engine, host, port, served_model_name, api_key, max_waiting, request_timeout, shutdown_timeout,
            max_body_bytes, max_prompt_tokens, max_logprob_entries, max_batch_size, max_num_tokens, max_seq_len,
            num_kv_blocks,
            enable_prefix_caching, scheduling_policy, chat_template, chat_template_content_format, tool_call_parser,
            reasoning_parser, default_chat_template_kwargs, enable_auto_tool_choice, max_logprobs, seed,
            generation_config, gpu_memory_utilization, dtype, kv_cache_dtype, quantization, block_size, tokenizer,
            swap_space, backend,
            device, tensor_parallel_size, speculative_config, kv_host_memory, kv_disk_path, kv_disk_size, kv_remote,
            kv_secret_file, enable_prompt_tokens_details, enable_force_include_usage, return_tokens_as_token_ids,
            responses_store_size, allowed_origins, allowed_methods,
            allowed_headers, allow_credentials, ssl_certfile, ssl_keyfile, ssl_ca_certs, ssl_cert_reqs, root_path,
            trust_request_chat_template, request_log, request_log_prompts, stream_interval, pin_threads,
            **vllm_flags) -> None:  # fmt: skip
    """Serve ENGINE over /v1/completions, /v1/chat/completions, /v1/responses (and its input_tokens), Anthropic's
    /v1/messages (and its count_tokens), /v1/models, /tokenize, /detokenize, /version, /health, /metrics and
    SageMaker's /ping and /invocations."""
    from trtpaged.server import ServerOptions, start_server

    if "WORLD_SIZE" in os.environ and os.environ.get("RANK", "0") not in ("", "0"):  # a torchrun-style rank > 0
        from trtpaged.runtime.tp.worker import exit_process, main as worker_main

        exit_process(worker_main([str(engine)] + (["--device", device] if device else [])))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    raise_open_files_limit()
    ignored = no_effect_note(vllm_flags)
    if ignored:
        note(ignored)
    try:
        from trtpaged.runtime.speculative import SpeculativeConfig

        speculative_config = SpeculativeConfig.parse(speculative_config)  # refused before the model loads
        check_max_prompt_tokens(engine, max_prompt_tokens, max_seq_len)
        options = ServerOptions(
            api_key=api_key or None, max_waiting=max_waiting, request_timeout_s=request_timeout,
            shutdown_timeout_s=shutdown_timeout, max_body_bytes=max_body_bytes, max_prompt_tokens=max_prompt_tokens,
            max_logprob_entries=max_logprob_entries, request_log=request_log, request_log_prompts=request_log_prompts,
            stream_interval=stream_interval,
            pin_threads=pin_threads, tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
            default_chat_template_kwargs=default_chat_template_kwargs, responses_store_size=responses_store_size,
            enable_prompt_tokens_details=enable_prompt_tokens_details,
            enable_force_include_usage=enable_force_include_usage,
            return_tokens_as_token_ids=return_tokens_as_token_ids, allowed_origins=allowed_origins,
            allowed_methods=allowed_methods, allowed_headers=allowed_headers, allow_credentials=allow_credentials,
            ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile, ssl_ca_certs=ssl_ca_certs, ssl_cert_reqs=ssl_cert_reqs,
            root_path=root_path, trust_request_chat_template=trust_request_chat_template,
        )  # fmt: skip
        with interrupts_end_the_load():
            handle = start_server(
                engine, host=host, port=port, served_model_name=served_model_name or None, options=options,
                backend=backend,
                device=device, num_kv_blocks=num_kv_blocks, max_num_tokens=max_num_tokens,
                max_batch_size=max_batch_size, max_seq_len=max_seq_len, tensor_parallel=tensor_parallel_size,
                speculative_config=speculative_config,
                kv_tiers=tier_options(kv_host_memory, kv_disk_path, kv_disk_size, kv_remote, kv_secret_file),
                enable_prefix_caching=enable_prefix_caching, scheduling_policy=scheduling_policy,
                generation_config=generation_config, chat_template=chat_template,
                chat_template_content_format=chat_template_content_format, seed=seed,
                max_logprobs=max_logprobs,
                **vllm_only(gpu_memory_utilization=gpu_memory_utilization, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                            quantization=quantization, block_size=block_size, tokenizer=tokenizer,
                            swap_space=swap_space),
            )  # fmt: skip
    except (ValueError, FileNotFoundError, OSError, FatalEngineError) as e:
        message = e.strerror if isinstance(e, OSError) and e.strerror and e.filename is None else str(e)
        raise click.ClickException(flag_error(message, typed_flags(sys.argv), TLS_FIELDS)) from None
    except (MemoryError, RuntimeError) as e:  # a memory limit (ulimit -v, a cgroup) below what loading takes
        if is_out_of_memory(e):
            what = str(e)[:200] or "an allocation failed"
            raise click.ClickException(f"out of memory while loading the engine ({what}): lower --num-kv-blocks or "
                                       "raise the process's memory limit") from None
        if "can't start new thread" in str(e):
            raise click.ClickException("cannot start the server's threads (the process's thread or memory limit "
                                       "is reached)") from None
        raise
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        if stop.is_set():  # a second signal while draining: abort what is in flight and stop now
            handle.cut_drain()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    notes = "API key required" if options.api_key else "no API key"
    if speculative_config is not None:
        notes += f"; speculative decoding {speculative_config.to_dict()}"
    try:
        try:  # a line for people and scripts; the server serves whether or not it can be written
            echo(f"trtpaged serve: {handle.model_name} ready at {handle.url} ({notes}; Ctrl-C or SIGTERM to stop)",
                 what="the ready line")
        except click.ClickException as e:
            note(f"trtpaged serve: {e.message}; serving on at {handle.url}")
        while not stop.wait(0.5) and handle.failure is None:
            pass
        if handle.failure is not None:
            raise click.ClickException(f"the engine failed, server stopped: {handle.failure}")
        note(f"trtpaged serve: draining (up to {shutdown_timeout:g} s; Ctrl-C again to abort the requests in flight), "
             "then stopping")
        handle.shutdown()
        note("trtpaged serve: stopped")
    finally:
        # whatever ended the command (a failed engine, an exception): the server's threads end before the
        # interpreter does (it crashed at exit); after a drain this does nothing
        handle.shutdown(timeout=0)


def note(text: str) -> None:
    """A line on stderr, where a full disk, a closed stderr or a gone reader must not stop the server or skip its
    drain (it did: a SIGTERM then failed the requests in flight)."""
    try:
        click.echo(text, err=True)
    except (OSError, ValueError):
        pass


def vllm_only(**given: Any) -> dict[str, Any]:
    """vLLM's serve options with no setting of their own here, for LLM's vLLM arguments to check and apply (a dtype,
    block size or tokenizer other than the engine's is refused; swap space sizes the host blocks; a memory fraction
    is said to have no effect): those given."""
    return {name: value for name, value in given.items() if value is not None}


@contextlib.contextmanager
def interrupts_end_the_load() -> Iterator[None]:
    """Ctrl-C or SIGTERM while the engine loads ends the process at once (status 130 / 143), with one line. Unwinding
    instead left the engine thread inside torch's C++ while the interpreter shut down: "terminate called without
    an active exception", SIGABRT. Nothing is written before the server is ready, so nothing is lost."""
    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signum)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    except KeyboardInterrupt as exc:
        signum = exc.args[0] if exc.args and isinstance(exc.args[0], int) else signal.SIGINT
        click.echo("trtpaged serve: interrupted while loading the engine; not started", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)  # as build's: a normal exit would wait on the engine thread's C++ call
    finally:
        signal.signal(signal.SIGTERM, previous)


# the runtime's fields this command's flags set: its errors name the flag the user typed
FLAGS = {"gpu_memory_utilization": "--gpu-memory-utilization", "dtype": "--dtype",
         "kv_cache_dtype": "--kv-cache-dtype", "quantization": "--quantization", "block_size": "--block-size",
         "tokenizer": "--tokenizer", "swap_space": "--swap-space",
         "enable_prefix_caching": "--enable-prefix-caching", "max_batch_size": "--max-batch-size",
         "max_num_tokens": "--max-num-tokens", "max_seq_len": "--max-seq-len", "num_kv_blocks": "--num-kv-blocks",
         "device": "--device", "backend": "--backend", "tensor_parallel": "--tensor-parallel-size",
         "tool_call_parser": "--tool-call-parser", "reasoning_parser": "--reasoning-parser",
         "default_chat_template_kwargs": "--default-chat-template-kwargs",
         "chat_template": "--chat-template", "seed": "--seed",
         "max_logprobs": "--max-logprobs",
         "speculative_config": "--speculative-config", "kv_tiers.host_memory": "--kv-host-memory",
         "kv_tiers.disk.path": "--kv-disk-path", "kv_tiers.disk.size": "--kv-disk-size",
         "kv_tiers.remote": "--kv-remote", "kv_tiers.secret_file": "--kv-secret-file",
         "request_log": "--request-log", "ssl_keyfile": "--ssl-keyfile", "ssl_certfile": "--ssl-certfile",
         "ssl_ca_certs": "--ssl-ca-certs", "ssl_cert_reqs": "--ssl-cert-reqs", "root_path": "--root-path"}  # fmt: skip
TLS_FIELDS = ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs")  # named in the text of TLS errors
# vLLM's spellings of three limits, which an error names when the user typed them
VLLM_SPELLINGS = {"max_batch_size": "--max-num-seqs", "max_num_tokens": "--max-num-batched-tokens",
                  "max_seq_len": "--max-model-len", "num_kv_blocks": "--num-gpu-blocks-override"}  # fmt: skip


def typed_flags(argv: Sequence[str]) -> dict[str, str]:
    """FLAGS, with vLLM's spelling of a limit where `argv` (the command line) used it."""
    typed = {arg.split("=", 1)[0] for arg in argv}
    return {**FLAGS, **{field: flag for field, flag in VLLM_SPELLINGS.items() if flag in typed}}


def check_max_prompt_tokens(engine: str, max_prompt_tokens: Optional[int], max_seq_len: Optional[int]) -> None:
    """Refuses a --max-prompt-tokens that max_seq_len could never let through (a prompt has at most max_seq_len - 1
    tokens: the reply needs one): it was accepted, and the server refused such prompts by max_seq_len anyway."""
    if max_prompt_tokens is None:
        return
    from trtpaged.manifest import read_manifest

    build = read_manifest(engine).limits.max_seq_len
    # a --max-seq-len past the build limit is LLM's to refuse, naming that limit
    limit, which = (max_seq_len, typed_flags(sys.argv)["max_seq_len"]) if max_seq_len is not None and \
        max_seq_len <= build else \
        (build, "the engine's max_seq_len")  # fmt: skip
    if max_prompt_tokens > limit - 1:
        raise click.BadParameter(f"{max_prompt_tokens} is more than {which} {limit} lets a prompt have: at most "
                                 f"{limit - 1} (one token is left for the reply)", param_hint="'--max-prompt-tokens'")


OPEN_FILES_WANTED = 65536


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raises this process's soft limit on open files towards `wanted` (never past the hard limit, never down), as
    vLLM's server does: each connection holds a descriptor, and a soft limit of 1024 (a common default) is reached by
    a thousand idle keep-alive clients. Returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    log = logging.getLogger(__name__)
    if target < 4096:  # connections past it are reset by the kernel, with nothing in this server's log
        log.warning("open files are limited to %d (the hard limit, ulimit -Hn): about that many connections at once",
                    target)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d: %s", soft, exc)
    return soft


def tier_options(host_memory: Optional[int], disk_path: Optional[str], disk_size: Optional[int],
                 remote: Optional[str], secret_file: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The `--kv-*` flags as LLM(kv_tiers=...), None when none is given (checked by KVTierConfig.parse); the
    sizes in bytes, as `Size` read them."""
    spec: dict[str, Any] = {}
    if host_memory is not None:
        spec["host_memory"] = host_memory
    if (disk_path is None) != (disk_size is None):
        given, missing = ("--kv-disk-path", "--kv-disk-size") if disk_size is None else ("--kv-disk-size",
                                                                                          "--kv-disk-path")
        raise click.UsageError(f"{given} needs {missing} (the disk tier's directory and its bound go together)")
    if disk_path is not None:
        spec["disk"] = {"path": disk_path, "size": disk_size}
    if remote is not None:
        spec["remote"] = remote
    if secret_file is not None:
        spec["secret_file"] = secret_file
    return spec or None
