"""`trtpaged bench`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import click

_DTYPES = ("float32", "float16", "bfloat16")


@click.group(name="bench")
def command() -> None:
    """Benchmarks: kernels (more to come: memory, throughput)."""


@command.command(name="kernel")
@click.option("--kv-dtype", type=click.Choice(_DTYPES), default="float32", show_default=True,
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
