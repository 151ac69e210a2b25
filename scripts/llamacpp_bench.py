"""llama.cpp alone on the workloads of `trtpaged bench throughput` (whose `--llamacpp` row runs it side by side).

The same requests (the built-in 16-request mix, or a trace), greedy, EOS ignored, all submitted at t=0, run by
trtpaged.bench.llamacpp: a warm-up, then `--repeats` runs of the same requests; prints the instruction sets line
and the useful tok/s of each run (their median), TTFT p50 and, for one request, its decode ms/token.

llama-cpp-cffi is installed outside the project's environment, and on Debian 12 needs a stand-in for GCC 14's
`__cxa_call_terminate` (docs/benchmarks.md, `bench throughput`):

    pip install --no-deps --target /tmp/llamacpp llama-cpp-cffi==0.4.42 cffi
    python scripts/llamacpp_bench.py GGUF [mix | TRACE.jsonl] [--repeats N] [--threads N]
        [--llamacpp-path /tmp/llamacpp] [--llamacpp-preload /tmp/cxa_shim.so]

`--llamacpp-path` and `--llamacpp-preload` default to $TRTPAGED_LLAMACPP_PATH and $TRTPAGED_LLAMACPP_PRELOAD.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from trtpaged.bench.llamacpp import PATH_ENV, PRELOAD_ENV, Library, LlamaCppError, Runner, default_threads
from trtpaged.bench.throughput_bench import Request, default_requests, percentile, requests_from_trace
from trtpaged.bench.workload import load_trace
from trtpaged.models.gguf_header import GGUFHeaderError, read_layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("workload", nargs="?", default="mix", help="mix (the built-in 16 requests) or a trace file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--llamacpp-path", default=os.environ.get(PATH_ENV))
    parser.add_argument("--llamacpp-preload", default=os.environ.get(PRELOAD_ENV))
    args = parser.parse_args()
    try:
        vocab = read_layout(args.gguf).array_lengths.get("tokenizer.ggml.tokens", 0)
    except GGUFHeaderError as exc:
        sys.exit(f"{args.gguf}: not a readable GGUF file: {exc}")
    requests = (default_requests(vocab) if args.workload == "mix"
                else requests_from_trace(load_trace(args.workload), vocab))  # fmt: skip
    try:
        runner = Runner(Library(args.llamacpp_path, args.llamacpp_preload), args.gguf, requests, len(requests),
                        args.threads)  # fmt: skip
    except LlamaCppError as exc:
        sys.exit(str(exc))
    runner.run([Request(requests[0].prompt_ids[:4], 3)])  # warm-up
    rounds = [runner.run(requests) for _ in range(args.repeats)]
    outputs = sum(r.output_len for r in requests)
    rates = [outputs / r.wall for r in rounds]
    ttft = statistics.median(percentile([t[0] for t in r.times], 50) for r in rounds)
    single = ""
    if len(requests) == 1 and outputs > 1:
        decode = statistics.median((r.times[0][-1] - r.times[0][0]) / (outputs - 1) for r in rounds)
        single = f", decode {decode * 1e3:.2f} ms/token"
    print(f"llama.cpp instruction sets: {runner.isa}")
    print(f"llama.cpp ({args.workload}, {args.threads} threads, flash attention): {len(requests)} requests, "
          f"{outputs} output tokens; median of {args.repeats}: useful {statistics.median(rates):.1f} tok/s "
          f"(runs {', '.join(f'{r:.1f}' for r in rates)}), TTFT p50 {ttft:.2f} s{single}")  # fmt: skip


if __name__ == "__main__":
    main()
