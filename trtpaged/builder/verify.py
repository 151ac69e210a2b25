"""Build-time verification: the exported ONNX graph, run on CPU, against the HF model's own forward.

Runs the graph with onnx.reference.ReferenceEvaluator (the custom node in
numpy) over the two chained steps of the standard probe (step 1: two
prefills; step 2: a continuing chunk, a new prefill and a decode, with the pool
from step 1 fed back), asks for the logits of every packed token, and compares
them with HF's logits at the same positions.

Tolerance (documented in `trtpaged build --help`): max |onnx - hf| must be at
most `atol + rtol * max |hf|`, with (atol, rtol) = TOLERANCES[dtype].

A graph over a quantized KV cache (int8, fp8_e4m3) computes what no HF forward
does: it is compared, with the same tolerance, with the eager step model running
the same steps over the same kind of cache (the torch backend: the kernel
library's quantization), and the kv_accuracy stage measures the cache against a
full-precision one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trtpaged.builder.probe import hf_logits, standard_probe
from trtpaged.kv_quant import is_quantized

# float32: the HF forward itself moves by ~3e-4 * max|logit| between float32 and float64 on SmolLM2,
# and the ONNX graph (numpy) is about as far from float64 as HF float32 is, in the other direction.
TOLERANCES = {"float32": (1e-3, 2e-3), "float16": (5e-2, 1e-2), "bfloat16": (2e-1, 3e-2)}
_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


class VerificationError(RuntimeError):
    """The exported graph's logits differ from HF's beyond the tolerance."""


def unsupported_reason(dtype: str, kv_dtype: str) -> str | None:
    """Why the CPU verifier cannot run a graph of these dtypes (numpy has no bfloat16), or None."""
    if dtype in _NUMPY_DTYPES and (kv_dtype in _NUMPY_DTYPES or is_quantized(kv_dtype)):
        return None
    return f"numpy cannot run a bfloat16 graph (dtype {dtype}, kv_cache_dtype {kv_dtype}); build float16 or float32 to verify"


@dataclass(frozen=True)
class VerificationResult:
    max_abs_diff: float
    tolerance: float
    max_abs_logit: float
    rows: int
    steps: int = 2
    method: str = "onnx.reference vs transformers forward"

    def as_dict(self) -> dict[str, Any]:
        return {"max_abs_diff": self.max_abs_diff, "tolerance": self.tolerance, "max_abs_logit": self.max_abs_logit,
                "rows": self.rows, "steps": self.steps, "method": self.method}


def verify_onnx(
    onnx_path: Path, hf_model: Any, vocab_size: int, block_size: int, dtype: str, kv_dtype: str,
    step_model: Any = None,
) -> VerificationResult:
    """Runs the probe through the ONNX graph and HF (or, for a quantized kv_dtype, the eager
    `step_model` over a cache of that kv_dtype); raises VerificationError past the tolerance."""
    from onnx.reference import ReferenceEvaluator

    from trtpaged.builder.onnx_reference import TrtpagedPagedAttention

    reason = unsupported_reason(dtype, kv_dtype)
    if reason:
        raise VerificationError(reason)
    session = ReferenceEvaluator(str(onnx_path), new_ops=[TrtpagedPagedAttention])
    seqs, steps, num_blocks = standard_probe(vocab_size, block_size, all_rows=True)
    first = session.input_names
    shape = [num_blocks] + [d.dim_value for d in _kv_input(session).type.tensor_type.shape.dim[1:]]
    quantized = is_quantized(kv_dtype)
    if quantized and step_model is None:
        raise VerificationError(f"kv_cache_dtype {kv_dtype}: verifying the graph needs the step model to compare with")
    pool = np.zeros(shape, dtype=np.int8 if quantized else _NUMPY_DTYPES[kv_dtype])
    eager_pool = step_model.new_kv_cache(num_blocks, block_size, kv_dtype) if quantized else None
    worst, peak, rows = 0.0, 0.0, 0
    for step in steps:
        feeds = {name: t.numpy() for name, t in step.inputs.items()}
        feeds["kv_cache"] = pool
        logits, pool = session.run(None, {n: feeds[n] for n in first})
        if quantized:
            with torch.no_grad():
                ref = step_model(*step.args(eager_pool))[0].double().numpy()
        else:
            ref = hf_logits(hf_model, seqs, step.rows).numpy()
        worst = max(worst, float(np.abs(logits.astype(np.float64) - ref).max()))
        peak = max(peak, float(np.abs(ref).max()))
        rows += len(step.rows)
    atol, rtol = TOLERANCES[dtype]
    method = (f"onnx.reference vs the eager step model, both with a {kv_dtype} cache" if quantized
              else "onnx.reference vs transformers forward")
    result = VerificationResult(max_abs_diff=worst, tolerance=atol + rtol * peak, max_abs_logit=peak, rows=rows,
                                method=method)
    if not worst <= result.tolerance:
        what = "step model" if quantized else "hf"
        raise VerificationError(
            f"verification failed: max |onnx - {what}| logits = {worst:.3g} over {rows} rows, tolerance {result.tolerance:.3g} "
            f"({dtype}: {atol} + {rtol} * max|logit| {peak:.3g})"
        )
    return result


def _kv_input(session: Any) -> Any:
    return next(i for i in session.proto_.graph.input if i.name == "kv_cache")
