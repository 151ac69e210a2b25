"""`trtpaged bench`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

from typing import Optional

import click

from trtpaged.manifest import DTYPE_BYTES


@click.group(name="bench")
def command() -> None:
    """Benchmarks: the paged-attention kernel, KV memory under a workload."""


@command.command(name="kernel")
@click.option("--kv-dtype", type=click.Choice(tuple(DTYPE_BYTES)), default="float32", show_default=True,
              help="KV cache storage dtype.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--quick", is_flag=True, help="Shorter timing budget (noisier).")
def kernel(kv_dtype: str, as_json: bool, quick: bool) -> None:
    """CPU decode kernel: KV-read bandwidth vs memory-copy bandwidth, and paged vs contiguous overhead."""
    import torch

    from trtpaged.bench.kernel_bench import format_report, report_json, run_kernel_bench

    def progress(msg: str) -> None:
        click.echo(f"  {msg}", err=True)

    report = run_kernel_bench(getattr(torch, kv_dtype), budget_s=0.15 if quick else 0.4, progress=progress)
    click.echo(report_json(report) if as_json else format_report(report))


@command.command(name="memory")
@click.argument("engine", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--trace", type=click.Path(exists=True, dir_okay=False),
              help="JSON Lines trace (prompt_len, output_len[, arrival, prefix_id, prefix_len, n]).")
@click.option("--num-requests", default=200, show_default=True, help="Synthetic workload: number of requests.")
@click.option("--prompt-len", default="64:512", show_default=True, help="Synthetic: prompt length N or LOW:HIGH.")
@click.option("--output-len", default="16:512", show_default=True, help="Synthetic: output length N or LOW:HIGH.")
@click.option("--shared-prefix", default=0, show_default=True, help="Synthetic: tokens of shared system prompt.")
@click.option("--num-prefixes", default=1, show_default=True, help="Synthetic: distinct shared prompts.")
@click.option("--n", default=1, show_default=True, help="Synthetic: parallel samples per request.")
@click.option("--seed", default=0, show_default=True)
@click.option("--num-blocks", type=int, help="KV blocks (default: the engine's budget, else 1456).")
@click.option("--block-size", type=int, help="Tokens per block (default: the engine's, else 16).")
@click.option("--max-seq-len", type=int, help="Default: the engine's, else 2048.")
@click.option("--max-batch-size", type=int, help="Default: the engine's, else 256.")
@click.option("--max-num-tokens", type=int, help="Default: the engine's, else 2048.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def memory(engine, trace, num_requests, prompt_len, output_len, shared_prefix, num_prefixes, n, seed, num_blocks,
           block_size, max_seq_len, max_batch_size, max_num_tokens, as_json) -> None:  # fmt: skip
    """Concurrency and KV utilisation of one workload: contiguous reservations vs paged vs paged + sharing.

    Replays the workload through trtpaged's real scheduler and block pool (no model runs) and
    through contiguous-reservation baselines, all with the same KV budget, side by side.
    """
    import json

    from trtpaged.bench.memory_bench import Budget, format_memory_report, run_memory_bench
    from trtpaged.bench.workload import load_trace, parse_range, synthetic_trace

    defaults = {"num_blocks": 1456, "block_size": 16, "max_seq_len": 2048, "max_batch_size": 256,
                "max_num_tokens": 2048}  # fmt: skip
    try:
        if engine:
            from trtpaged.manifest import read_manifest
            from trtpaged.runtime.engines.kv_budget import resolve_num_blocks

            manifest = read_manifest(engine)
            limits = manifest.limits
            defaults = {"num_blocks": resolve_num_blocks(manifest), "block_size": limits.block_size,
                        "max_seq_len": limits.max_seq_len, "max_batch_size": limits.max_batch_size,
                        "max_num_tokens": limits.max_num_tokens}  # fmt: skip
        given = {"num_blocks": num_blocks, "block_size": block_size, "max_seq_len": max_seq_len,
                 "max_batch_size": max_batch_size, "max_num_tokens": max_num_tokens}  # fmt: skip
        budget = Budget(**{k: v if v is not None else defaults[k] for k, v in given.items()})
        if trace:
            requests = load_trace(trace)
        else:
            requests = synthetic_trace(num_requests, parse_range(prompt_len, "--prompt-len"),
                                       parse_range(output_len, "--output-len"), shared_prefix, num_prefixes, n, seed)  # fmt: skip
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    report = run_memory_bench(requests, budget, progress=lambda msg: click.echo(f"  replaying: {msg}", err=True))
    click.echo(json.dumps(report, indent=2) if as_json else format_memory_report(report))


@command.command(name="qlinear")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--quick", is_flag=True, help="Shorter timing budget (noisier).")
@click.option("--working-set-mb", type=int, help="Weight bytes each format rotates over (default: 2 x LLC).")
@click.option("--threads", type=int, help="CPU threads for torch and our kernels (default: torch's).")
def qlinear(as_json: bool, quick: bool, working_set_mb: Optional[int], threads: Optional[int]) -> None:
    """Weight-only int8/int4 CPU linears vs fp32 F.linear on SmolLM2-135M shapes, weights from DRAM."""
    import torch

    from trtpaged.bench.qlinear_bench import format_report, report_json, run_qlinear_bench

    if threads:
        torch.set_num_threads(threads)  # one OpenMP runtime: it also sets our kernels' threads

    report = run_qlinear_bench(
        working_set_bytes=working_set_mb << 20 if working_set_mb else None,
        budget_s=0.1 if quick else 0.3,
        progress=lambda msg: click.echo(f"  {msg}", err=True),
    )
    click.echo(report_json(report) if as_json else format_report(report))


@command.command(name="serve")
@click.option("--base-url", required=True, help="The server, e.g. http://127.0.0.1:8000 (any OpenAI-compatible server).")
@click.option("--trace", type=click.Path(exists=True, dir_okay=False), help="JSON Lines trace (as for bench memory).")
@click.option("--num-requests", default=100, show_default=True, help="Synthetic workload: number of requests.")
@click.option("--prompt-len", default="32:256", show_default=True, help="Synthetic: prompt words N or LOW:HIGH.")
@click.option("--output-len", default="16:128", show_default=True, help="Synthetic: output tokens N or LOW:HIGH.")
@click.option("--request-rate", default="inf", show_default=True, help="Requests per second (Poisson), or inf.")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None, help="Requests in flight at most.")
@click.option("--model", default=None, help="Model name to send (default: none; the server's own).")
@click.option("--api-key", envvar="TRTPAGED_API_KEY", default=None, help="Sent as 'Authorization: Bearer KEY'.")
@click.option("--endpoint", type=click.Choice(["completions", "chat"]), default="completions", show_default=True)
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True, help="Ask for exactly the output length.")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def serve(base_url, trace, num_requests, prompt_len, output_len, request_rate, max_concurrency, model, api_key,
          endpoint, ignore_eos, seed, as_json) -> None:  # fmt: skip
    """Serving benchmark: TTFT, TPOT, ITL, end-to-end latency and throughput of a running server."""
    import asyncio

    from trtpaged.bench.serve_bench import format_report, prompts_from_trace, report_json, run_serve_bench
    from trtpaged.bench.workload import load_trace, parse_range, synthetic_trace

    try:
        rate = float(request_rate)
        if not rate > 0:
            raise ValueError(f"--request-rate: must be > 0 or inf, got {request_rate!r}")
        workload = load_trace(trace) if trace else synthetic_trace(
            num_requests, parse_range(prompt_len, "--prompt-len"), parse_range(output_len, "--output-len"), seed=seed)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    report = asyncio.run(run_serve_bench(base_url, prompts_from_trace(workload, seed), rate, max_concurrency, model,
                                         api_key, endpoint == "chat", ignore_eos, seed,
                                         progress=lambda msg: click.echo(f"  {msg}", err=True)))  # fmt: skip
    click.echo(report_json(report) if as_json else format_report(report))
