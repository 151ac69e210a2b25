"""The C runtime (libtrtpaged_runtime, plugins/include/trtpaged/runtime.h) for the tests: built from the tree with
CMake, bound with ctypes, and its example program run."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
I32, I64, U32, F32, P = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32, ctypes.c_float, ctypes.c_void_p
FINISH = {0: "running", 1: "stop", 2: "length", 3: "abort", 4: "error"}
STATUS = {0: "ok", 1: "invalid_argument", 2: "unsupported", 3: "cuda", 4: "not_built", 5: "io", 6: "out_of_memory"}


def setup_build_dir() -> Optional[Path]:
    """The CMake dir `pip install -e .` (scripts/setup.sh) built this checkout in, if it has the C runtime:
    building the runtime's targets there is incremental (its kernel library is already built), where a dir
    of the tests' own would compile the CPU kernels again (about a minute on 2 cores)."""
    for cache in sorted((REPO / "build").glob("*/CMakeCache.txt"), key=lambda p: -p.stat().st_mtime):
        text = cache.read_text(errors="replace")
        if f"CMAKE_HOME_DIRECTORY:INTERNAL={REPO}\n" in text and "nlohmann_json_DIR:PATH=" in text \
                and "nlohmann_json_DIR:PATH=nlohmann_json_DIR-NOTFOUND" not in text:
            return cache.parent
    return None


def build(build_dir: Path, *targets: str) -> Path:
    """Builds the runtime and its example in build_dir, or the given targets, configuring a new dir first (CPU
    only); returns build_dir. Incremental: an up-to-date dir costs a few seconds."""
    if not (build_dir / "CMakeCache.txt").exists():
        configure = ["cmake", "-S", str(REPO), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                     "-DTRTPAGED_CUDA=OFF"]
        done = subprocess.run(configure, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "C runtime library ON" in done.stdout, "CMake skipped the C runtime:\n" + done.stdout
    targets = targets or ("trtpaged_runtime", "trtpaged_generate")
    done = subprocess.run(["cmake", "--build", str(build_dir), "-j2", "--target", *targets], capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return build_dir


def generate(build_dir: Path, engine_dir: Path, prompts: Sequence[Sequence[int]], *args: str,
             env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Runs examples/cpp/generate.cpp's program on token-id prompts."""
    cmd = [str(build_dir / "trtpaged_generate"), str(engine_dir), *args, *[",".join(map(str, p)) for p in prompts]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})


def parse_outputs(stdout: str) -> tuple[dict[int, list[int]], dict[int, str], dict[str, int]]:
    """(request index -> token ids, request index -> finish reason, stats counters) of the example's output."""
    tokens, reasons, stats = {}, {}, {}
    for line in stdout.splitlines():
        if line.startswith("request "):
            head, rest = line.split(":", 1)
            ids, reason = rest.rsplit("(", 1)
            tokens[int(head.split()[1])] = [int(t) for t in ids.split()]
            reasons[int(head.split()[1])] = reason.rstrip(")")
        elif line.startswith("stats:"):
            words = line.split()[1:]
            stats = {words[i]: int(words[i + 1]) for i in range(0, len(words), 2)}
    return tokens, reasons, stats


class OpenOptions(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("num_kv_blocks", I64), ("kv_bytes", I64), ("max_batch_size", I32),
                ("max_num_tokens", I32), ("max_seq_len", I32), ("enable_prefix_caching", I32),
                ("backend", ctypes.c_char_p)]


class Info(ctypes.Structure):
    _fields_ = [(name, I32) for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                         "head_dim", "block_size", "max_batch_size", "max_num_tokens", "max_seq_len")]
    _fields_ += [("num_kv_blocks", I64), ("kv_bytes_per_block", I64), ("num_eos_token_ids", I32),
                 ("eos_token_ids", I32 * 8), ("quantized", I32), ("one_call_layers", I32)]


class StepInputs(ctypes.Structure):
    _fields_ = [("num_tokens", I32), ("num_seqs", I32), ("max_blocks_per_seq", I32), ("num_outputs", I32)]
    _fields_ += [(name, P) for name in ("input_ids", "positions", "query_start", "context_lens", "block_tables",
                                        "logits_index")]


class Sampling(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("max_tokens", I32), ("temperature", F32), ("top_k", I32), ("top_p", F32),
                ("has_seed", I32), ("seed", ctypes.c_uint64), ("stop_token_ids", P), ("num_stop_token_ids", I32),
                ("ignore_eos", I32)]


class Stats(ctypes.Structure):
    _fields_ = [("num_waiting", I32), ("num_running", I32), ("num_steps", I64), ("num_tokens_computed", I64),
                ("num_preemptions", I64), ("kv_blocks_free", I64), ("kv_blocks_used", I64),
                ("prefix_cache_hits_tokens", I64)]


class CError(RuntimeError):
    """A failed C call: `status` (a STATUS name) and the trtpaged_last_error() message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{STATUS.get(status, status)}: {message}")
        self.status, self.message = STATUS.get(status, str(status)), message


def load(build_dir: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_dir / "libtrtpaged_runtime.so"))
    lib.trtpaged_last_error.restype = ctypes.c_char_p
    for name, args in {"trtpaged_runtime_open": [ctypes.c_char_p, P, P], "trtpaged_runtime_get_info": [P, P],
                       "trtpaged_runtime_step": [P, P, P, ctypes.c_size_t], "trtpaged_request_add": [P, P, I32, P, P],
                       "trtpaged_runtime_run_step": [P, P], "trtpaged_request_read": [P, I64, P, I32, P, P],
                       "trtpaged_request_abort": [P, I64], "trtpaged_runtime_get_stats": [P, P],
                       "trtpaged_runtime_get_counter": [P, ctypes.c_char_p, P],
                       "trtpaged_runtime_copy_blocks": [P, P, I32]}.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int
    lib.trtpaged_runtime_close.argtypes = [P]
    lib.trtpaged_runtime_close.restype = None
    return lib


def check(lib: ctypes.CDLL, status: int) -> None:
    if status:
        raise CError(status, lib.trtpaged_last_error().decode())


def i32_array(values: Sequence[int]):
    return (I32 * max(1, len(values)))(*values)


class CRuntime:
    """One trtpaged_runtime handle."""

    def __init__(self, lib: ctypes.CDLL, engine_dir: Path, **options) -> None:
        self.lib = lib
        opts = OpenOptions()
        lib.trtpaged_open_options_init(ctypes.byref(opts))
        for key, value in options.items():
            setattr(opts, key, value)
        handle = P()
        check(lib, lib.trtpaged_runtime_open(str(engine_dir).encode(), ctypes.byref(opts), ctypes.byref(handle)))
        self.handle = handle
        self.info = Info()
        check(lib, lib.trtpaged_runtime_get_info(handle, ctypes.byref(self.info)))

    def close(self) -> None:
        if self.handle:
            self.lib.trtpaged_runtime_close(self.handle)
            self.handle = P()

    def __enter__(self) -> "CRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add(self, prompt: Sequence[int], max_tokens: int = 16, ignore_eos: bool = True, **sampling) -> int:
        s = Sampling()
        self.lib.trtpaged_sampling_init(ctypes.byref(s))
        s.max_tokens, s.ignore_eos = max_tokens, int(ignore_eos)
        for key, value in sampling.items():
            setattr(s, key, value)
        rid = I64()
        check(self.lib, self.lib.trtpaged_request_add(self.handle, i32_array(prompt), len(prompt), ctypes.byref(s),
                                                      ctypes.byref(rid)))
        return rid.value

    def run_step(self) -> int:
        n = I32()
        check(self.lib, self.lib.trtpaged_runtime_run_step(self.handle, ctypes.byref(n)))
        return n.value

    def read(self, rid: int, capacity: int = 4096) -> tuple[list[int], str]:
        buf, n, reason = (I32 * capacity)(), I32(), I32()
        check(self.lib, self.lib.trtpaged_request_read(self.handle, rid, buf, capacity, ctypes.byref(n),
                                                       ctypes.byref(reason)))
        return list(buf[: n.value]), FINISH[reason.value]

    def stats(self) -> Stats:
        st = Stats()
        check(self.lib, self.lib.trtpaged_runtime_get_stats(self.handle, ctypes.byref(st)))
        return st

    def counter(self, name: str | bytes) -> int:
        """trtpaged_runtime_get_counter: one counter by name."""
        value = ctypes.c_int64(-1)
        check(self.lib, self.lib.trtpaged_runtime_get_counter(self.handle, name if isinstance(name, bytes) else
                                                              name.encode(), ctypes.byref(value)))  # fmt: skip
        return value.value

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        """Adds every prompt, steps until all finish; the token ids of each."""
        ids = [self.add(p, max_tokens) for p in prompts]
        out: dict[int, list[int]] = {rid: [] for rid in ids}
        live = set(ids)
        while live:
            assert self.run_step() > 0, "no progress"
            for rid in sorted(live):
                tokens, reason = self.read(rid)
                out[rid] += tokens
                if reason != "running":
                    live.discard(rid)
        return [out[rid] for rid in ids]
