"""The CPU kernels' instruction set: which one runs (cpu_isa, attention_cpu_path), the CPU's best
(best_cpu_isa, describe_cpu_isa for reports) and forcing one (set_cpu_isa) for tests and comparisons."""

from __future__ import annotations

import os
from typing import Optional

from trtpaged.kernels._library import KernelError, _check, library

CPU_ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni")


def cpu_isa() -> str:
    """Instruction set the CPU kernels use: "avx512vnni", "avxvnni", "avx2" or "scalar"."""
    return library().trtpaged_cpu_isa().decode()


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
