"""llama.cpp on `bench throughput`'s requests: its row, run in a process of its own.

llama.cpp comes from the `llama-cpp-cffi` wheel's CPU build, installed outside the project's environment
(`INSTALL`; `--llamacpp-path` / TRTPAGED_LLAMACPP_PATH name that directory). Its compiled module is loaded by
file, not through the wheel's package, whose `__init__` imports transformers and torch: they would add hundreds
of MiB to the row's peak RSS and seconds to its start. The wheel is built against GCC 14's libstdc++
(`__cxa_call_terminate`); with an older one (Debian 12: GCC 12) a one-line stand-in is loaded first
(`--llamacpp-preload` / TRTPAGED_LLAMACPP_PRELOAD, `SHIM_RECIPE`).

The run: greedy, EOS ignored, every request submitted at t=0 (or one at a time), continuous batching as
llama-server does it: up to `max_seqs` sequences at once in one unified KV cache (flash attention on), each step
one llama_decode of one token per decoding sequence plus prompt tokens up to n_batch; a sequence leaves when its
output is done and a waiting request takes its place.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from trtpaged.bench.noise import NoiseMonitor
from trtpaged.bench.throughput_bench import Request, SystemResult, later_rounds, system_result

VERSION = "0.4.42"  # the wheel this row is written against (its llama_kv_self_* API)
INSTALL = f"pip install --no-deps --target DIR llama-cpp-cffi=={VERSION} cffi"  # cffi: its compiled module's backend
PATH_ENV, PRELOAD_ENV = "TRTPAGED_LLAMACPP_PATH", "TRTPAGED_LLAMACPP_PRELOAD"
SHIM_RECIPE = ("echo 'extern \"C\" void __cxa_call_terminate(void*) noexcept { __builtin_trap(); }' | "
               "g++ -x c++ -shared -fPIC -o cxa_shim.so -")  # fmt: skip
NAME = "llama.cpp"
N_BATCH, N_UBATCH = 2048, 512
_FUNCTIONS = ("llama_backend_init", "llama_model_load_from_file", "llama_init_from_model", "llama_decode",
              "llama_get_logits_ith", "llama_kv_self_clear", "llama_kv_self_seq_rm", "llama_print_system_info")


class LlamaCppError(ValueError):
    """llama.cpp cannot run here: not installed where it was looked for, not loadable, or the GGUF is unusable.
    The message names the option to change and how."""


@dataclass(frozen=True)
class Library:
    """Where llama-cpp-cffi is: `path` the directory holding its `llama` package (pip --target), None for this
    Python's own site-packages; `preload` a shared library loaded before it (the libstdc++ stand-in)."""

    path: Optional[str] = None
    preload: Optional[str] = None

    def module_file(self) -> Path:
        """The CPU build's compiled module, found without importing anything; LlamaCppError saying how to install
        it when it is not there."""
        where = f"in {self.path} (--llamacpp-path / {PATH_ENV})" if self.path else \
            f"in this Python's environment (point --llamacpp-path or {PATH_ENV} at the directory it is installed in)"
        spec = importlib.machinery.PathFinder.find_spec("llama", [self.path] if self.path else None)
        found = []
        if spec is not None and spec.submodule_search_locations:
            package = Path(list(spec.submodule_search_locations)[0])
            found = [p for s in importlib.machinery.EXTENSION_SUFFIXES for p in package.glob(f"_llama_cpp_cpu{s}")]
        if not found:
            raise LlamaCppError(f"--llamacpp: llama-cpp-cffi is not installed {where}; install it outside the "
                                f"project's environment with `{INSTALL}` and give that DIR")  # fmt: skip
        return found[0]

    def version(self) -> str:
        dists = importlib.metadata.distributions(name="llama-cpp-cffi", path=[self.path] if self.path else sys.path)
        return next((d.version for d in dists), "of unknown version")

    @functools.lru_cache(maxsize=None)  # a few Library values per process, each loaded once
    def load(self):
        """(ffi, lib) of the CPU build, its logging off. LlamaCppError naming the option to change when it does not
        load or lacks a function this row calls."""
        import ctypes

        module_file = self.module_file()
        if self.preload:
            try:
                ctypes.CDLL(self.preload, mode=ctypes.RTLD_GLOBAL)  # its symbols resolve the module's below
            except OSError as exc:
                raise LlamaCppError(f"--llamacpp-preload ({PRELOAD_ENV}): {exc}") from None
        try:
            self._cffi_backend()
            module = _extension("_llama_cpp_cpu", module_file)
        except ImportError as exc:
            hint = (f"; this build needs GCC 14's libstdc++: build a stand-in with `{SHIM_RECIPE}` and give its path "
                    f"to --llamacpp-preload (or {PRELOAD_ENV})") if "__cxa_call_terminate" in str(exc) else ""
            raise LlamaCppError(f"--llamacpp: {module_file} does not load: {exc}{hint}") from None
        ffi, lib = module.ffi, module.lib
        missing = [name for name in _FUNCTIONS if not hasattr(lib, name)]
        if missing:
            raise LlamaCppError(f"--llamacpp: llama-cpp-cffi {self.version()} lacks {', '.join(missing)}; this row "
                                f"runs {VERSION}: `{INSTALL}`")  # fmt: skip

        @ffi.def_extern(name="llama_cpp_cffi_ggml_log_callback")
        def _quiet(level, text, user_data):  # the wheel declares this callback; without one llama.cpp logs to stderr
            pass

        lib.llama_log_set(lib.llama_cpp_cffi_ggml_log_callback, ffi.NULL)
        lib.llama_backend_init()
        return ffi, lib

    def _cffi_backend(self) -> None:
        """cffi's C backend, which the compiled module imports: this environment's, else the one installed beside
        llama-cpp-cffi in `path` (pip --target DIR ... cffi; `path` is not put on sys.path: its `llama` package's
        `__init__` imports torch)."""
        if importlib.util.find_spec("_cffi_backend") is not None or self.path is None:
            return
        found = [p for s in importlib.machinery.EXTENSION_SUFFIXES for p in Path(self.path).glob(f"_cffi_backend{s}")]
        if found:
            sys.modules["_cffi_backend"] = _extension("_cffi_backend", found[0])

    def describe(self, lib, ffi) -> str:
        """The instruction sets line: the wheel's version and its CPU backend's compiled features."""
        features = ffi.string(lib.llama_print_system_info()).decode().strip()
        return f"llama-cpp-cffi {self.version()}, {features.removeprefix('CPU : ').rstrip(' |')}"


def _extension(name: str, file: Path):
    """The compiled module `name` loaded from `file`."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(file))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    return module


@dataclass(frozen=True)
class LlamaCppRow:
    """What `bench throughput --llamacpp` runs: a GGUF, the library, the threads."""

    gguf: str
    library: Library
    threads: int


def engine_gguf(manifest) -> Optional[str]:
    """The GGUF an engine was built from (model.path or model.package in its model.yaml), or None."""
    source = manifest.source or {}
    return source["path"] if source.get("kind") in ("gguf", "package") and source.get("path") else None


def check_gguf(path: str, vocab_size: int) -> None:
    """LlamaCppError naming --llamacpp when `path` is not a readable GGUF, or holds another vocabulary than the
    engine's (the requests are token ids: they would mean other text, or none)."""
    from trtpaged.models.gguf_header import GGUFHeaderError, read_layout

    try:
        layout = read_layout(path)
    except GGUFHeaderError as exc:
        raise LlamaCppError(f"--llamacpp: {path} is not a readable GGUF file: {exc}") from None
    tokens = layout.array_lengths.get("tokenizer.ggml.tokens")
    if tokens != vocab_size:
        held = "no vocabulary (tokenizer.ggml.tokens)" if tokens is None else f"a vocabulary of {tokens} tokens"
        raise LlamaCppError(f"--llamacpp: {path} has {held}, the engine {vocab_size}: the requests' token ids "
                            "would not be the same text; give a GGUF of the engine's model")  # fmt: skip


def default_threads() -> int:
    """The threads the trtpaged rows run: OMP_NUM_THREADS, else the CPUs this process may run on (OpenMP's)."""
    with contextlib.suppress(ValueError):
        if int(os.environ.get("OMP_NUM_THREADS", "")) > 0:
            return int(os.environ["OMP_NUM_THREADS"])
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def probe(library: Library) -> str:
    """Loads the library (in a process of its own: see `in_child`) and returns its instruction sets line."""
    ffi, lib = library.load()
    return library.describe(lib, ffi)


def in_child(fn: Callable, *args):
    """fn(*args) in a fresh spawned process (the library's symbols and memory stay there); its exceptions are
    raised here, a crash as LlamaCppError."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(fn, *args).result()
    except BrokenProcessPool:
        raise LlamaCppError("--llamacpp: llama.cpp's process died while loading (a build for instruction sets this "
                            "CPU lacks?)") from None  # fmt: skip


@dataclass
class Round:
    """One run of the requests: wall, each request's token times (from t=0) and tokens, tokens computed."""

    wall: float
    submitted: list[float]
    times: list[list[float]]
    tokens: list[list[int]]
    computed: int


class Runner:
    """A model and a context sized for the requests (`max_seqs` sequences at once, `threads` threads)."""

    def __init__(self, library: Library, gguf: str, requests: list[Request], max_seqs: int, threads: int) -> None:
        import numpy as np

        self.np = np
        self.ffi, self.lib = ffi, lib = library.load()
        self.isa = library.describe(lib, ffi)
        self.model = lib.llama_model_load_from_file(gguf.encode(), lib.llama_model_default_params())
        if self.model == ffi.NULL:
            raise LlamaCppError(f"--llamacpp: llama.cpp could not load {gguf}")
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.max_seqs = max(1, min(max_seqs, len(requests)))
        # the KV cells the most tokens `max_seqs` sequences can hold at once, and two ubatches' room to place a new one
        longest = sorted((len(r.prompt_ids) + r.output_len for r in requests), reverse=True)
        params = lib.llama_context_default_params()
        params.n_ctx = min(sum(longest), sum(longest[: self.max_seqs]) + 2 * N_UBATCH) + 256
        params.n_batch, params.n_ubatch, params.n_seq_max = N_BATCH, N_UBATCH, self.max_seqs
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn, params.no_perf, params.defrag_thold = True, True, 0.1  # llama-server's defrag threshold
        self.ctx = lib.llama_init_from_model(self.model, params)
        if self.ctx == ffi.NULL:
            raise LlamaCppError(f"--llamacpp: llama.cpp could not make a context of {params.n_ctx} tokens")
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """Runs (token, position, sequence, wants logits) items in one llama_decode."""
        batch = self.batch
        batch.n_tokens = len(items)
        for i, (token, pos, seq, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, int(want)
            batch.seq_id[i][0] = seq
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} (1: no room in its KV cache)")

    def _greedy(self, row: int) -> int:
        logits = self.lib.llama_get_logits_ith(self.ctx, row)
        return int(self.np.frombuffer(self.ffi.buffer(logits, self.vocab * 4), dtype=self.np.float32).argmax())

    def run(self, requests: list[Request], sequential: bool = False) -> Round:
        """Every request at t=0 (`sequential`: each once the one before is done), until each has its output_len
        tokens."""
        self.lib.llama_kv_self_clear(self.ctx)
        waiting = list(range(len(requests)))[::-1]
        free = list(range(self.max_seqs))[::-1]
        live: dict[int, int] = {}  # sequence -> request, in admission order
        fed = [0] * len(requests)  # prompt tokens decoded
        out = Round(0.0, [0.0] * len(requests), [[] for _ in requests], [[] for _ in requests], 0)
        start = time.perf_counter()
        while waiting or live:
            while waiting and free and not (sequential and live):
                live[free.pop()] = i = waiting.pop()
                out.submitted[i] = time.perf_counter() - start if sequential else 0.0
            items = [(out.tokens[i][-1], len(requests[i].prompt_ids) + len(out.tokens[i]) - 1, seq, True)
                     for seq, i in live.items() if out.tokens[i]]  # fmt: skip
            for seq, i in live.items():
                prompt = requests[i].prompt_ids
                take = min(N_BATCH - len(items), len(prompt) - fed[i])
                items += [(prompt[p], p, seq, p == len(prompt) - 1) for p in range(fed[i], fed[i] + max(take, 0))]
                fed[i] += max(take, 0)
            self._decode(items)
            out.computed += len(items)
            now = time.perf_counter() - start
            for row, (_, _, seq, want) in enumerate(items):
                if not want:
                    continue
                i = live[seq]
                out.tokens[i].append(self._greedy(row))
                out.times[i].append(now)
                if len(out.tokens[i]) == requests[i].output_len:
                    self.lib.llama_kv_self_seq_rm(self.ctx, seq, -1, -1)
                    del live[seq]
                    free.append(seq)
        out.wall = time.perf_counter() - start
        return out


def run_llamacpp(gguf: str, requests: list[Request], library: Library, max_seqs: int, threads: int,
                 rounds: int = 1, sequential: bool = False,
                 say: Callable[[str], None] = lambda _m: None) -> SystemResult:  # fmt: skip
    """llama.cpp's row, as `run_trtpaged` makes trtpaged's: a short warm-up unless rounds > 1 (then the first round
    is the first batch after loading), the first round's figures, every round's wall (rounds after the first on
    fresh prompts of the same shapes, the same as trtpaged's rounds)."""
    runner = Runner(library, gguf, requests, 1 if sequential else max_seqs, threads)
    if rounds == 1:
        runner.run([Request(requests[0].prompt_ids[:4], 3)])

    def timed(work: list[Request]) -> SystemResult:
        with NoiseMonitor() as monitor:
            done = runner.run(work, sequential)
        made = sum(len(t) for t in done.tokens)
        if made != sum(q.output_len for q in work):
            raise RuntimeError(f"llama.cpp generated {made} tokens, the requests ask {sum(q.output_len for q in work)}")
        ttft = [t[0] - s for t, s in zip(done.times, done.submitted)]
        tpot = [(t[-1] - t[0]) / (q.output_len - 1) for t, q in zip(done.times, work) if q.output_len > 1]
        return system_result(NAME, work, done.wall, done.computed, ttft, tpot, monitor)

    result = later_rounds(timed(requests), requests, runner.vocab, rounds, say, lambda work, _: timed(work))
    result.isa = runner.isa
    result.notes.append(f"{Path(gguf).name}, {threads} threads, flash attention, up to {runner.max_seqs} sequences "
                        f"at once")  # fmt: skip
    return result


def generate(gguf: str, requests: list[Request], library: Library, threads: int) -> list[list[int]]:
    """Each request's greedy tokens (all submitted at once), for comparing with another system's."""
    return Runner(library, gguf, requests, len(requests), threads).run(requests).tokens

