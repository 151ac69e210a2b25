"""llama.cpp on the workloads of `trtpaged bench throughput`, for a side-by-side figure.

Same requests (the built-in 16-request mix, or a trace), greedy, EOS ignored, all submitted at t=0;
each sequence leaves when done: prompts are prefilled in llama_decode calls of up to n_batch tokens,
then each step is one llama_decode with one token per running sequence (llama.cpp's batched API,
unified KV cache, flash attention on: its faster setting here). Prints useful tok/s, TTFT and
decode ms/token, like the trtpaged rows.

llama.cpp comes from the `llama-cpp-cffi` wheel (its CPU build), kept out of the project's
environment:

    pip install --no-deps --target /tmp/llamacpp llama-cpp-cffi==0.4.42
    PYTHONPATH=/tmp/llamacpp:$PWD python scripts/llamacpp_bench.py GGUF [mix | TRACE.jsonl] [--repeats N]

That build needs GCC 14's libstdc++ (`__cxa_call_terminate`); with an older one (Debian 12: GCC 12),
preload a one-line stand-in: `echo 'extern "C" void __cxa_call_terminate(void*) noexcept {
__builtin_trap(); }' | g++ -x c++ -shared -fPIC -o /tmp/cxa_shim.so -` then `LD_PRELOAD=/tmp/cxa_shim.so`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

os.environ.setdefault("LLAMA_CPP_BACKEND", "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("workload", nargs="?", default="mix", help="mix (the built-in 16 requests) or a trace file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    from llama.llama_cpp import ffi, lib  # llama-cpp-cffi

    from trtpaged.bench.throughput_bench import default_requests, requests_from_trace
    from trtpaged.bench.workload import load_trace

    lib.llama_backend_init()
    # which instruction sets this llama.cpp build uses (its CPU backend's compiled features, e.g. the
    # llama-cpp-cffi 0.4.42 wheel: AVX2, FMA, F16C, no AVX-512), printed with the figures
    system_info = ffi.string(lib.llama_print_system_info()).decode().strip()
    model = lib.llama_model_load_from_file(args.gguf.encode(), lib.llama_model_default_params())
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    requests = (default_requests(vocab) if args.workload == "mix"
                else requests_from_trace(load_trace(args.workload), vocab))  # fmt: skip
    params = lib.llama_context_default_params()
    params.n_ctx = max(2048, sum(len(r.prompt_ids) + r.output_len for r in requests) + 256)
    params.n_batch, params.n_ubatch, params.n_seq_max = 2048, 512, len(requests)
    params.n_threads = params.n_threads_batch = args.threads
    params.flash_attn, params.no_perf = True, True
    ctx = lib.llama_init_from_model(model, params)
    batch = lib.llama_batch_init(params.n_batch, 0, 1)

    def decode(items: list[tuple[int, int, int, bool]]) -> list[int]:
        """Runs (token, position, sequence, wants logits) items; returns the rows that have logits."""
        batch.n_tokens = len(items)
        for i, (token, pos, seq, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, int(want)
            batch.seq_id[i][0] = seq
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [i for i, item in enumerate(items) if item[3]]

    def greedy(row: int) -> int:
        logits = lib.llama_get_logits_ith(ctx, row)
        return int(np.frombuffer(ffi.buffer(logits, vocab * 4), dtype=np.float32).argmax())

    def run() -> tuple[float, float]:
        lib.llama_kv_self_clear(ctx)
        start = time.perf_counter()
        running: list[tuple[int, int, int]] = []  # (sequence, next token, its position)
        items: list[tuple[int, int, int, bool]] = []
        for seq, r in enumerate(requests):
            for pos, token in enumerate(r.prompt_ids):
                items.append((token, pos, seq, pos == len(r.prompt_ids) - 1))
                if len(items) == params.n_batch:
                    running += [(items[i][2], greedy(i), items[i][1] + 1) for i in decode(items)]
                    items = []
        if items:
            running += [(items[i][2], greedy(i), items[i][1] + 1) for i in decode(items)]
        ttft = time.perf_counter() - start
        left = {seq: requests[seq].output_len - 1 for seq, _, _ in running}
        running = [s for s in running if left[s[0]] > 0]
        while running:
            rows = decode([(token, pos, seq, True) for seq, token, pos in running])
            following = []
            for (seq, _, pos), row in zip(running, rows):
                token = greedy(row)
                left[seq] -= 1
                if left[seq] > 0:
                    following.append((seq, token, pos + 1))
            running = following
        return time.perf_counter() - start, ttft

    run()  # warm-up
    results = [run() for _ in range(args.repeats)]
    outputs = sum(r.output_len for r in requests)
    walls = [w for w, _ in results]
    wall, ttft = statistics.median(walls), statistics.median(t for _, t in results)
    single = f", decode {(wall - ttft) / max(outputs - 1, 1) * 1e3:.2f} ms/token" if len(requests) == 1 else ""
    print(f"llama.cpp instruction sets: {system_info}")
    print(f"llama.cpp ({args.workload}, {args.threads} threads, flash attention): {len(requests)} requests, "
          f"{outputs} output tokens; median of {args.repeats}: useful {outputs / wall:.1f} tok/s "
          f"(runs {', '.join(f'{outputs / w:.1f}' for w in walls)}), TTFT {ttft:.2f} s{single}")  # fmt: skip


if __name__ == "__main__":
    main()
