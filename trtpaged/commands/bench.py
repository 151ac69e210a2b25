"""`trtpaged bench`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

import click

from trtpaged.bench.llamacpp import INSTALL, PATH_ENV, PRELOAD_ENV
from trtpaged.commands.option_types import FiniteFloatRange, HttpUrl, OutputFile, RegularFile, Size
from trtpaged.commands.stdout import echo
from trtpaged.config import MAX_BATCH_SIZE, MAX_SEQ_LEN
from trtpaged.kv_formats import KV_CACHE_DTYPES
from trtpaged.manifest import BACKENDS, BLOCK_SIZES, DEFAULT_BLOCK_SIZE

# the most a benchmark takes of each (past them a run would never end: 10**20 requests were accepted)
MAX_REQUESTS = 1_000_000
MAX_WORDS = 100_000
MAX_ROUNDS = 1000
MAX_THINK_S = 3600.0
_ENGINE_GGUF = "\0engine"  # --llamacpp alone: the engine's own GGUF (no path holds a NUL)
MAX_PEER_TIME_S = 7 * 86400.0  # a week (the wait's poll takes at most 2**31 ms: 1e300 s was an OverflowError)


def _engine_dir(value, param):
    """An engine dir option checked before any run (a non-engine dir failed after the main run, as a traceback)."""
    if value is not None:
        from trtpaged.manifest import read_manifest

        try:
            read_manifest(value)
        except (OSError, ValueError) as exc:
            raise click.BadParameter(str(exc), param=param) from None
    return value


def _progress(msg: str) -> None:
    """A benchmark's progress line, on stderr (stdout holds the report)."""
    click.echo(f"  {msg}", err=True)


def _print_report(run: Callable[[], dict], text: Callable[[dict], str], as_json: bool) -> None:
    """Runs one benchmark and prints its report (JSON, or `text` of it); a ValueError (bad input) or a server
    that did not start or failed during the run becomes a one-line CLI error."""
    from trtpaged.bench.serve_ratio import ServerError

    try:
        report = run()
    except (ValueError, ServerError) as exc:
        raise click.ClickException(str(exc)) from exc
    echo(json.dumps(report, indent=2) if as_json else text(report))


@click.group(name="bench")
def command() -> None:
    """Benchmarks: kernel, memory, throughput, qlinear, serve, neighbour."""
    from trtpaged.bench.child_process import exit_on_sigterm

    exit_on_sigterm()  # a benchmark stopped by SIGTERM stops its servers and removes its temporary files


@command.command(name="kernel")
@click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default=None,
              help="KV cache storage dtype (int8, fp8_e4m3: also timed against float32 and float16 on cpu, "
                   "float16 on cuda). Default: float32 on cpu, float16 on cuda.")  # fmt: skip
@click.option("--device", type=click.Choice(("cpu", "cuda")), default="cpu", show_default=True,
              help="cpu: the OpenMP kernel; cuda: the CUDA kernel on the current GPU (HBM copy bandwidth as the bar).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--quick", is_flag=True,
              help="Shorter timing budget (noisier); on cuda, contexts 2048/8192 at batch 8/32.")
@click.option("--block-size", type=click.Choice([str(b) for b in BLOCK_SIZES]), default=str(DEFAULT_BLOCK_SIZE),
              show_default=True,
              help="Tokens per block of the paged cache (model.yaml's block_size).")
@click.option("--layers", type=click.IntRange(1, 512), default=1, show_default=True,
              help="cpu: a pool of this many layers, one call each in turn, as a model's decode step makes them "
                   "(SmolLM2: 30); 1: every call finds the previous one's keys in the caches.")
def kernel(kv_cache_dtype: Optional[str], device: str, as_json: bool, quick: bool, block_size: str,
           layers: int) -> None:
    """Decode kernel: KV-read bandwidth vs memory-copy bandwidth, and paged vs contiguous overhead."""
    if device == "cuda":
        from trtpaged.bench.kernel_bench_gpu import run_gpu_kernel_bench

        if layers != 1:
            raise click.UsageError("--layers: the cpu kernel's benchmark only (--device cpu)")

        try:
            run_gpu_kernel_bench(as_json, kv_cache_dtype or "float16", quick, int(block_size))
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
        return
    from trtpaged.bench.kernel_bench import format_report, report_json, run_kernel_bench

    def progress(msg: str) -> None:
        click.echo(f"  {msg}", err=True)

    report = run_kernel_bench(kv_cache_dtype or "float32", budget_s=0.15 if quick else 0.4, progress=progress,
                              block_size=int(block_size), layers=layers)
    echo(report_json(report) if as_json else format_report(report))


@command.command(name="memory")
@click.argument("engine", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--trace", type=RegularFile(),
              help="JSON Lines trace (prompt_len, output_len[, arrival, prefix_id, prefix_len, n, beam_width]), a "
                   "Mooncake trace (JSON Lines of timestamp, input_length, output_length, hash_ids), an Azure LLM "
                   "inference or BurstGPT trace (CSV, known by its header; prompts random tokens, nothing shared; "
                   "timed traces: see --step-time), a trtllm-bench dataset (JSON Lines of task_id, prompt or "
                   "input_ids, output_tokens; texts tokenized by ENGINE's tokenizer, ids as given, so shared "
                   "prefixes are real), or a ShareGPT dataset (a JSON array of conversations, read as vLLM's "
                   "benchmarks read it; its lengths counted by ENGINE's tokenizer).")
@click.option("--step-time", type=FiniteFloatRange(min=0, min_open=True), default=None,
              help="With a timed --trace (Mooncake, Azure, BurstGPT): the seconds one replay step stands for; each "
                   "timestamp (its time after the first) becomes a step, rounded up. Needed when the timestamps "
                   "differ.")
@click.option("--num-requests", type=click.IntRange(1, MAX_REQUESTS), default=200, show_default=True,
              help="Synthetic workload, or a ShareGPT --trace: number of requests.")
@click.option("--prompt-len", default="64:512", show_default=True, help="Synthetic: prompt length N or LOW:HIGH.")
@click.option("--output-len", default="16:512", show_default=True,
              help="Synthetic: output length N or LOW:HIGH. With a ShareGPT --trace: N, every request's (default: "
                   "each completion's tokens).")
@click.option("--shared-prefix", type=click.IntRange(0, MAX_SEQ_LEN), default=0, show_default=True,
              help="Synthetic: tokens of shared system prompt.")
@click.option("--num-prefixes", type=click.IntRange(1, MAX_REQUESTS), default=1, show_default=True,
              help="Synthetic: distinct shared prompts.")
@click.option("--n", type=click.IntRange(1, MAX_BATCH_SIZE), default=1, show_default=True,
              help="Parallel samples per request. With --trace: set on the lines that give neither n nor beam_width "
                   "(a line's own value wins).")
@click.option("--beam-width", type=click.IntRange(1, MAX_BATCH_SIZE), default=1, show_default=True,
              help="W > 1 makes every request a beam search of width W. With --trace: set on the lines that give "
                   "neither n nor beam_width (a line's own value wins; not with --n).")
@click.option("--preset", type=click.Choice(("alpaca", "sharegpt")),
              help="Synthetic: prompt/output length ranges with the PagedAttention paper's dataset means.")
@click.option("--sharing-table", is_flag=True,
              help="Also: memory saved by sharing for n = 2, 4, 6 and beam width 2, 4, 6.")
@click.option("--plot", type=OutputFile(), callback=lambda ctx, p, v: _plot_path(v, p),
              help="Write KV slots and running sequences over time to PATH, exactly: a PNG (or the format its "
                   "suffix names: .svg, .pdf, ...).")
@click.option("--seed", default=0, show_default=True, help="Synthetic lengths, or a ShareGPT --trace's shuffle.")
@click.option("--num-kv-blocks", type=int, help="KV blocks (default: the engine's budget, else 1456).")
@click.option("--block-size", type=int, help="Tokens per block (default: the engine's, else 16).")
@click.option("--max-seq-len", type=int, help="Default: the engine's, else 2048.")
@click.option("--max-batch-size", type=int, help="Default: the engine's, else 256.")
@click.option("--max-num-tokens", type=int, help="Default: the engine's, else 2048.")
@click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES),
              help="Also: the paged replay with the same KV memory held as float32, float16 and this cache dtype.")
@click.option("--head-dim", type=click.IntRange(min=1),
              help="With --kv-cache-dtype: head_dim that sizes a quantized row (default: the engine's, else 64).")
@click.option("--tensor-parallel", type=click.IntRange(1, 64), default=None,
              help="Also: the paged replay on N ranks, each a device with the memory of the budget (N x the memory; "
                   "default: the engine's tensor_parallel when above 1).")
@click.option("--kv-tier-blocks", default=None, metavar="N[,N..]",
              help="Also: prefix hit rate and tokens computed with a KV tier of N blocks below the pool "
                   "(each size; 'unbounded' too), vs the pool alone (docs/kv_tiers.md).")
@click.option("--window", type=click.IntRange(min=1), default=None,
              help="Also: the paged replay of a model whose every layer has this sliding window, with the blocks "
                   "before each sequence's window kept and returned to the pool (default: the engine's window when "
                   "every layer has one).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def memory(ctx, engine, trace, step_time, num_requests, prompt_len, output_len, shared_prefix, num_prefixes, n,
           beam_width, preset, sharing_table, plot, seed, num_kv_blocks, block_size, max_seq_len, max_batch_size,
           max_num_tokens, kv_cache_dtype, head_dim, tensor_parallel, kv_tier_blocks, window,
           as_json) -> None:  # fmt: skip
    """Concurrency and KV utilisation of one workload: contiguous reservations vs paged vs paged + sharing.

    Replays the workload through trtpaged's real scheduler and block pool (no model runs) and
    through contiguous-reservation baselines, all with the same KV budget, side by side; and
    reports the memory saved by sharing (parallel samples, beams, shared prefixes). The budget's blocks
    are of the engine's kv_cache_dtype (without an engine: float16); --kv-cache-dtype converts that memory.
    The budget is one device's: for a tensor-parallel engine, its blocks per rank over tensor_parallel.
    With --trace, --n or --beam-width fill the lines that give neither field; the synthetic options
    are errors (they cannot apply to a trace). A ShareGPT --trace takes --num-requests, --seed and --output-len N
    (trtpaged.bench.sharegpt); a timed --trace's timestamps (Mooncake, Azure, BurstGPT) become steps with
    --step-time (trtpaged.bench.timed_trace); a trtllm-bench --trace's prompts are replayed as its token ids
    (trtpaged.bench.trtllm_dataset), so what they share is real.
    """
    from trtpaged.bench.memory_bench import (Budget, format_memory_report, format_sharing_table, run_memory_bench,
                                             run_sharing_table)  # fmt: skip
    from trtpaged.bench.sharegpt import is_sharegpt
    from trtpaged.bench.timed_trace import timed_form
    from trtpaged.bench.trtllm_dataset import is_trtllm_dataset
    from trtpaged.bench.workload import (PRESETS, load_trace_with_sharing, parse_range, refuse_foreign, refuse_packed,
                                         synthetic_trace)  # fmt: skip

    defaults = {"num_kv_blocks": 1456, "block_size": DEFAULT_BLOCK_SIZE, "max_seq_len": 2048, "max_batch_size": 256,
                "max_num_tokens": 2048}  # fmt: skip
    base_dtype, engine_head_dim = "float16", 64
    manifest = None
    prompts = None  # each request's token ids, where the trace gives real ones (default: generated)
    try:
        tier_sizes = None
        if kv_tier_blocks is not None:
            from trtpaged.bench.memory_bench import parse_tier_blocks

            tier_sizes = parse_tier_blocks(kv_tier_blocks)
        if engine:
            from trtpaged.manifest import read_manifest
            from trtpaged.kv_budget import resolve_num_kv_blocks

            manifest = read_manifest(engine)
            base_dtype, engine_head_dim = manifest.kv_cache_dtype, manifest.dims.head_dim
            limits = manifest.limits
            if tensor_parallel is None and manifest.tensor_parallel > 1:
                tensor_parallel = manifest.tensor_parallel
            if window is None and manifest.dims.max_window:
                window = manifest.dims.max_window
            # one device's memory in one-rank blocks (a rank's block is 1/tensor_parallel of one)
            defaults = {"num_kv_blocks": max(1, resolve_num_kv_blocks(manifest) // manifest.tensor_parallel),
                        "block_size": limits.block_size,
                        "max_seq_len": limits.max_seq_len, "max_batch_size": limits.max_batch_size,
                        "max_num_tokens": limits.max_num_tokens}  # fmt: skip
        given = {"num_kv_blocks": num_kv_blocks, "block_size": block_size, "max_seq_len": max_seq_len,
                 "max_batch_size": max_batch_size, "max_num_tokens": max_num_tokens}  # fmt: skip
        budget = Budget(**{k: v if v is not None else defaults[k] for k, v in given.items()})
        if trace:
            refuse_packed(trace)
            refuse_foreign(trace)
        sharegpt = bool(trace) and is_sharegpt(trace)
        timed = bool(trace) and not sharegpt and timed_form(trace)
        if step_time is not None and not timed:
            raise ValueError("--step-time: turns a timed --trace's timestamps (Mooncake, Azure, BurstGPT) into replay "
                             "steps; " + (f"--trace {trace} has none" if trace else "a synthetic workload arrives "
                                          "at step 0"))  # fmt: skip
        if sharegpt:
            requests, prompts = _sharegpt_memory_requests(ctx, manifest, budget.max_seq_len)
        elif timed:
            requests = _timed_memory_requests(ctx, trace, step_time, n, beam_width)
        elif trace and is_trtllm_dataset(trace):
            requests, prompts = _trtllm_memory_requests(ctx, manifest, n, beam_width)
        elif trace:
            given = _given(ctx, _MEMORY_WORKLOAD_OPTIONS)
            _refuse_synthetic_options(trace, given - {"n", "beam_width"})
            requests, filled = load_trace_with_sharing(trace, n if "n" in given else None,
                                                       beam_width if "beam_width" in given else None)  # fmt: skip
            if given:
                flag = f"--n {n}" if "n" in given else f"--beam-width {beam_width}"
                click.echo(f"  {flag}: set on {filled} of {len(requests)} trace lines; "
                           f"{len(requests) - filled} give their own n or beam_width", err=True)  # fmt: skip
        else:
            plens, olens = PRESETS[preset] if preset else (parse_range(prompt_len, "--prompt-len"),
                                                           parse_range(output_len, "--output-len"))  # fmt: skip
            _check_synthetic(plens, shared_prefix, n, beam_width)
            requests = synthetic_trace(num_requests, plens, olens, shared_prefix, num_prefixes, n, seed, beam_width)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    progress = lambda msg: click.echo(f"  replaying: {msg}", err=True)  # noqa: E731
    report = run_memory_bench(requests, budget, progress=progress, prompts=prompts)
    if plot:
        from trtpaged.bench.memory_plot import plot_memory_report

        try:
            click.echo(f"  plot: {_write_plot(plot_memory_report, report, plot)}", err=True)
        except OSError as exc:
            raise click.ClickException(f"--plot: cannot write {plot} ({exc.strerror or exc})") from exc
    del report["series"]  # per-step series: for the plot, too long to print
    if sharing_table:
        report["sharing_table"] = run_sharing_table(requests, budget, progress=progress)
    if kv_cache_dtype:
        from trtpaged.bench.memory_bench import format_kv_cache_dtype_table, run_kv_cache_dtype_comparison

        dtypes = tuple(dict.fromkeys(("float32", "float16", kv_cache_dtype)))
        hd = head_dim or engine_head_dim
        rows = run_kv_cache_dtype_comparison(requests, budget, dtypes, base_dtype, hd, progress)
        report["kv_cache_dtypes"] = {"base_dtype": base_dtype, "base_blocks": budget.num_kv_blocks, "head_dim": hd,
                                     "rows": rows}
    if tensor_parallel and tensor_parallel > 1:
        from trtpaged.bench.memory_bench import run_tensor_parallel_comparison

        report["tensor_parallel"] = run_tensor_parallel_comparison(requests, budget, (1, tensor_parallel), progress)
    if tier_sizes:
        from trtpaged.bench.memory_bench import run_tier_what_if

        report["kv_tiers"] = run_tier_what_if(requests, budget, tier_sizes, prompts, progress=progress)
    if window:
        from trtpaged.bench.memory_bench import run_window_comparison

        report["window"] = {"window": window, "rows": run_window_comparison(requests, budget, window, progress)}
    if as_json:
        echo(json.dumps(report, indent=2))
        return
    echo(format_memory_report(report))
    if sharing_table:
        echo("\n" + format_sharing_table(report["sharing_table"]))
    if kv_cache_dtype:
        k = report["kv_cache_dtypes"]
        echo("\n" + format_kv_cache_dtype_table(k["rows"], k["base_dtype"], k["base_blocks"], k["head_dim"]))
    if "tensor_parallel" in report:
        from trtpaged.bench.memory_bench import format_tensor_parallel_table

        echo("\n" + format_tensor_parallel_table(report["tensor_parallel"], budget.num_kv_blocks))
    if "kv_tiers" in report:
        from trtpaged.bench.memory_bench import format_tier_table

        echo("\n" + format_tier_table(report["kv_tiers"], budget.num_kv_blocks))
    if "window" in report:
        from trtpaged.bench.memory_bench import format_window_table

        echo("\n" + format_window_table(report["window"]["rows"], report["window"]["window"]))


def _given(ctx: click.Context, names: tuple[str, ...]) -> set[str]:
    """The options among `names` that the command line gave (not left at their defaults)."""
    from click.core import ParameterSource

    return {name for name in names if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT}


def _refuse_synthetic_options(trace: Optional[str], given: set[str], form: str = "") -> None:
    """A synthetic workload's options given with a trace (`form`: its kind, as "the ShareGPT "), which would change
    nothing: ValueError naming them."""
    if trace and given:
        flags = ", ".join("--" + name.replace("_", "-") for name in sorted(given))
        raise ValueError(f"{flags}: synthetic workload options; they cannot apply to {form}--trace {trace}")


# bench memory's workload options: a synthetic workload's, and --n / --beam-width, which also fill a trace's requests
_MEMORY_WORKLOAD_OPTIONS = ("num_requests", "prompt_len", "output_len", "shared_prefix", "num_prefixes", "n",
                            "beam_width", "preset", "seed")


def _check_synthetic(prompt_lens: tuple[int, int], shared_prefix: int, n: int, beam_width: int) -> None:
    """ValueError naming the options when a synthetic request would be refused by its own rules (which name the
    trace fields): a prompt with its shared prefix past MAX_SEQ_LEN, more beams returned than searched."""
    if prompt_lens[1] + shared_prefix > MAX_SEQ_LEN:
        raise ValueError(f"--shared-prefix {shared_prefix} + --prompt-len up to {prompt_lens[1]}: a prompt is at most "
                         f"{MAX_SEQ_LEN} tokens")  # fmt: skip
    if beam_width > 1 and n > beam_width:
        raise ValueError(f"--n {n}: the beams a search returns, at most --beam-width ({beam_width})")


def _one_request_kind(given: set[str]) -> None:
    """--n and --beam-width both given for requests of a trace that gives neither: ValueError."""
    if {"n", "beam_width"} <= given:
        raise ValueError("--n, --beam-width: give one of them (a request is parallel sampling or a beam search)")


def _fixed_output_len(value: str, given: bool) -> Optional[int]:
    """--output-len with a ShareGPT --trace: None (each completion's token count) unless given; given, one length."""
    if not given:
        return None
    from trtpaged.bench.workload import parse_range

    low, high = parse_range(value, "--output-len")
    if low != high:
        raise ValueError(f"--output-len: one length N with a ShareGPT --trace (every request's, as vLLM's "
                         f"--sharegpt-output-len), got {value!r}")  # fmt: skip
    return low


def _sharegpt_memory_requests(ctx: click.Context, manifest, max_seq_len: int) -> tuple[list, list[list[int]]]:
    """bench memory's requests from a ShareGPT --trace, and their prompts' token ids (so that the sharing replay
    finds the prefixes the texts share): lengths counted by the engine's tokenizer (without ENGINE, refused saying
    so), --n or --beam-width on every request, pairs longer than the budget's max_seq_len skipped."""
    from trtpaged.bench.sharegpt import ShareGPTRule, sample_sharegpt, tokenizer_counter
    from trtpaged.bench.workload import TraceRequest
    from trtpaged.runtime.llm import load_tokenizer

    p, trace = ctx.params, ctx.params["trace"]
    given = _given(ctx, _MEMORY_WORKLOAD_OPTIONS)
    _refuse_synthetic_options(trace, given - {"num_requests", "seed", "output_len", "n", "beam_width"}, "the ShareGPT ")
    _one_request_kind(given)
    if manifest is None:
        raise ValueError(f"--trace {trace}: a ShareGPT dataset's lengths are token counts of its texts, which need a "
                         f"tokenizer: give the engine dir (bench memory ENGINE --trace {trace})")  # fmt: skip
    rule = ShareGPTRule(output_len=_fixed_output_len(p["output_len"], "output_len" in given), model_len=max_seq_len)
    tokenizer = load_tokenizer(Path(p["engine"]), manifest)
    sample = sample_sharegpt(trace, tokenizer_counter(tokenizer), p["num_requests"], p["seed"], rule)
    _progress(sample.summary(p["num_requests"]))
    prompts = [list(tokenizer.encode(r.prompt)) for r in sample.requests]  # the same encoding that counted them
    requests = [TraceRequest(r.prompt_len, r.output_len, n=p["n"], beam_width=p["beam_width"]) for r in sample.requests]
    return requests, prompts


def _timed_memory_requests(ctx: click.Context, trace: str, step_time: Optional[float], n: int,
                           beam_width: int) -> list:  # fmt: skip
    """bench memory's requests from a timed --trace (Mooncake, Azure, BurstGPT): arrival steps from --step-time,
    --n or --beam-width on every request (no line gives either), the synthetic options refused."""
    from dataclasses import replace

    from trtpaged.bench.timed_trace import read_timed_trace

    given = _given(ctx, _MEMORY_WORKLOAD_OPTIONS)
    _refuse_synthetic_options(trace, given - {"n", "beam_width"})
    _one_request_kind(given)
    timed = read_timed_trace(trace)
    requests = timed.arrival_steps(step_time)
    _progress(timed.summary())
    if step_time is not None:
        _progress(f"--step-time {step_time:g}: arrivals at steps 0 to {max(r.arrival for r in requests)}")
    return [replace(r, n=n, beam_width=beam_width) for r in requests]


def _trtllm_memory_requests(ctx: click.Context, manifest, n: int, beam_width: int) -> tuple[list, list[list[int]]]:
    """bench memory's requests from a trtllm-bench --trace, and each one's prompt ids: input_ids as given (checked
    against ENGINE's vocabulary when given), text through ENGINE's tokenizer (without ENGINE, refused naming the
    line), --n or --beam-width on every request, the synthetic options refused."""
    from trtpaged.bench.trtllm_dataset import read_trtllm_dataset
    from trtpaged.bench.workload import TraceRequest
    from trtpaged.runtime.llm import load_tokenizer

    trace = ctx.params["trace"]
    given = _given(ctx, _MEMORY_WORKLOAD_OPTIONS)
    _refuse_synthetic_options(trace, given - {"n", "beam_width"})
    _one_request_kind(given)
    dataset = read_trtllm_dataset(trace)
    encode, vocab = None, None
    if manifest is not None:
        vocab = manifest.dims.vocab_size
        if any(line.prompt is not None for line in dataset.lines):
            encode = load_tokenizer(Path(ctx.params["engine"]), manifest).encode
    prompts = dataset.prompt_ids(encode, vocab, f"give the engine dir (bench memory ENGINE --trace {trace})")
    _progress(dataset.summary(prompts))
    requests = [TraceRequest(len(ids), line.output_len, n=n, beam_width=beam_width)
                for ids, line in zip(prompts, dataset.lines)]  # fmt: skip
    return requests, prompts


def _plot_path(value, param):
    """--plot's PATH, refused before the replay when its directory is missing, or matplotlib cannot write the format
    its suffix names (a traceback after the whole replay) or is not installed. No suffix: a PNG."""
    if value is None:
        return value
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise click.BadParameter("needs matplotlib (pip install matplotlib)", param=param) from None
    parent = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(parent):
        raise click.BadParameter(f"{value!r}: its directory {parent!r} does not exist", param=param)
    suffix = Path(value).suffix.lower().lstrip(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise click.BadParameter(f"{value!r}: matplotlib writes no .{suffix} file; give PATH.png (or one of "
                                 f"{', '.join('.' + f for f in sorted(formats))}), or a PATH with no suffix for a PNG",
                                 param=param)  # fmt: skip
    return value


def _write_plot(plot, report: dict, path: str) -> str:
    """`plot(report, file)` onto exactly `path` (matplotlib appended .png to a PATH with no suffix): drawn to a
    temporary file beside it whose suffix names the format (PATH's, else .png), then renamed over PATH, so that a
    failed plot leaves an existing PATH as it was."""
    out = Path(path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp{out.suffix or '.png'}")
    try:
        plot(report, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return str(out)


@command.command(name="neighbour")
@click.argument("engine", type=click.Path(exists=True, file_okay=False), callback=lambda ctx, p, v: _engine_dir(v, p))
@click.option("--rounds", type=click.IntRange(1, MAX_ROUNDS), default=3, show_default=True,
              help="Rounds; each times both settings quiet and beside the busy process.")
@click.option("--tokens", type=click.IntRange(1, 4096), default=256, show_default=True,
              help="Tokens each request decodes.")
@click.option("--batch", type=click.IntRange(1, 256), default=1, show_default=True, help="Requests at once.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def neighbour(engine: str, rounds: int, tokens: int, batch: int, as_json: bool) -> None:
    """Decode speed beside a busy process: the CPU thread budget (TRTPAGED_CPU_THREADS auto) against fixed."""
    from pathlib import Path

    from trtpaged.bench.neighbour_bench import describe, run_neighbour_bench

    _print_report(lambda: run_neighbour_bench(Path(engine), rounds, tokens, batch, _progress), describe, as_json)


@command.command(name="qlinear")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--quick", is_flag=True, help="Shorter timing budget (noisier).")
@click.option("--working-set-mb", type=click.IntRange(1, 1 << 20),
              help="Weight bytes each format rotates over (default: 2 x LLC).")
@click.option("--threads", type=click.IntRange(1, 4096),
              help="CPU threads for torch and our kernels (default: torch's).")
def qlinear(as_json: bool, quick: bool, working_set_mb: Optional[int], threads: Optional[int]) -> None:
    """Weight-only int8/int4 CPU linears vs fp32 F.linear on SmolLM2-135M shapes, weights from DRAM."""
    import torch

    from trtpaged.bench.qlinear_bench import format_report, report_json, run_qlinear_bench

    if working_set_mb is not None:  # checked before allocating: 1 TiB was a traceback from torch's allocator
        from trtpaged.kv_budget import available_memory_bytes

        most = available_memory_bytes("cpu") // (4 << 20)
        if working_set_mb > most:
            raise click.ClickException(f"--working-set-mb: {working_set_mb} MiB per format (4 formats held at once) "
                                       f"is more than this host's available memory; at most {most} here")  # fmt: skip
    if threads is not None:
        torch.set_num_threads(threads)  # one OpenMP runtime: it also sets our kernels' threads

    report = run_qlinear_bench(
        working_set_bytes=working_set_mb << 20 if working_set_mb is not None else None,
        budget_s=0.1 if quick else 0.3,
        progress=_progress,
    )
    echo(report_json(report) if as_json else format_report(report))


@command.command(name="serve")
@click.option("--base-url", type=HttpUrl(), required=True,
              help="The server, e.g. http://127.0.0.1:8000 (any OpenAI-compatible server).")
@click.option("--trace", type=RegularFile(),
              help="JSON Lines trace (as for bench memory), a Mooncake trace (JSON Lines of timestamp, input_length, "
                   "output_length, hash_ids: its prompt a block of words per hash id), an Azure LLM inference or "
                   "BurstGPT trace (CSV, known by its header: prompts random words, nothing shared), a trtllm-bench "
                   "dataset (JSON Lines of task_id, prompt or input_ids, output_tokens: texts sent as text, ids as "
                   "token ids) or a ShareGPT dataset (a JSON array of conversations, read as vLLM's benchmarks read "
                   "it: its prompts' texts sent, lengths counted by the server's POST /tokenize). A timed trace "
                   "(Mooncake, Azure, BurstGPT) sends each request at its timestamp.")
@click.option("--num-requests", type=click.IntRange(1, MAX_REQUESTS), default=100, show_default=True,
              help="Synthetic workload, or a ShareGPT --trace: number of requests.")
@click.option("--prompt-len", default="32:256", show_default=True, help="Synthetic: prompt words N or LOW:HIGH.")
@click.option("--output-len", default="16:128", show_default=True,
              help="Synthetic: output tokens N or LOW:HIGH. With a ShareGPT --trace: N, every request's (default: "
                   "each completion's tokens).")
@click.option("--request-rate", default="inf", show_default=True,
              help="Requests per second (Poisson), or inf (a timed --trace, Mooncake, Azure or BurstGPT: its "
                   "timestamps instead).")
@click.option("--max-concurrency", type=click.IntRange(1, MAX_REQUESTS), default=None,
              help="Requests in flight at most.")
@click.option("--model", default=None, help="Model name to send (default: none; the server's own).")
@click.option("--api-key", envvar="TRTPAGED_API_KEY", default=None, help="Sent as 'Authorization: Bearer KEY'.")
@click.option("--endpoint", type=click.Choice(["completions", "chat"]), default="completions", show_default=True)
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
              help="Ask for exactly the output length.")
@click.option("--seed", default=0, show_default=True,
              help="The prompts' words (a ShareGPT --trace: its shuffle): the same seed resends the same prompts, "
                   "which a server with prefix caching finds cached (another seed for a cold run).")
@click.option("--multi-turn", default=None, metavar="N:K",
              help="Multi-turn traffic: N conversations of K turns, each sending the whole history (with "
                   "--output-len N as the reply length); adds prefix hit rate and prefill tokens computed.")
@click.option("--system-words", type=click.IntRange(1, MAX_WORDS), default=64, show_default=True,
              help="Multi-turn: the shared system prompt's words.")
@click.option("--user-words", type=click.IntRange(1, MAX_WORDS), default=24, show_default=True,
              help="Multi-turn: words of each user message.")
@click.option("--think-time", type=FiniteFloatRange(0, MAX_THINK_S), default=0.5, show_default=True,
              help="Multi-turn: seconds between a reply and the next turn.")
@click.option("--stagger", is_flag=True,
              help="Multi-turn: conversations start spread over one think time, think times vary 0.5-1.5x.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def serve(base_url, trace, num_requests, prompt_len, output_len, request_rate, max_concurrency, model, api_key,
          endpoint, ignore_eos, seed, multi_turn, system_words, user_words, think_time, stagger,
          as_json) -> None:  # fmt: skip
    """Serving benchmark: TTFT, TPOT, ITL, end-to-end latency and throughput of a running server."""
    import asyncio

    given = _given(click.get_current_context(), ("num_requests", "prompt_len", "output_len", "request_rate"))
    if multi_turn is not None:
        from trtpaged.bench.multi_turn import format_multi_turn, run_multi_turn
        from trtpaged.bench.serve_bench import format_report, report_json

        try:
            if trace:
                raise ValueError("--multi-turn, --trace: give one workload (--multi-turn makes its own conversations)")
            spec = multi_turn_spec(multi_turn, output_len, system_words, user_words, think_time, stagger)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        report = asyncio.run(run_multi_turn(base_url, spec, model, api_key, endpoint == "chat", max_concurrency, seed,
                                            progress=_progress))  # fmt: skip
        echo(report_json(report) if as_json else format_report(report) + "\n" + format_multi_turn(report))
        _refuse_an_empty_run(report)
        return

    from trtpaged.bench.serve_bench import (format_report, prompts_from_trace, report_json, run_serve_bench,
                                            sharegpt_requests, timed_requests, trtllm_requests)  # fmt: skip
    from trtpaged.bench.sharegpt import is_sharegpt
    from trtpaged.bench.timed_trace import timed_form
    from trtpaged.bench.trtllm_dataset import is_trtllm_dataset
    from trtpaged.bench.workload import load_trace, parse_range, refuse_foreign, refuse_packed, synthetic_trace

    arrivals = None
    try:
        try:
            rate = float(request_rate)
        except ValueError:
            raise ValueError(f"--request-rate: must be > 0 or inf, got {request_rate!r}") from None
        if not rate > 0:
            raise ValueError(f"--request-rate: must be > 0 or inf, got {request_rate!r}")
        if trace:
            refuse_packed(trace)
            refuse_foreign(trace)
        sharegpt = bool(trace) and is_sharegpt(trace)
        timed = bool(trace) and not sharegpt and timed_form(trace)
        if timed and "request_rate" in given:
            raise ValueError(f"--request-rate: the {timed} --trace {trace} sends each request at its timestamp")
        given -= {"request_rate"}
        _refuse_synthetic_options(trace, given - {"num_requests", "output_len"} if sharegpt else given)
        if timed:
            requests, replay = timed_requests(trace, seed)
            arrivals = replay.seconds()
            _progress(replay.summary() + "; each sent at its timestamp")
        elif trace and is_trtllm_dataset(trace):
            requests, dataset = trtllm_requests(trace)
            ids = next((line for line in dataset.lines if line.input_ids is not None), None)
            if endpoint == "chat" and ids:
                raise ValueError(f"--endpoint chat: {ids.where}: {ids.ids_field}: a prompt of token ids, which only "
                                 "the completions endpoint takes (the default)")  # fmt: skip
            _progress(dataset.summary(arrivals=f"sent at --request-rate {request_rate}"))
        elif sharegpt:
            fixed = _fixed_output_len(output_len, "output_len" in given)
            requests, sample = sharegpt_requests(trace, base_url, num_requests, seed, fixed, api_key, model)
            _progress(sample.summary(num_requests))
        else:
            workload = load_trace(trace) if trace else synthetic_trace(
                num_requests, parse_range(prompt_len, "--prompt-len"), parse_range(output_len, "--output-len"),
                seed=seed)  # fmt: skip
            requests = prompts_from_trace(workload, seed)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    report = asyncio.run(run_serve_bench(base_url, requests, rate, max_concurrency, model, api_key, endpoint == "chat",
                                         ignore_eos, seed, progress=_progress, arrivals=arrivals))  # fmt: skip
    echo(report_json(report) if as_json else format_report(report))
    _refuse_an_empty_run(report)


def _refuse_an_empty_run(report: dict) -> None:
    """A serving benchmark in which no request completed measured nothing: exit 1, saying why."""
    if not report["completed"]:
        first = report["error_examples"][0] if report["error_examples"] else "no request was sent"
        raise click.ClickException(f"no request completed ({report['failed']} failed; first: {first})")


@command.command(name="kv-tiers")
@click.argument("engine", type=click.Path(exists=True, file_okay=False), callback=lambda ctx, p, v: _engine_dir(v, p))
@click.option("--num-kv-blocks", type=click.IntRange(min=1), required=True,
              help="The pool's blocks: small enough that it cannot hold every live history.")
@click.option("--multi-turn", default="8:4", show_default=True, metavar="N:K", help="N conversations of K turns.")
@click.option("--system-words", type=click.IntRange(1, MAX_WORDS), default=64, show_default=True,
              help="The shared system prompt's words.")
@click.option("--user-words", type=click.IntRange(1, MAX_WORDS), default=24, show_default=True,
              help="Words of each user message.")
@click.option("--output-len", default="16", show_default=True, help="Tokens of each reply.")
@click.option("--think-time", type=FiniteFloatRange(0, MAX_THINK_S), default=0.5, show_default=True,
              help="Seconds between a reply and the next turn.")
@click.option("--stagger", is_flag=True,
              help="Conversations start spread over one think time, think times vary 0.5-1.5x (default: lockstep).")
@click.option("--host-memory", type=Size(), default="1GiB", show_default=True, help="The host tier's size.")
@click.option("--disk-size", type=Size(), default="4GiB", show_default=True,
              help="The disk tier's size (a temporary directory).")
@click.option("--remote", default=None, metavar="URL",
              help="Redis for the remote rows (default: a redis-server started for the run when installed).")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when present).")
@click.option("--seed", default=0, show_default=True)
@click.option("--rounds", type=click.IntRange(1, MAX_ROUNDS), default=1, show_default=True,
              help="Repeat every row, the rows' order rotated each round (times: medians over rounds).")
@click.option("--max-num-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens per step (the chunked-prefill budget; default: the engine's).")
@click.option("--rows", default=None, metavar="LIST", callback=lambda ctx, p, v: _rows(v, p),
              help="Only these rows, comma-separated among unbounded, off, host, disk, remote, each once (default: "
                   "all; off, the reference, always runs).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def kv_tiers(engine, num_kv_blocks, multi_turn, system_words, user_words, output_len, think_time, stagger,
             host_memory, disk_size, remote, backend, device, seed, rounds, max_num_tokens, rows,
             as_json) -> None:  # fmt: skip
    """Multi-turn traffic against servers with KV tiers off, host, disk (and a restart), Redis (and a 2nd replica)."""
    from trtpaged.bench.kv_tiers_bench import format_kv_tiers, run_kv_tiers_bench

    reports = []

    def run() -> dict:
        spec = multi_turn_spec(multi_turn, output_len, system_words, user_words, think_time, stagger)
        llm_kwargs = {"backend": backend, "device": device, "max_num_tokens": max_num_tokens}
        reports.append(run_kv_tiers_bench(Path(engine), spec, num_kv_blocks, host_memory, disk_size, remote,
                                          llm_kwargs, seed, rounds, progress=_progress,
                                          rows=rows))  # fmt: skip
        return reports[-1]

    _print_report(run, format_kv_tiers, as_json)
    empty = [name for name, row in reports[-1]["rows"].items() if not row.get("completed")]
    if empty:  # a row in which no turn completed measured nothing: exit 1, saying why (its table row is zeros)
        first = (reports[-1]["rows"][empty[0]].get("error_examples") or ["no message"])[0]
        raise click.ClickException(f"no turn completed in row{'s' if len(empty) > 1 else ''} {', '.join(empty)} "
                                   f"(first error: {first})")


def _rows(value, param):
    """--rows as a list of row names, each once among the bench's (refused at once, before any server starts)."""
    if value is None:
        return None
    from trtpaged.bench.kv_tiers_bench import check_rows

    try:
        return check_rows(value.split(","))
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix("--rows: "), param=param) from None


@command.command(name="serve-ratio")
@click.argument("engine", type=click.Path(exists=True, file_okay=False), callback=lambda ctx, p, v: _engine_dir(v, p))
@click.option("--repeats", type=click.IntRange(1, MAX_ROUNDS), default=5, show_default=True,
              help="Rounds of the five runs, alternating.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=128, show_default=True,
              help="Tokens per request (greedy, ignore_eos).")
@click.option("--concurrency", type=click.IntRange(1, MAX_REQUESTS), default=16, show_default=True,
              help="Concurrent requests of the batch runs.")
@click.option("--server-arg", "server_args", multiple=True, help="Passed on to trtpaged serve (repeatable).")
@click.option("--stream-interval", "stream_intervals", type=click.IntRange(min=1), multiple=True,
              help="serve's --stream-interval (tokens per streamed chunk); repeat it to compare several in the same "
                   "rounds, one server each.  [default: 1]")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def serve_ratio(engine, repeats, max_tokens, concurrency, server_args, stream_intervals, as_json) -> None:
    """trtpaged serve (official openai client, streaming) against the Python API on the same prompts: both ratios."""
    from trtpaged.bench.serve_ratio import format_ratio, run_serve_ratio

    _print_report(lambda: run_serve_ratio(Path(engine), repeats, max_tokens, concurrency, tuple(server_args),
                                          progress=_progress, stream_intervals=stream_intervals or (1,)),
                  format_ratio, as_json)  # fmt: skip


@command.command(name="structured")
@click.argument("engine", type=click.Path(exists=True, file_okay=False), callback=lambda ctx, p, v: _engine_dir(v, p))
@click.option("--batch", type=click.IntRange(min=2), default=None,
              help="Requests decoding together (default: 16, or the engine's max_batch_size when smaller).")
@click.option("--steps", type=click.IntRange(min=2), default=32, show_default=True, help="Decode steps timed per run.")
@click.option("--repeats", type=click.IntRange(1, MAX_ROUNDS), default=5, show_default=True, help="Interleaved rounds.")
@click.option("--temperature", type=FiniteFloatRange(min=0.0), default=0.0, show_default=True,
              help="Of every row (0: greedy; unconstrained greedy rows keep the one-pass path).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def structured(engine, batch, steps, repeats, temperature, as_json) -> None:
    """Decode step time with half the batch under a JSON schema (xgrammar) vs none, interleaved in one run."""
    from trtpaged.bench.structured_bench import format_structured, run_structured_bench

    _print_report(lambda: run_structured_bench(Path(engine), batch, steps, repeats, temperature, progress=_progress),
                  format_structured, as_json)


@command.command(name="throughput")
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@click.option("--trace", type=RegularFile(),
              help='JSON Lines: a bench-memory trace (prompt_len, output_len, ...; token ids are generated), '
                   'prompts ({"prompt": text, "output_len": N}) or a Mooncake trace (token ids generated per hash id); '
                   "an Azure LLM inference or BurstGPT trace (CSV, known by its header; random token ids, nothing "
                   "shared); a trtllm-bench dataset (JSON Lines of task_id, prompt or input_ids, output_tokens; texts "
                   "tokenized, ids as given); or a ShareGPT dataset (a JSON array of conversations, read as vLLM's "
                   "benchmarks read it; its prompts' texts tokenized). Every request is submitted at t=0: a timed "
                   "trace's timestamps (Mooncake, Azure, BurstGPT) are not replayed (bench serve replays them).")
@click.option("--num-requests", type=click.IntRange(1, MAX_REQUESTS), default=16, show_default=True,
              help="Built-in mix (prompts 32-300, outputs 16-240 tokens), or a ShareGPT --trace: requests.")
@click.option("--output-len", type=click.IntRange(min=1), default=None,
              help="With a ShareGPT --trace: every request's output length (vLLM's --sharegpt-output-len; default: "
                   "each completion's tokens).")
@click.option("--baseline", type=click.Choice(("hf", "none")), default="hf", show_default=True,
              help="hf: transformers generate with static batches on the engine's source model.")
@click.option("--hf-batch-size", type=int, help="Baseline static batch size (default: the engine's max_batch_size).")
@click.option("--no-prefix-caching-row", is_flag=True, help="Extra row: trtpaged with prefix caching off.")
@click.option("--engine2", type=click.Path(exists=True, file_okay=False), callback=lambda ctx, p, v: _engine_dir(v, p),
              help="Extra row: a second engine dir on the same requests (e.g. fp32 vs quantized).")
@click.option("--profile", is_flag=True,
              help="Also: where a decode step's time goes (phases, and model ops at batch 1 and 16).")
@click.option("--seed", default=0, show_default=True,
              help="The built-in mix's lengths and prompts, a ShareGPT --trace's shuffle, a timed --trace's token "
                   "ids (a Mooncake trace's blocks).")
@click.option("--rounds", type=click.IntRange(1, MAX_ROUNDS), default=1, show_default=True,
              help="Every row (trtpaged, transformers, llama.cpp) runs the workload this many times in its process, "
                   "each round on fresh prompts of the same shapes, and prints each round's wall: the first batch "
                   "after loading vs the next; the rounds' spread is the run's noise.")
@click.option("--speculative-config", default=None,
              help="Extra rows: trtpaged with this speculative decoding (a JSON object, docs/speculative.md), and "
                   "transformers' assisted generation (prompt lookup, or the draft engine's model as assistant_model; "
                   "one request at a time) as its peer.")
@click.option("--sequential", is_flag=True, help="One request at a time (single-stream decode) in every row.")
@click.option("--peer-time-limit", type=FiniteFloatRange(0, MAX_PEER_TIME_S, min_open=True), default=900.0,
              show_default=True,
              help="Seconds each peer row (transformers, llama.cpp) may take; a row past it is reported as timed out "
                   "and the run goes on.")
@click.option("--llamacpp", is_flag=False, flag_value=_ENGINE_GGUF, default=None, metavar="[GGUF]",
              help="Extra row: llama.cpp on the same requests (greedy, EOS ignored, the trtpaged rows' threads, up to "
                   "the engine's max_batch_size sequences at once, the same --rounds), from this GGUF of the engine's "
                   "model; alone: the GGUF the engine was built from. It runs llama-cpp-cffi's CPU build, installed "
                   f"outside the project's environment: {INSTALL}.")
@click.option("--llamacpp-path", type=click.Path(exists=True, file_okay=False), envvar=PATH_ENV, show_envvar=True,
              help="The directory llama-cpp-cffi is installed in (pip's --target DIR; default: this Python's "
                   "environment).")
@click.option("--llamacpp-preload", type=RegularFile(), envvar=PRELOAD_ENV, show_envvar=True,
              help="A shared library llama.cpp's process loads first: the __cxa_call_terminate stand-in the wheel "
                   "needs where libstdc++ is older than GCC 14's (Debian 12; docs/benchmarks.md).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def throughput(engine, trace, num_requests, output_len, baseline, hf_batch_size, no_prefix_caching_row, engine2,
               profile, seed, rounds, speculative_config, sequential, peer_time_limit, llamacpp, llamacpp_path,
               llamacpp_preload, as_json) -> None:  # fmt: skip
    """End-to-end throughput and latency: trtpaged vs HF transformers (and llama.cpp) on the same requests, side by
    side."""
    from trtpaged.bench.sharegpt import is_sharegpt
    from trtpaged.bench.throughput_bench import (check_requests, default_requests, format_throughput_report,
                                                 load_requests, run_throughput_bench, sharegpt_requests,
                                                 timed_requests, trtllm_requests)  # fmt: skip
    from trtpaged.bench.timed_trace import timed_form
    from trtpaged.bench.trtllm_dataset import is_trtllm_dataset
    from trtpaged.bench.workload import refuse_foreign, refuse_packed
    from trtpaged.errors import check_unicode
    from trtpaged.manifest import read_manifest

    def progress(msg: str) -> None:
        click.echo(f"  {msg}", err=True)

    try:
        manifest = read_manifest(engine)
        if trace:
            refuse_packed(trace)
            refuse_foreign(trace)
        sharegpt = bool(trace) and is_sharegpt(trace)
        if output_len is not None and not sharegpt:
            raise ValueError("--output-len: with a ShareGPT --trace only (a trace line or the built-in mix gives each "
                             "request's own)")  # fmt: skip
        if trace:
            from trtpaged.runtime.llm import load_tokenizer

            tokenizer = load_tokenizer(Path(engine), manifest)
        if trace and not sharegpt:  # a sample's size of a ShareGPT file; each line of another trace is a request
            _refuse_synthetic_options(trace, _given(click.get_current_context(), ("num_requests",)))
        if sharegpt:
            requests, sample = sharegpt_requests(trace, lambda text: list(tokenizer.encode(text)), num_requests, seed,
                                                 output_len, manifest.limits.max_seq_len)  # fmt: skip
            progress(sample.summary(num_requests))
        elif trace and is_trtllm_dataset(trace):
            requests, dataset, prompts = trtllm_requests(trace, lambda text: list(tokenizer.encode(text)),
                                                         manifest.dims.vocab_size)  # fmt: skip
            progress(dataset.summary(prompts))
            check_requests(requests, manifest.limits.max_seq_len, trace)
        elif trace and timed_form(trace):
            requests, timed = timed_requests(trace, manifest.dims.vocab_size, seed, manifest.limits.max_seq_len)
            progress(timed.summary())
            progress("timestamps not replayed: every request is submitted at t=0 (--sequential: one at a time), in "
                     "timestamp order, as the baseline runs them (bench serve replays them)")  # fmt: skip
            check_requests(requests, manifest.limits.max_seq_len, trace)
        elif trace:
            requests = load_requests(trace, lambda text: list(tokenizer.encode(check_unicode("prompt", text))),
                                     manifest.dims.vocab_size, manifest.limits.max_seq_len)  # fmt: skip
            check_requests(requests, manifest.limits.max_seq_len, trace)
        else:
            if num_requests < 1:
                raise ValueError(f"--num-requests: must be >= 1, got {num_requests}")
            requests = default_requests(manifest.dims.vocab_size, num_requests, seed)
        if hf_batch_size is not None and hf_batch_size < 1:
            raise ValueError(f"--hf-batch-size: must be >= 1, got {hf_batch_size}")
        if hf_batch_size is not None and (baseline == "none" or sequential):  # was accepted and ignored
            raise ValueError("--hf-batch-size: the hf baseline's static batch size; " + (
                "--baseline none runs no baseline" if baseline == "none" else "--sequential batches one request"))
        if speculative_config is not None:
            from trtpaged.runtime.speculative import SpeculativeConfig

            speculative_config = SpeculativeConfig.parse(speculative_config).to_dict()
        llama_row = _llamacpp_row(llamacpp, llamacpp_path, llamacpp_preload, manifest, progress)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        report = run_throughput_bench(engine, requests, baseline, hf_batch_size, no_prefix_caching_row, engine2,
                                      progress, rounds, speculative_config, sequential, peer_time_limit,
                                      llama_row)  # fmt: skip
    except RuntimeError as exc:  # a row's process failed: its message, not a traceback of the waiting parent
        raise click.ClickException(str(exc)) from exc
    if profile:
        from trtpaged.bench.step_profile import run_step_profile

        report["profile"] = run_step_profile(engine, say=progress)
    if as_json:
        echo(json.dumps(report, indent=2))
        return
    echo(format_throughput_report(report))
    if profile:
        from trtpaged.bench.step_profile import format_step_profile

        echo("\n" + format_step_profile(report["profile"]))


def _llamacpp_row(gguf: Optional[str], path: Optional[str], preload: Optional[str], manifest,
                  say: Callable[[str], None]):  # fmt: skip
    """The llama.cpp row --llamacpp asks for (None without it), checked before any row runs: the GGUF readable and
    of the engine's vocabulary, llama-cpp-cffi found and loading (in a process of its own). ValueError naming the
    option otherwise; --llamacpp-path or --llamacpp-preload given without --llamacpp is refused (it would change
    nothing)."""
    from trtpaged.bench.llamacpp import Library, LlamaCppRow, check_gguf, default_threads, engine_gguf, in_child, probe

    if gguf is None:  # their environment variables may be set for every run: only the command line's are refused
        from click.core import ParameterSource

        ctx = click.get_current_context()
        given = [f"--{name}" for name in ("llamacpp-path", "llamacpp-preload")
                 if ctx.get_parameter_source(name.replace("-", "_")) is ParameterSource.COMMANDLINE]  # fmt: skip
        if given:
            flags = ", ".join(given)
            raise ValueError(f"{flags}: where llama.cpp's row finds llama-cpp-cffi; give --llamacpp [GGUF] for the row")
        return None
    own = gguf == _ENGINE_GGUF
    if own:
        gguf = engine_gguf(manifest)
        if gguf is None:
            raise ValueError(f"--llamacpp: the engine was not built from a GGUF (its model: "
                             f"{manifest.source.get('kind')}); give one of its model: --llamacpp GGUF")  # fmt: skip
        say(f"llama.cpp: the GGUF the engine was built from, {gguf}")
    if not gguf:
        raise ValueError("--llamacpp: an empty path; give a GGUF, or --llamacpp alone for the engine's own")
    try:
        check_gguf(gguf, manifest.dims.vocab_size)
    except ValueError as exc:
        raise ValueError(f"{exc} (the GGUF the engine was built from; give another: --llamacpp GGUF)" if own
                         else str(exc)) from None  # fmt: skip
    library = Library(path, preload)
    library.module_file()  # not installed there: how to install it, before anything loads
    say(f"llama.cpp: {in_child(probe, library)}")
    return LlamaCppRow(gguf, library, default_threads())


def multi_turn_spec(multi_turn: str, output_len: str, system_words: int, user_words: int, think_time: float,
                    stagger: bool = False):
    """The --multi-turn options as a MultiTurnSpec (the reply length: --output-len's lower bound)."""
    from trtpaged.bench.multi_turn import MultiTurnSpec, parse_multi_turn
    from trtpaged.bench.workload import parse_range

    conversations, turns = parse_multi_turn(multi_turn)
    return MultiTurnSpec(conversations, turns, system_words, user_words, parse_range(output_len, "--output-len")[0],
                         think_time, stagger)
