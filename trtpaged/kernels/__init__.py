"""ctypes binding to the trtpaged kernel library (plugins/, C ABI in plugins/include/trtpaged/trtpaged.h).

One loader (`_library`: finding and loading the .so, its ctypes declarations, KernelError), then one
module per kernel family: `attention` (paged attention), `blocks` (block copy/swap), `qlinear`
(weight-only quantized linear), `fused` (rmsnorm, rope_qk, silu_mul), `layers` (a step's decoder
layers in one call), `sampling` (greedy_rows) and `isa` (the CPU instruction set). Callers use the
names re-exported here (`from trtpaged import kernels; kernels.paged_attention(...)`).

Functions take torch tensors, check dtype, device, contiguity and shapes (raising ValueError that
names the argument), and dispatch to the CPU or CUDA kernels by the tensors' device.
"""

from trtpaged.kernels._library import (
    _DTYPE_CODES,  # noqa: F401  (private; bench/kernel_bench_gpu.py uses it from here)
    _KV_CACHE_DTYPE_CODES,  # noqa: F401  (private; bench/kernel_bench_gpu.py uses it from here)
    BUILD_HINT,
    LIBRARY_NAME,
    KernelError,
    KernelLibraryNotFound,
    _AttentionParams,  # noqa: F401  (private; bench/kernel_bench_gpu.py and the kernel tests use it from here)
    available,
    cuda_archs,
    has_cuda,
    library,
    library_candidates,
    version,
)
from trtpaged.attention_options import AttentionOptions
from trtpaged.kernels.attention import AttentionStep, paged_attention
from trtpaged.kernels.blocks import Pairs, copy_blocks, swap_blocks
from trtpaged.kernels.fused import has_fused_ops, rmsnorm, rope_qk, silu_mul
from trtpaged.kernels.isa import (
    ATTENTION_CPU_PATHS,
    ATTENTION_PATH_OF_ISA,
    CPU_ISAS,
    attention_cpu_path,
    best_cpu_isa,
    cpu_isa,
    describe_cpu_isa,
    set_cpu_isa,
)
from trtpaged.kernels.layers import LlamaLayers, has_llama_layers
from trtpaged.kernels.qlinear import (
    QLINEAR_FLOAT_ACTIVATIONS,
    QLINEAR_FLOAT_LIMB_ACTIVATIONS,
    QLINEAR_INT8_ACTIVATIONS,
    QLinearOp,
    qlinear,
    qlinear_pack,
    qlinear_packed_bytes,
)
from trtpaged.kernels.sampling import greedy_rows, has_greedy_rows

__all__ = [
    "ATTENTION_CPU_PATHS", "ATTENTION_PATH_OF_ISA", "BUILD_HINT", "CPU_ISAS", "LIBRARY_NAME",
    "QLINEAR_FLOAT_ACTIVATIONS", "QLINEAR_FLOAT_LIMB_ACTIVATIONS", "QLINEAR_INT8_ACTIVATIONS",
    "AttentionOptions", "AttentionStep", "KernelError",
    "KernelLibraryNotFound", "LlamaLayers", "Pairs", "QLinearOp", "attention_cpu_path",
    "available", "best_cpu_isa", "copy_blocks", "cpu_isa", "cuda_archs", "describe_cpu_isa", "greedy_rows",
    "has_cuda", "has_fused_ops", "has_greedy_rows", "has_llama_layers",
    "library", "library_candidates", "paged_attention", "qlinear", "qlinear_pack", "qlinear_packed_bytes",
    "rmsnorm", "rope_qk", "set_cpu_isa", "silu_mul", "swap_blocks", "version",
]  # fmt: skip
