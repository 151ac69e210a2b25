"""`trtpaged bench`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import click

from trtpaged.manifest import DTYPE_BYTES


@click.group(name="bench")
def command() -> None:
    """Benchmarks: kernel, memory, throughput."""


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
@click.option("--beam-width", default=1, show_default=True, help="Synthetic: W > 1 makes every request a beam search of width W.")
@click.option("--preset", type=click.Choice(("alpaca", "sharegpt")),
              help="Synthetic: prompt/output length ranges with the PagedAttention paper's dataset means.")
@click.option("--sharing-table", is_flag=True, help="Also: memory saved by sharing for n = 2, 4, 6 and beam width 2, 4, 6.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write KV slots and running sequences over time to a PNG.")
@click.option("--seed", default=0, show_default=True)
@click.option("--num-blocks", type=int, help="KV blocks (default: the engine's budget, else 1456).")
@click.option("--block-size", type=int, help="Tokens per block (default: the engine's, else 16).")
@click.option("--max-seq-len", type=int, help="Default: the engine's, else 2048.")
@click.option("--max-batch-size", type=int, help="Default: the engine's, else 256.")
@click.option("--max-num-tokens", type=int, help="Default: the engine's, else 2048.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def memory(engine, trace, num_requests, prompt_len, output_len, shared_prefix, num_prefixes, n, beam_width, preset,
           sharing_table, plot, seed, num_blocks, block_size, max_seq_len, max_batch_size, max_num_tokens,
           as_json) -> None:  # fmt: skip
    """Concurrency and KV utilisation of one workload: contiguous reservations vs paged vs paged + sharing.

    Replays the workload through trtpaged's real scheduler and block pool (no model runs) and
    through contiguous-reservation baselines, all with the same KV budget, side by side; and
    reports the memory saved by sharing (parallel samples, beams, shared prefixes).
    """
    import json

    from trtpaged.bench.memory_bench import (Budget, format_memory_report, format_sharing_table, run_memory_bench,
                                             run_sharing_table)  # fmt: skip
    from trtpaged.bench.workload import PRESETS, load_trace, parse_range, synthetic_trace

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
            plens, olens = PRESETS[preset] if preset else (parse_range(prompt_len, "--prompt-len"),
                                                           parse_range(output_len, "--output-len"))  # fmt: skip
            requests = synthetic_trace(num_requests, plens, olens, shared_prefix, num_prefixes, n, seed, beam_width)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    progress = lambda msg: click.echo(f"  replaying: {msg}", err=True)  # noqa: E731
    report = run_memory_bench(requests, budget, progress=progress)
    if plot:
        from trtpaged.bench.memory_plot import plot_memory_report

        click.echo(f"  plot: {plot_memory_report(report, plot)}", err=True)
    del report["series"]  # per-step series: for the plot, too long to print
    if sharing_table:
        report["sharing_table"] = run_sharing_table(requests, budget, progress=progress)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(format_memory_report(report))
    if sharing_table:
        click.echo("\n" + format_sharing_table(report["sharing_table"]))
