"""The CPU kernels' instruction set: which one runs (cpu_isa, attention_cpu_path) and forcing one
(set_cpu_isa) for tests and comparisons."""

from __future__ import annotations

from typing import Optional

from trtpaged.kernels._library import KernelError, _check, library

CPU_ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni")


def cpu_isa() -> str:
    """Instruction set the CPU kernels use: "avx512vnni", "avxvnni", "avx2" or "scalar"."""
    return library().trtpaged_cpu_isa().decode()


# The paged attention's compiled copies (plugins/src/cpu/paged_attention_*.cpp), and the copy each
# cpu_isa runs: AVX-VNNI adds nothing the attention uses.
ATTENTION_CPU_PATHS = ("scalar", "avx2", "avx512")
ATTENTION_PATH_OF_ISA = {"scalar": "scalar", "avx2": "avx2", "avxvnni": "avx2", "avx512vnni": "avx512"}


def attention_cpu_path() -> str:
    """The copy of the CPU paged attention (and KV write) that runs under the current cpu_isa:
    "avx512", "avx2" or "scalar"."""
    fn = getattr(library(), "trtpaged_attention_cpu_path", None)
    if fn is None:
        raise KernelError("attention_cpu_path", 2, "this kernel library predates run-time attention dispatch; "
                          "rebuild it")
    return fn().decode()


def set_cpu_isa(name: Optional[str]) -> None:
    """Forces the CPU kernels' instruction set, the quantized linear's and the paged attention's (None:
    the best this CPU has); for tests and comparisons. Raises KernelError when the CPU lacks it."""
    _check("set_cpu_isa", library().trtpaged_set_cpu_isa(name.encode() if name else None))
