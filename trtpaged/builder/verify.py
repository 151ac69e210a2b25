"""Build-time verification: the exported ONNX graph, run on CPU, against the HF model's own forward.

Runs the graph with onnx.reference.ReferenceEvaluator (the custom node in
numpy) over the two chained steps of the standard probe (step 1: two
prefills; step 2: a continuing chunk, a new prefill and a decode, with the pool
from step 1 fed back), asks for the logits of every packed token, and compares
them with HF's logits at the same positions.

Tolerance (documented in `trtpaged build --help`): max |onnx - hf| must be at
most `atol + rtol * max |hf|`, with (atol, rtol) = TOLERANCES[dtype], or of the KV cache's
dtype when that is the less precise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trtpaged.builder.probe import hf_logits, standard_probe

# float32: the HF forward itself moves by ~3e-4 * max|logit| between float32 and float64 on SmolLM2,
# and the ONNX graph (numpy) is about as far from float64 as HF float32 is, in the other direction.
TOLERANCES = {"float32": (1e-3, 2e-3), "float16": (5e-2, 1e-2), "bfloat16": (2e-1, 3e-2)}
_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


class VerificationError(RuntimeError):
    """The exported graph's logits differ from HF's beyond the tolerance."""


def unsupported_reason(dtype: str, kv_dtype: str) -> str | None:
    """Why the CPU verifier cannot run a graph of these dtypes (numpy has no bfloat16), or None."""
    if dtype in _NUMPY_DTYPES and kv_dtype in _NUMPY_DTYPES:
        return None
    return f"numpy cannot run a bfloat16 graph (dtype {dtype}, kv_cache_dtype {kv_dtype}); build float16 or float32 to verify"


@dataclass(frozen=True)
class VerificationResult:
    max_abs_diff: float
    tolerance: float
    max_abs_logit: float
    rows: int
    steps: int = 2

    def as_dict(self) -> dict[str, Any]:
        return {"max_abs_diff": self.max_abs_diff, "tolerance": self.tolerance, "max_abs_logit": self.max_abs_logit,
                "rows": self.rows, "steps": self.steps, "method": "onnx.reference vs transformers forward"}


def verify_onnx(
    onnx_path: Path, hf_model: Any, vocab_size: int, block_size: int, dtype: str, kv_dtype: str
) -> VerificationResult:
    """Runs the probe through the ONNX graph and HF; raises VerificationError past the tolerance."""
    from onnx.reference import ReferenceEvaluator

    from trtpaged.builder.onnx_reference import TrtpagedPagedAttention

    reason = unsupported_reason(dtype, kv_dtype)
    if reason:
        raise VerificationError(reason)
    session = ReferenceEvaluator(str(onnx_path), new_ops=[TrtpagedPagedAttention])
    seqs, steps, num_blocks = standard_probe(vocab_size, block_size, all_rows=True)
    first = session.input_names
    shape = [num_blocks] + [d.dim_value for d in _kv_input(session).type.tensor_type.shape.dim[1:]]
    pool = np.zeros(shape, dtype=_NUMPY_DTYPES[kv_dtype])
    worst, peak, rows = 0.0, 0.0, 0
    for step in steps:
        feeds = {name: t.numpy() for name, t in step.inputs.items()}
        feeds["kv_cache"] = pool
        logits, pool = session.run(None, {n: feeds[n] for n in first})
        ref = hf_logits(hf_model, seqs, step.rows).numpy()
        worst = max(worst, float(np.abs(logits.astype(np.float64) - ref).max()))
        peak = max(peak, float(np.abs(ref).max()))
        rows += len(step.rows)
    # a 16-bit KV cache under float32 activations rounds K and V as a 16-bit model would: its bound
    precision = max((dtype, kv_dtype), key=lambda d: TOLERANCES.get(d, (0.0, 0.0))[1])
    atol, rtol = TOLERANCES[precision]
    result = VerificationResult(max_abs_diff=worst, tolerance=atol + rtol * peak, max_abs_logit=peak, rows=rows)
    if not worst <= result.tolerance:
        named = dtype if precision == dtype else f"kv_cache_dtype {kv_dtype}"
        raise VerificationError(
            f"verification failed: max |onnx - hf| logits = {worst:.3g} over {rows} rows, tolerance {result.tolerance:.3g} "
            f"({named}: {atol} + {rtol} * max|logit| {peak:.3g})"
        )
    return result


def _kv_input(session: Any) -> Any:
    return next(i for i in session.proto_.graph.input if i.name == "kv_cache")
