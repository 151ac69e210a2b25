"""`trtpaged diagnose`: what paged KV and sharing buy a workload (baseline, sharing, lengths, bound)."""

from __future__ import annotations

import click

from trtpaged.commands.option_types import HttpUrl, RegularFile
from trtpaged.commands.stdout import echo


def _kv_from_engine(engine: str):
    from pathlib import Path

    from trtpaged.bench.diagnose import ModelKV
    from trtpaged.bench.memory_bench import Budget
    from trtpaged.errors import check_unicode
    from trtpaged.manifest import read_manifest
    from trtpaged.kv_budget import resolve_num_kv_blocks
    from trtpaged.runtime.llm import load_tokenizer

    manifest = read_manifest(engine)
    lim = manifest.limits
    budget = Budget(resolve_num_kv_blocks(manifest), lim.block_size, lim.max_seq_len, lim.max_batch_size,
                    lim.max_num_tokens)
    tokenizer = load_tokenizer(Path(engine), manifest)
    kv = ModelKV(manifest.kv_bytes_per_token, budget, f"engine {engine}")
    return kv, (lambda text: list(tokenizer.encode(check_unicode("prompt", text)))), manifest.dims.vocab_size


def _kv_from_config(path: str):
    from types import SimpleNamespace

    from transformers import AutoConfig

    from trtpaged.bench.diagnose import ModelKV
    from trtpaged.bench.memory_bench import Budget
    from trtpaged.config import load_config
    from trtpaged.models.dims import dims_from_hf_config
    from trtpaged.models.hf import load_hf
    from trtpaged.kv_budget import resolve_num_kv_blocks

    config = load_config(path)
    spec, lim = config.model, config.limits
    if spec.kind == "tiny":
        hf_config = load_hf(spec).config
    elif spec.kind == "hf_dir":
        hf_config = AutoConfig.from_pretrained(str(spec.path), local_files_only=True, trust_remote_code=False)
    else:
        hf_config = AutoConfig.from_pretrained(str(spec.path.parent), gguf_file=spec.path.name, local_files_only=True,
                                               trust_remote_code=False)
    dims = dims_from_hf_config(hf_config, lim.max_seq_len)
    per_token = dims.kv_bytes_per_token(config.kv_cache_dtype)
    # the fields kv_budget reads; one rank's block is 1/tensor_parallel of the whole one
    plan = SimpleNamespace(kv_bytes_per_block_per_rank=per_token * lim.block_size // config.tensor_parallel,
                           limits=lim, kv_cache=config.kv_cache)
    budget = Budget(resolve_num_kv_blocks(plan), lim.block_size, lim.max_seq_len, lim.max_batch_size,
                    lim.max_num_tokens)
    return ModelKV(per_token, budget, f"config {path}"), None, dims.vocab_size


@click.command(name="diagnose")
@click.argument("log", type=RegularFile())
@click.option("--engine", type=click.Path(exists=True, file_okay=False),
              help="Engine dir (KV bytes, budget, tokenizer).")
@click.option("--config", "config_path", type=RegularFile(),
              help="model.yaml instead of an engine dir (reads the model's config only; no text prompts).")
@click.option("--metrics", "metrics_url", type=HttpUrl(),
              help="Metrics URL of a running server (trtpaged serve, or vLLM-style).")
@click.option("--metrics-samples", type=click.IntRange(1, 3600), default=3, show_default=True,
              help="Samples of --metrics, 1 s apart.")
@click.option("--step-time", type=float, default=None,
              help="Seconds per engine step for a log whose arrivals are seconds (default: the median of its lines' "
                   "step_time_s, as `trtpaged serve --request-log` writes), or a timed trace's (Mooncake, Azure, "
                   "BurstGPT; needed when its timestamps differ; a trtllm-bench dataset has none).")
@click.option("--kv-tier-blocks", default=None, metavar="N[,N..]",
              help="Also: what KV tiers of N blocks below the pool would buy the log (prefix hit rate, tokens "
                   "computed; 'unbounded' too).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def command(log, engine, config_path, metrics_url, metrics_samples, step_time, kv_tier_blocks, as_json) -> None:
    """What paged KV and sharing buy the workload in LOG (JSON Lines request log), with numbers.

    Log lines: {"prompt": text | "prompt_token_ids": [...] | "prompt_len": N, "output_len": N,
    "arrival": step or seconds, "prefix_id": id, "prefix_len": N, "n": N, "beam_width": W}; the log that
    `trtpaged serve --request-log` writes is one (arrivals in seconds since the server started, converted
    to steps with the measured step time). A Mooncake trace (timestamp, input_length, output_length, hash_ids), an
    Azure LLM inference or a BurstGPT trace (CSV, known by its header; no prompt content, so prefix sharing is
    reported unknown) is read as `bench memory --trace` replays it (--step-time needed when its timestamps differ); so
    is a trtllm-bench dataset (task_id, prompt or input_ids, output_tokens: its prompts' own token ids, all at step 0).
    """
    import json

    from trtpaged.bench.diagnose import diagnose, format_diagnosis, read_request_log
    from trtpaged.bench.memory_bench import check_fits

    if bool(engine) == bool(config_path):
        raise click.UsageError("give exactly one of --engine DIR or --config model.yaml")
    try:
        from trtpaged.bench.memory_bench import parse_tier_blocks

        tier_sizes = parse_tier_blocks(kv_tier_blocks) if kv_tier_blocks is not None else None
        kv, tokenize, vocab = _kv_from_engine(engine) if engine else _kv_from_config(config_path)
        data = read_request_log(log, tokenize, vocab, step_time=step_time, budget=kv.budget)
        check_fits(data.trace, kv.budget, data.wheres)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    metrics = None
    if metrics_url:
        from trtpaged.bench.server_metrics import observe

        try:
            metrics = observe(metrics_url, metrics_samples, max_batch_size=kv.budget.max_batch_size)
        except OSError as exc:
            raise click.ClickException(f"--metrics: cannot read {metrics_url}: {exc}") from exc
    report = diagnose(data.trace, data.prompts, kv, metrics,
                      progress=lambda m: click.echo(f"  replaying: {m}", err=True),
                      log=data, tier_blocks=tier_sizes)  # fmt: skip
    if as_json:
        echo(json.dumps(report, indent=2))
    else:
        echo(format_diagnosis(report))
