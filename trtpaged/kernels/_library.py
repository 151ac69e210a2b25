"""The kernel library itself: where libtrtpaged_kernels.so is found, loading it once, the ctypes
declarations of its C ABI (plugins/include/trtpaged/trtpaged.h), KernelError and status handling, and
the argument checks every kernel family shares.

The library is found, in order, at $TRTPAGED_KERNELS_LIB, inside the installed package
(trtpaged/_lib), or in a local CMake build dir.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Iterable

import torch

from trtpaged.kv_formats import FLOAT_KV_CACHE_DTYPES, KV_FORMATS, QUANTIZED_KV_CACHE_DTYPES, SCALE_BYTES
from trtpaged.kv_quant import STORAGE_DTYPES
from trtpaged.step_io import MAX_KV_BLOCKS

LIBRARY_NAME = "libtrtpaged_kernels.so"
BUILD_HINT = (
    "build it with `pip install -e .` in the trtpaged checkout (or `cmake -S . -B build && cmake --build build`), "
    "or point TRTPAGED_KERNELS_LIB at libtrtpaged_kernels.so"
)

_DTYPE_CODES = {getattr(torch, name): KV_FORMATS[name].abi_code for name in FLOAT_KV_CACHE_DTYPES}
# Pool dtypes: the float ones, plus the quantized caches (trtpaged.kv_quant: rows of head_dim + 2 bytes).
_KV_CACHE_DTYPE_CODES = {**_DTYPE_CODES,
                         **{STORAGE_DTYPES[name]: KV_FORMATS[name].abi_code for name in QUANTIZED_KV_CACHE_DTYPES}}
_QUANTIZED_POOL_DTYPES = tuple(STORAGE_DTYPES.values())
_STATUS_NAMES = {1: "invalid argument", 2: "unsupported", 3: "CUDA error", 4: "not built", 5: "I/O error",
                 6: "out of memory"}


class KernelError(RuntimeError):
    """A kernel call failed; the message is the library's."""

    def __init__(self, function: str, status: int, message: str) -> None:
        self.status = status
        super().__init__(f"{function}: {_STATUS_NAMES.get(status, f'error {status}')}: {message}")


class KernelLibraryNotFound(KernelError):
    """The compiled kernel library could not be found or loaded."""

    def __init__(self, detail: str) -> None:
        RuntimeError.__init__(self, f"trtpaged kernel library not found ({detail}); {BUILD_HINT}")
        self.status = -1


class _AttentionParams(ctypes.Structure):
    _fields_ = [
        ("num_tokens", ctypes.c_int32),
        ("num_seqs", ctypes.c_int32),
        ("max_blocks_per_seq", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("num_kv_blocks", ctypes.c_int32),
        ("num_layers", ctypes.c_int32),
        ("layer", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("io_dtype", ctypes.c_int),
        ("kv_cache_dtype", ctypes.c_int),
    ]


class _AttentionOptions(ctypes.Structure):
    _fields_ = [("sliding_window", ctypes.c_int32), ("logit_softcap", ctypes.c_float)]


class _QLinearWeight(ctypes.Structure):
    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("bits", ctypes.c_int32),
        ("group_size", ctypes.c_int32),
        ("activations", ctypes.c_int32),
    ]


class _LlamaLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_attention_norm", ctypes.c_void_p),
        ("qkv", _QLinearWeight),
        ("o", _QLinearWeight),
        ("gate_up", _QLinearWeight),
        ("down", _QLinearWeight),
    ]


def library_candidates(name: str, env_var: str) -> list[Path]:
    """Where a trtpaged shared library may be, in order: $env_var alone when set, else the installed
    package's _lib, then a local CMake build dir (newest first)."""
    env = os.environ.get(env_var)
    if env:
        return [Path(env)]
    package_dir = Path(__file__).resolve().parents[1]  # trtpaged/
    candidates = [package_dir / "_lib" / name]
    repo_build = package_dir.parent / "build"
    if repo_build.is_dir():
        candidates += sorted(repo_build.glob(f"*/{name}"), key=lambda p: -p.stat().st_mtime)
        candidates.append(repo_build / name)
    return candidates


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, sz, vp = ctypes.c_void_p, ctypes.c_int32, ctypes.c_size_t, ctypes.c_void_p
    params = ctypes.POINTER(_AttentionParams)
    options = ctypes.POINTER(_AttentionOptions)
    signatures = {
        "trtpaged_paged_attention_cpu": [params, vp, vp, vp, vp, p, p, p, p, vp],
        "trtpaged_paged_attention_cuda": [params, vp, vp, vp, vp, p, p, p, p, vp, i32, vp, sz, vp],
        "trtpaged_paged_attention_ex_cpu": [params, options, vp, vp, vp, vp, p, p, p, p, vp],
        "trtpaged_paged_attention_ex_cuda": [params, options, vp, vp, vp, vp, p, p, p, p, vp, i32, vp, sz, vp],
        "trtpaged_copy_blocks_cpu": [vp, i32, sz, p, i32],
        "trtpaged_copy_blocks_cuda": [vp, i32, sz, p, i32, vp],
        "trtpaged_swap_blocks_cpu": [vp, i32, vp, i32, sz, p, i32],
        "trtpaged_swap_blocks_cuda": [vp, i32, vp, i32, sz, p, i32, vp],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    lib.trtpaged_paged_attention_cuda_workspace_size.argtypes = [params, i32]
    lib.trtpaged_paged_attention_cuda_workspace_size.restype = ctypes.c_size_t
    for name in ("trtpaged_last_error", "trtpaged_version", "trtpaged_cuda_archs"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = []
    lib.trtpaged_has_cuda.restype = ctypes.c_int
    lib.trtpaged_has_cuda.argtypes = []
    i64 = ctypes.c_int64
    qlinear_signatures = {
        "trtpaged_qlinear_packed_bytes": [i32, i64, i64, i32, ctypes.POINTER(ctypes.c_size_t)],
        "trtpaged_qlinear_pack": [i32, i64, i64, i32, vp, vp, vp, vp],
        "trtpaged_qlinear_cpu": [vp, i64, vp, i32, i64, i64, i32, vp, vp],
        "trtpaged_qlinear_cpu_ex": [vp, i64, vp, i32, i64, i64, i32, vp, vp, i32],
        "trtpaged_set_cpu_isa": [ctypes.c_char_p],
    }
    for name, argtypes in qlinear_signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    lib.trtpaged_cpu_isa.restype = ctypes.c_char_p
    lib.trtpaged_cpu_isa.argtypes = []
    for name in ("trtpaged_attention_cpu_path", "trtpaged_best_cpu_isa"):
        fn = getattr(lib, name, None)  # an older library lacks them
        if fn is not None:
            fn.restype = ctypes.c_char_p
            fn.argtypes = []
    fused_signatures = {
        "trtpaged_rmsnorm_cpu": [vp, vp, vp, ctypes.c_float, i64, i64, vp, vp],
        "trtpaged_rope_qk_cpu": [vp, i64, i32, i32, i32, vp, vp, vp, vp, vp],
        "trtpaged_silu_mul_cpu": [vp, i64, i64, vp],
        "trtpaged_greedy_rows_cpu": [vp, i64, vp, i64, vp, vp],
        "trtpaged_llama_layers_cpu": [vp, i32, i32, i32, ctypes.c_float, vp, vp, vp, vp,
                                      ctypes.POINTER(_AttentionParams), vp, vp, vp, vp, vp],
    }
    for name, argtypes in fused_signatures.items():
        fn = getattr(lib, name, None)  # an older library lacks them: has_fused_ops() says so
        if fn is not None:
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """Loads the kernel library once; raises KernelLibraryNotFound with how to build it."""
    tried = []
    for path in library_candidates(LIBRARY_NAME, "TRTPAGED_KERNELS_LIB"):
        if path.is_file():
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as exc:
                raise KernelLibraryNotFound(f"{path} failed to load: {exc}") from exc
            _declare(lib)
            return lib
        tried.append(str(path))
    raise KernelLibraryNotFound("looked at " + ", ".join(tried))


def available() -> bool:
    """True when the kernel library can be loaded."""
    try:
        library()
    except KernelError:
        return False
    return True


def has_cuda() -> bool:
    """True when the library was compiled with its CUDA kernels."""
    return bool(library().trtpaged_has_cuda())


def cuda_archs() -> str:
    """CUDA architectures compiled in, e.g. "80,90"."""
    return library().trtpaged_cuda_archs().decode()


def version() -> str:
    return library().trtpaged_version().decode()


def _check(function: str, status: int) -> None:
    if status != 0:
        raise KernelError(function, status, library().trtpaged_last_error().decode())


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _require(t: object, name: str, *, ndim: int, dtypes: Iterable[torch.dtype], device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name}: dtype {str(t.dtype).replace('torch.', '')} not supported (allowed: {allowed})")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device} like q")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    return t


def _pool_head_dim(kv_cache: torch.Tensor) -> int:
    """head_dim of a pool: its last dimension, less the scale's bytes for a quantized pool."""
    return kv_cache.shape[-1] - (SCALE_BYTES if kv_cache.dtype in _QUANTIZED_POOL_DTYPES else 0)


def _pool_blocks(pool: torch.Tensor, name: str) -> int:
    """A pool's block count, which the C ABI takes as int32 (block ids are int32): ValueError past 2**31 - 1
    (ctypes would wrap it, and the kernels refuse every block of a pool it says has -2147483644 or 4)."""
    blocks = pool.shape[0]
    if blocks > MAX_KV_BLOCKS:
        raise ValueError(f"{name}: {blocks} blocks, past {MAX_KV_BLOCKS} (int32 block ids)")
    return blocks


def _stream(device: torch.device) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def _dense_f32(t: object, name: str, shape: tuple[int, ...]) -> None:
    """Raises ValueError naming `name` unless t is a contiguous float32 CPU tensor of this shape."""
    if (not isinstance(t, torch.Tensor) or t.dtype is not torch.float32 or not t.is_cpu
            or not t.is_contiguous() or t.shape != shape):
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a contiguous float32 CPU tensor of shape {shape}, got {got}")
