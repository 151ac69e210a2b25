"""ctypes binding to the trtpaged kernel library (plugins/, C ABI in plugins/include/trtpaged/trtpaged.h).

Functions take torch tensors, check dtype, device, contiguity and shapes (raising
ValueError that names the argument), and dispatch to the CPU or CUDA kernels by
the tensors' device. The library is found, in order, at $TRTPAGED_KERNELS_LIB,
inside the installed package (trtpaged/_lib), or in a local CMake build dir.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from trtpaged.kv_formats import FLOAT_KV_DTYPES, KV_FORMATS, QUANTIZED_KV_DTYPES, SCALE_BYTES
from trtpaged.kv_quant import STORAGE_DTYPES

LIBRARY_NAME = "libtrtpaged_kernels.so"
BUILD_HINT = (
    "build it with `pip install -e .` in the trtpaged checkout (or `cmake -S . -B build && cmake --build build`), "
    "or point TRTPAGED_KERNELS_LIB at libtrtpaged_kernels.so"
)

_DTYPE_CODES = {getattr(torch, name): KV_FORMATS[name].abi_code for name in FLOAT_KV_DTYPES}
# Pool dtypes: the float ones, plus the quantized caches (trtpaged.kv_quant: rows of head_dim + 2 bytes).
_KV_DTYPE_CODES = {**_DTYPE_CODES, **{STORAGE_DTYPES[name]: KV_FORMATS[name].abi_code for name in QUANTIZED_KV_DTYPES}}
_QUANTIZED_POOL_DTYPES = tuple(STORAGE_DTYPES.values())
_STATUS_NAMES = {1: "invalid argument", 2: "unsupported", 3: "CUDA error", 4: "not built"}

Pairs = Union[torch.Tensor, Sequence[Sequence[int]]]


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
        ("num_blocks", ctypes.c_int32),
        ("num_layers", ctypes.c_int32),
        ("layer", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("io_dtype", ctypes.c_int),
        ("kv_dtype", ctypes.c_int),
    ]


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
    package_dir = Path(__file__).resolve().parent
    candidates = [package_dir / "_lib" / name]
    repo_build = package_dir.parent / "build"
    if repo_build.is_dir():
        candidates += sorted(repo_build.glob(f"*/{name}"), key=lambda p: -p.stat().st_mtime)
        candidates.append(repo_build / name)
    return candidates


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, sz, vp = ctypes.c_void_p, ctypes.c_int32, ctypes.c_size_t, ctypes.c_void_p
    params = ctypes.POINTER(_AttentionParams)
    signatures = {
        "trtpaged_paged_attention_cpu": [params, vp, vp, vp, vp, p, p, p, p, vp],
        "trtpaged_paged_attention_cuda": [params, vp, vp, vp, vp, p, p, p, p, vp, i32, vp, sz, vp],
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


def _stream(device: torch.device) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    positions: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    layer: int,
    scale: float,
    out: Optional[torch.Tensor] = None,
    max_context_len: Optional[int] = None,
) -> torch.Tensor:
    """Writes the step's K/V into kv_cache (in place) and returns causal paged attention.

    q [T, H, D], k/v [T, KVH, D] (one dtype), kv_cache [num_blocks, num_layers, 2, KVH,
    block_size, D] (float), or [..., block_size, D + 2] int8 / float8_e4m3fn for a quantized cache
    (trtpaged.kv_quant), positions [T], query_start [S+1], context_lens [S], block_tables
    [S, max_blocks] (int32). Returns out [T, H, D] in q.dtype. On CUDA, max_context_len
    (an upper bound of context_lens) avoids a device sync when given.
    """
    float_dtypes = tuple(_DTYPE_CODES)
    index_dtypes = (torch.int32,)
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    device = q.device
    _require(q, "q", ndim=3, dtypes=float_dtypes, device=device)
    _require(k, "k", ndim=3, dtypes=(q.dtype,), device=device)
    _require(v, "v", ndim=3, dtypes=(q.dtype,), device=device)
    _require(kv_cache, "kv_cache", ndim=6, dtypes=tuple(_KV_DTYPE_CODES), device=device)
    _require(positions, "positions", ndim=1, dtypes=index_dtypes, device=device)
    _require(query_start, "query_start", ndim=1, dtypes=index_dtypes, device=device)
    _require(context_lens, "context_lens", ndim=1, dtypes=index_dtypes, device=device)
    _require(block_tables, "block_tables", ndim=2, dtypes=index_dtypes, device=device)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, num_layers, two, num_kv_heads, block_size, _ = kv_cache.shape
    cache_head_dim = _pool_head_dim(kv_cache)
    num_seqs = block_tables.shape[0]
    if two != 2:
        raise ValueError(f"kv_cache: dimension 2 must be 2 (K and V), got shape {tuple(kv_cache.shape)}")
    if cache_head_dim != head_dim:
        raise ValueError(f"kv_cache: head_dim {cache_head_dim} differs from q's {head_dim}")
    expected_kv = (num_tokens, num_kv_heads, head_dim)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != expected_kv:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {expected_kv} (tokens, kv heads, head_dim)")
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions: {positions.shape[0]} entries, expected num_tokens = {num_tokens}")
    if query_start.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start: {query_start.shape[0]} entries, expected num_seqs + 1 = {num_seqs + 1}")
    if context_lens.shape[0] != num_seqs:
        raise ValueError(f"context_lens: {context_lens.shape[0]} entries, expected num_seqs = {num_seqs}")
    if out is None:
        out = torch.empty_like(q)
    else:
        _require(out, "out", ndim=3, dtypes=(q.dtype,), device=device)
        if out.shape != q.shape:
            raise ValueError(f"out: shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    params = _AttentionParams(
        num_tokens, num_seqs, block_tables.shape[1], num_heads, num_kv_heads, head_dim,
        num_blocks, num_layers, layer, block_size, scale, _DTYPE_CODES[q.dtype], _KV_DTYPE_CODES[kv_cache.dtype],
    )  # fmt: skip
    lib = library()
    pointers = [_ptr(t) for t in (q, k, v, kv_cache, positions, query_start, context_lens, block_tables, out)]
    if device.type == "cpu":
        _check("paged_attention", lib.trtpaged_paged_attention_cpu(ctypes.byref(params), *pointers))
    elif device.type == "cuda":
        if max_context_len is None:
            max_context_len = int(context_lens.max().item()) if num_seqs else 0
        size = lib.trtpaged_paged_attention_cuda_workspace_size(ctypes.byref(params), max_context_len)
        workspace = torch.empty(size, dtype=torch.uint8, device=device) if size else None
        status = lib.trtpaged_paged_attention_cuda(
            ctypes.byref(params), *pointers, max_context_len,
            _ptr(workspace) if workspace is not None else None, size, _stream(device),
        )  # fmt: skip
        _check("paged_attention", status)
    else:
        raise ValueError(f"q: device {device} not supported (cpu or cuda)")
    return out


def _pairs_array(pairs: Pairs, name: str = "pairs") -> torch.Tensor:
    """Block pairs as a contiguous host int32 tensor [n, 2]."""
    t = pairs if isinstance(pairs, torch.Tensor) else torch.tensor(list(pairs), dtype=torch.int64).reshape(-1, 2)
    if t.dim() != 2 or t.shape[1] != 2:
        raise ValueError(f"{name}: expected shape [n, 2] of (src, dst) block ids, got {tuple(t.shape)}")
    return t.to(device="cpu", dtype=torch.int32).contiguous()


def _block_bytes(pool: torch.Tensor) -> int:
    return pool[0].numel() * pool.element_size() if pool.shape[0] else 0


def copy_blocks(kv_cache: torch.Tensor, pairs: Pairs) -> None:
    """Copy-on-write inside one pool: block src → block dst for each (src, dst), all layers."""
    if not isinstance(kv_cache, torch.Tensor) or not kv_cache.is_contiguous() or kv_cache.dim() < 2:
        raise ValueError("kv_cache: expected a contiguous block-major pool tensor")
    arr = _pairs_array(pairs)
    if arr.shape[0] == 0:
        return
    args = (_ptr(kv_cache), kv_cache.shape[0], _block_bytes(kv_cache), _ptr(arr), arr.shape[0])
    lib = library()
    if kv_cache.device.type == "cpu":
        _check("copy_blocks", lib.trtpaged_copy_blocks_cpu(*args))
    else:
        _check("copy_blocks", lib.trtpaged_copy_blocks_cuda(*args, _stream(kv_cache.device)))


def swap_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: Pairs) -> None:
    """Copies block src of src_pool to block dst of dst_pool for each (src, dst), e.g. GPU ↔ CPU."""
    for name, t in (("src_pool", src_pool), ("dst_pool", dst_pool)):
        if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.dim() < 2:
            raise ValueError(f"{name}: expected a contiguous block-major pool tensor")
    if src_pool.shape[1:] != dst_pool.shape[1:] or src_pool.dtype != dst_pool.dtype:
        raise ValueError(
            f"dst_pool: block shape {tuple(dst_pool.shape[1:])} {dst_pool.dtype} differs from src_pool's "
            f"{tuple(src_pool.shape[1:])} {src_pool.dtype}"
        )
    arr = _pairs_array(pairs)
    if arr.shape[0] == 0:
        return
    args = (_ptr(src_pool), src_pool.shape[0], _ptr(dst_pool), dst_pool.shape[0], _block_bytes(src_pool))
    lib = library()
    if src_pool.device.type == "cpu" and dst_pool.device.type == "cpu":
        _check("swap_blocks", lib.trtpaged_swap_blocks_cpu(*args, _ptr(arr), arr.shape[0]))
    else:
        cuda_device = src_pool.device if src_pool.device.type == "cuda" else dst_pool.device
        _check("swap_blocks", lib.trtpaged_swap_blocks_cuda(*args, _ptr(arr), arr.shape[0], _stream(cuda_device)))


class AttentionStep:
    """One step's paged attention, layer after layer, with the per-step work done once.

    `paged_attention` checks every tensor on every call; a step calls it once
    per layer with the same index tensors and pool. This checks those once and
    keeps the call's parameters, so that each layer costs one C call:
    `step(layer, q, k, v, scale) -> out`. q/k/v must be dense, of one float
    dtype, with num_tokens rows (checked cheaply per call).
    """

    def __init__(self, kv_cache: torch.Tensor, positions: torch.Tensor, query_start: torch.Tensor,
                 context_lens: torch.Tensor, block_tables: torch.Tensor, num_heads: int,
                 max_context_len: Optional[int] = None) -> None:
        device = kv_cache.device
        _require(kv_cache, "kv_cache", ndim=6, dtypes=tuple(_KV_DTYPE_CODES), device=device)
        for name, t, ndim in (("positions", positions, 1), ("query_start", query_start, 1),
                              ("context_lens", context_lens, 1), ("block_tables", block_tables, 2)):
            _require(t, name, ndim=ndim, dtypes=(torch.int32,), device=device)
        num_blocks, num_layers, _, num_kv_heads, block_size, _ = kv_cache.shape
        head_dim = _pool_head_dim(kv_cache)
        num_seqs = block_tables.shape[0]
        if query_start.shape[0] != num_seqs + 1 or context_lens.shape[0] != num_seqs:
            raise ValueError(f"query_start/context_lens: {query_start.shape[0]}/{context_lens.shape[0]} entries for "
                             f"{num_seqs} sequences")
        self.num_tokens, self.device = int(positions.shape[0]), device
        self._params = _AttentionParams(
            self.num_tokens, num_seqs, block_tables.shape[1], num_heads, num_kv_heads, head_dim,
            num_blocks, num_layers, 0, block_size, 1.0, _DTYPE_CODES[torch.float32], _KV_DTYPE_CODES[kv_cache.dtype],
        )  # fmt: skip
        self._params_ref = ctypes.byref(self._params)
        self._tensors = (kv_cache, positions, query_start, context_lens, block_tables)  # keeps them alive
        self._pointers = tuple(t.data_ptr() for t in self._tensors)
        lib = library()
        self._workspace: Optional[torch.Tensor] = None
        if device.type == "cpu":
            self._fn = lib.trtpaged_paged_attention_cpu
        elif device.type == "cuda":
            self._fn = lib.trtpaged_paged_attention_cuda
            if max_context_len is None:
                max_context_len = int(context_lens.max().item()) if num_seqs else 0
            self._max_context_len = max_context_len
        else:
            raise ValueError(f"kv_cache: device {device} not supported (cpu or cuda)")

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()) or q.shape[0] != self.num_tokens:
            raise ValueError(f"q/k/v: expected dense tensors with {self.num_tokens} rows")
        if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPE_CODES:
            raise ValueError(f"q/k/v: one float dtype expected, got {q.dtype}, {k.dtype}, {v.dtype}")
        p = self._params
        p.layer, p.scale, p.io_dtype = layer, scale, _DTYPE_CODES[q.dtype]
        out = torch.empty_like(q)
        cache, positions, query_start, context_lens, block_tables = self._pointers
        args = (self._params_ref, q.data_ptr(), k.data_ptr(), v.data_ptr(), cache, positions, query_start,
                context_lens, block_tables, out.data_ptr())
        if self.device.type == "cpu":
            status = self._fn(*args)
        else:
            size = library().trtpaged_paged_attention_cuda_workspace_size(self._params_ref, self._max_context_len)
            if size and (self._workspace is None or self._workspace.numel() < size):
                self._workspace = torch.empty(size, dtype=torch.uint8, device=self.device)
            ws = self._workspace.data_ptr() if size and self._workspace is not None else None
            status = self._fn(*args, self._max_context_len, ws, size, _stream(self.device))
        if status:
            _check("paged_attention", status)
        return out

# --- Weight-only quantized linear (CPU) ------------------------------------------------------------

CPU_ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni")


def cpu_isa() -> str:
    """Instruction set the CPU kernels use: "avx512vnni", "avxvnni", "avx2" or "scalar"."""
    return library().trtpaged_cpu_isa().decode()


# The paged attention's compiled copies (plugins/src/cpu/paged_attention_*.cpp), and the copy each
# cpu_isa runs: AVX-VNNI adds nothing the attention uses.
ATTENTION_CPU_PATHS = ("scalar", "avx2", "avx512")
ATTENTION_PATH_OF_ISA = {"scalar": "scalar", "avx2": "avx2", "avxvnni": "avx2", "avx512vnni": "avx512"}


def best_cpu_isa() -> Optional[str]:
    """The best instruction set this CPU supports (what cpu_isa() is unless TRTPAGED_CPU_ISA or
    set_cpu_isa forces a lower one); None with a library that predates the query."""
    fn = getattr(library(), "trtpaged_best_cpu_isa", None)
    return fn().decode() if fn is not None else None


def describe_cpu_isa() -> str:
    """One line for reports: the ISA the CPU kernels run, and whether it is forced below the CPU's best,
    e.g. "avx2 (forced by TRTPAGED_CPU_ISA=avx2; this CPU's best: avx512vnni)"."""
    isa, best = cpu_isa(), best_cpu_isa()
    if best is None or isa == best:
        return f"{isa} (auto: the best this CPU has)" if best else isa
    env = os.environ.get("TRTPAGED_CPU_ISA")
    how = f"forced by TRTPAGED_CPU_ISA={env}" if env == isa else "forced by set_cpu_isa"
    return f"{isa} ({how}; this CPU's best: {best})"


def attention_cpu_path() -> str:
    """The copy of the CPU paged attention (and KV write) that runs under the current cpu_isa:
    "avx512", "avx2" or "scalar"."""
    fn = getattr(library(), "trtpaged_attention_cpu_path", None)
    if fn is None:
        raise KernelError("attention_cpu_path: this kernel library predates run-time attention dispatch; rebuild it")
    return fn().decode()


def set_cpu_isa(name: Optional[str]) -> None:
    """Forces the CPU kernels' instruction set, the quantized linear's and the paged attention's (None:
    the best this CPU has); for tests and comparisons. Raises KernelError when the CPU lacks it."""
    _check("set_cpu_isa", library().trtpaged_set_cpu_isa(name.encode() if name else None))


def qlinear_packed_bytes(bits: int, n: int, k: int, group_size: int) -> int:
    """Bytes of the kernel's packed form of an [n, k] weight."""
    size = ctypes.c_size_t()
    _check("qlinear_packed_bytes", library().trtpaged_qlinear_packed_bytes(bits, n, k, group_size, ctypes.byref(size)))
    return size.value


def qlinear_pack(
    bits: int, codes: torch.Tensor, scales: torch.Tensor, offsets: Optional[torch.Tensor], group_size: int
) -> torch.Tensor:
    """Packs a quantized weight W[n, k] = scales[n, k // G] * codes[n, k] + offsets[n, k // G] for qlinear.

    bits 8: codes int8 [n, k], offsets None. bits 4: codes uint8 [n, k // 2] holding two codes
    0..15 per byte (k = 2j in the low nibble, 2j + 1 in the high), offsets float32 [n, k // G].
    scales float32 [n, k // G]; scale and offset values must be exactly representable in fp16.
    Returns a 64-byte aligned uint8 CPU tensor.
    """
    cpu = torch.device("cpu")
    if bits not in (4, 8):
        raise ValueError(f"bits: {bits} not supported (4 or 8)")
    code_dtype = torch.int8 if bits == 8 else torch.uint8
    _require(codes, "codes", ndim=2, dtypes=(code_dtype,), device=cpu)
    _require(scales, "scales", ndim=2, dtypes=(torch.float32,), device=cpu)
    n = codes.shape[0]
    k = codes.shape[1] * (1 if bits == 8 else 2)
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size: {group_size} does not divide k = {k}")
    groups = (n, k // group_size)
    if tuple(scales.shape) != groups:
        raise ValueError(f"scales: shape {tuple(scales.shape)}, expected {groups} (n, k // group_size)")
    if bits == 4:
        if offsets is None:
            raise ValueError("offsets: required for bits 4")
        _require(offsets, "offsets", ndim=2, dtypes=(torch.float32,), device=cpu)
        if tuple(offsets.shape) != groups:
            raise ValueError(f"offsets: shape {tuple(offsets.shape)}, expected {groups} (n, k // group_size)")
    elif offsets is not None:
        raise ValueError("offsets: must be None for bits 8")
    size = qlinear_packed_bytes(bits, n, k, group_size)
    raw = torch.empty(size + 64, dtype=torch.uint8)
    start = -raw.data_ptr() % 64
    packed = raw[start : start + size]
    status = library().trtpaged_qlinear_pack(
        bits, n, k, group_size, codes.data_ptr(), scales.data_ptr(),
        offsets.data_ptr() if offsets is not None else None, packed.data_ptr(),
    )  # fmt: skip
    _check("qlinear_pack", status)
    return packed


QLINEAR_INT8_ACTIVATIONS = 0  # TRTPAGED_QLINEAR_INT8_ACTIVATIONS
QLINEAR_FLOAT_ACTIVATIONS = 1  # TRTPAGED_QLINEAR_FLOAT_ACTIVATIONS


@functools.lru_cache(maxsize=None)
def _qlinear_call(bits: int, n: int, k: int, group_size: int) -> tuple[int, Callable[..., int]]:
    """(packed bytes, the C function) for one weight shape: validated once, then a dict lookup per call."""
    return qlinear_packed_bytes(bits, n, k, group_size), library().trtpaged_qlinear_cpu_ex


def qlinear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bits: int,
    n: int,
    k: int,
    group_size: int,
    bias: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    float_activations: bool = False,
) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a weight packed by qlinear_pack; x float32 [..., k] on the CPU.

    float_activations=False quantizes x to int8 per block of 32 (integer dot products, fastest
    for many rows); True keeps x in float32 (exact de-quantized weights, fp32 FMA: as accurate
    as F.linear on them, about as fast at a few rows). Returns out (float32 [..., n], allocated
    when None). For repeated calls on one weight, QLinearOp checks its arguments once.
    """
    packed_bytes, fn = _qlinear_call(bits, n, k, group_size)
    if x.dtype is not torch.float32 or not x.is_cpu or not x.is_contiguous() or x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(
            f"x: expected a contiguous float32 CPU tensor [..., k = {k}], got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    if packed.dtype is not torch.uint8 or not packed.is_cpu or packed.dim() != 1 or packed.numel() < packed_bytes:
        raise ValueError(f"packed: expected the 1-D uint8 CPU tensor of {packed_bytes} bytes returned by qlinear_pack")
    m = x.numel() // k
    if out is None:
        out = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32)
    elif out.dtype is not torch.float32 or not out.is_cpu or not out.is_contiguous() or out.numel() != m * n:
        raise ValueError(f"out: expected a contiguous float32 CPU tensor of {m * n} elements")
    if bias is not None and (
        bias.dtype is not torch.float32 or not bias.is_cpu or bias.shape != (n,) or not bias.is_contiguous()
    ):
        raise ValueError(f"bias: expected a contiguous float32 CPU tensor of shape ({n},)")
    status = fn(x.data_ptr(), m, packed.data_ptr(), bits, n, k, group_size,
                bias.data_ptr() if bias is not None else None, out.data_ptr(), int(float_activations))  # fmt: skip
    if status:
        _check("qlinear", status)
    return out


# --- Fused element-wise ops of the eager step model (CPU, float32) ---------------------------------
# Like qlinear, each runs several times per layer per decode step: the checks are the few that keep
# the kernel in bounds, each a cheap attribute read, and the C function is looked up once.


def has_fused_ops() -> bool:
    """True when the library has the fused CPU ops (rmsnorm, rope_qk, silu_mul)."""
    return hasattr(library(), "trtpaged_rmsnorm_cpu")


@functools.lru_cache(maxsize=1)
def _fused_fns() -> tuple[Callable[..., int], Callable[..., int], Callable[..., int]]:
    lib = library()
    return lib.trtpaged_rmsnorm_cpu, lib.trtpaged_rope_qk_cpu, lib.trtpaged_silu_mul_cpu


def _dense_f32(t: object, name: str, shape: tuple[int, ...]) -> None:
    """Raises ValueError naming `name` unless t is a contiguous float32 CPU tensor of this shape."""
    if (not isinstance(t, torch.Tensor) or t.dtype is not torch.float32 or not t.is_cpu
            or not t.is_contiguous() or t.shape != shape):
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a contiguous float32 CPU tensor of shape {shape}, got {got}")


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """HF Llama's RMSNorm over the last dimension of x [rows, hidden] (float32 CPU): weight * x * rsqrt(mean(x^2) + eps).

    With residual: h = x + residual, returns (rmsnorm(h), h); h is written to residual_out (default:
    into residual, in place). Without: returns rmsnorm(x). out may be x.
    """
    if x.dim() != 2:
        raise ValueError(f"x: expected [rows, hidden], got shape {tuple(x.shape)}")
    shape = x.shape
    _dense_f32(x, "x", shape)
    _dense_f32(weight, "weight", (shape[1],))
    if out is None:
        out = torch.empty_like(x)
    else:
        _dense_f32(out, "out", shape)
    fn = _fused_fns()[0]
    if residual is None:
        if residual_out is not None:
            raise ValueError("residual_out: only with residual")
        status = fn(x.data_ptr(), None, weight.data_ptr(), eps, shape[0], shape[1], out.data_ptr(), None)
        if status:
            _check("rmsnorm", status)
        return out
    _dense_f32(residual, "residual", shape)
    if residual_out is None:
        residual_out = residual
    else:
        _dense_f32(residual_out, "residual_out", shape)
    status = fn(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, shape[0], shape[1], out.data_ptr(),
                residual_out.data_ptr())
    if status:
        _check("rmsnorm", status)
    return out, residual_out


def rope_qk(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dense: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """HF rotate-half RoPE on the q and k heads of qkv [rows, (H + 2 * KVH) * D] (float32 CPU); cos/sin [rows, D].

    dense=False: rotates in place and returns qkv. dense=True: qkv is left as it is and the dense
    rotated q [rows, H, D], rotated k and a copy of v [rows, KVH, D] are returned in new tensors,
    ready for the attention kernel.
    """
    if qkv.dim() != 2:
        raise ValueError(f"qkv: expected [rows, (num_heads + 2 * num_kv_heads) * head_dim], got {tuple(qkv.shape)}")
    rows = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    _dense_f32(qkv, "qkv", (rows, q_size + 2 * kv_size))
    _dense_f32(cos, "cos", (rows, head_dim))
    _dense_f32(sin, "sin", (rows, head_dim))
    fn = _fused_fns()[1]
    if not dense:
        status = fn(qkv.data_ptr(), rows, num_heads, num_kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                    None, None, None)
        if status:
            _check("rope_qk", status)
        return qkv
    # three allocations cost less than views of one buffer (split + view: ~4 torch calls more)
    q = torch.empty((rows, num_heads, head_dim), dtype=torch.float32)
    k = torch.empty((rows, num_kv_heads, head_dim), dtype=torch.float32)
    v = torch.empty((rows, num_kv_heads, head_dim), dtype=torch.float32)
    status = fn(qkv.data_ptr(), rows, num_heads, num_kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                q.data_ptr(), k.data_ptr(), v.data_ptr())
    if status:
        _check("rope_qk", status)
    return q, k, v


def silu_mul(gate_up: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 * I] (float32 CPU, gate first in each row); returns [rows, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected [rows, 2 * intermediate], got shape {tuple(gate_up.shape)}")
    rows, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    _dense_f32(gate_up, "gate_up", gate_up.shape)
    if out is None:
        out = torch.empty((rows, intermediate), dtype=torch.float32)
    else:
        _dense_f32(out, "out", (rows, intermediate))
    status = _fused_fns()[2](gate_up.data_ptr(), rows, intermediate, out.data_ptr())
    if status:
        _check("silu_mul", status)
    return out
def has_llama_layers() -> bool:
    """True when the library has trtpaged_llama_layers_cpu (a step's decoder layers in one call)."""
    return hasattr(library(), "trtpaged_llama_layers_cpu")


class LlamaLayers:
    """A Llama model's decoder layers bound for trtpaged_llama_layers_cpu: weights described once,
    then one C call per step runs every layer (float32 CPU, quantized linears given as QLinearOps).

    `layers`: per layer (input_norm, post_attention_norm, (qkv, o, gate_up, down)), the norms float32
    [hidden] tensors and each linear a (QLinearOp, float_activations) pair; `scale`: the softmax scale.
    The tensors must not be
    modified or freed while this object lives (it keeps references).
    """

    def __init__(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor, Sequence[tuple["QLinearOp", bool]]]],
                 hidden: int, intermediate: int, eps: float, scale: float) -> None:  # fmt: skip
        self._fn = library().trtpaged_llama_layers_cpu
        self.hidden, self.intermediate, self.eps, self.scale = hidden, intermediate, eps, scale
        self._array = (_LlamaLayer * len(layers))()
        self._keep: list[object] = []
        for i, (input_norm, post_norm, linears) in enumerate(layers):
            for name, t in (("input_norm", input_norm), ("post_attention_norm", post_norm)):
                _dense_f32(t, f"layers[{i}].{name}", (hidden,))
                setattr(self._array[i], name, t.data_ptr())
                self._keep.append(t)
            for field, (op, float_activations) in zip(("qkv", "o", "gate_up", "down"), linears):
                packed, bits, n, k, group, bias = op._args
                setattr(self._array[i], field, _QLinearWeight(packed, bias, n, k, bits, group,
                                                              1 if float_activations else 0))  # fmt: skip
                self._keep.append(op)

    def __call__(self, stream: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attention: "AttentionStep") -> torch.Tensor:  # fmt: skip
        """Runs every layer: `stream` [rows, hidden] (the embeddings) becomes the residual stream in
        place; returns the last layer's MLP output (the final norm takes their sum)."""
        rows = attention.num_tokens
        _dense_f32(stream, "stream", (rows, self.hidden))
        head_dim = attention._params.head_dim
        _dense_f32(cos, "cos", (rows, head_dim))
        _dense_f32(sin, "sin", (rows, head_dim))
        if attention.device.type != "cpu":
            raise ValueError("attention: a CPU AttentionStep expected")
        params = attention._params
        params.io_dtype, params.scale = _DTYPE_CODES[torch.float32], self.scale
        last = torch.empty_like(stream)
        cache, positions, query_start, context_lens, block_tables = attention._pointers
        status = self._fn(self._array, len(self._array), self.hidden, self.intermediate, self.eps,
                          stream.data_ptr(), last.data_ptr(), cos.data_ptr(), sin.data_ptr(), attention._params_ref,
                          cache, positions, query_start, context_lens, block_tables)  # fmt: skip
        if status:
            _check("llama_layers", status)
        return last


def greedy_rows(logits: torch.Tensor, rows: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(argmax, logsumexp) of logits[rows] (float32 CPU [*, vocab], rows int64 in range) in one pass;
    None when the library lacks the op. Ties go to the first index, as torch.argmax."""
    fn = getattr(library(), "trtpaged_greedy_rows_cpu", None)
    if fn is None:
        return None
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [rows, vocab], got shape {tuple(logits.shape)}")
    _dense_f32(logits, "logits", logits.shape)
    if rows.dtype is not torch.int64 or rows.dim() != 1 or not rows.is_contiguous():
        raise ValueError("rows: expected a contiguous 1-D int64 tensor")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]):
        raise ValueError(f"rows: indices must be in [0, {logits.shape[0]})")
    n = rows.numel()
    argmax = torch.empty(n, dtype=torch.int64)
    lse = torch.empty(n, dtype=torch.float32)
    status = fn(logits.data_ptr(), logits.shape[1], rows.data_ptr(), n, argmax.data_ptr(), lse.data_ptr())
    if status:
        _check("greedy_rows", status)
    return argmax, lse


class QLinearOp:
    """qlinear bound to one packed weight (and bias): everything about the weight is checked once,
    so a call checks only x (dtype, device, contiguity, last dim) before the C call.

    Holds references to packed and bias, which must not be modified in place afterwards.
    """

    __slots__ = ("packed", "bias", "n", "k", "_fn", "_args")

    def __init__(self, packed: torch.Tensor, bits: int, n: int, k: int, group_size: int,
                 bias: Optional[torch.Tensor] = None) -> None:  # fmt: skip
        packed_bytes, fn = _qlinear_call(bits, n, k, group_size)
        if packed.dtype is not torch.uint8 or not packed.is_cpu or packed.dim() != 1 or packed.numel() < packed_bytes:
            raise ValueError(
                f"packed: expected the 1-D uint8 CPU tensor of {packed_bytes} bytes returned by qlinear_pack"
            )
        if bias is not None and (
            bias.dtype is not torch.float32 or not bias.is_cpu or bias.shape != (n,) or not bias.is_contiguous()
        ):
            raise ValueError(f"bias: expected a contiguous float32 CPU tensor of shape ({n},)")
        self.packed, self.bias, self.n, self.k, self._fn = packed, bias, n, k, fn
        self._args = (packed.data_ptr(), bits, n, k, group_size, bias.data_ptr() if bias is not None else None)

    def __call__(self, x: torch.Tensor, float_activations: bool = False) -> torch.Tensor:
        """y = x @ W^T (+ bias), float32 [..., n], for x float32 [..., k] contiguous on the CPU."""
        k = self.k
        if x.dtype is not torch.float32 or not x.is_cpu or not x.is_contiguous() or x.dim() == 0 or x.shape[-1] != k:
            raise ValueError(
                f"x: expected a contiguous float32 CPU tensor [..., k = {k}], "
                f"got {x.dtype} {tuple(x.shape)} on {x.device}"
            )
        out = x.new_empty(x.shape[:-1] + (self.n,))  # float32 CPU, as x
        packed, bits, n, _, group, bias = self._args
        status = self._fn(x.data_ptr(), x.numel() // k, packed, bits, n, k, group, bias, out.data_ptr(),
                          1 if float_activations else 0)  # fmt: skip
        if status:
            _check("qlinear", status)
        return out
