"""Build-time verification: the exported ONNX graph, run on CPU, against the HF model's own forward.

Runs the graph with onnx.reference.ReferenceEvaluator (the custom node in
numpy) over the two chained steps of the standard probe (step 1: two
prefills; step 2: a continuing chunk, a new prefill and a decode, with the pool
from step 1 fed back), asks for the logits of every packed token, and compares
them with HF's logits at the same positions.

A tensor-parallel engine has one graph per rank: they run jointly, one thread
per rank, their TrtpagedAllReduce nodes summing through one exchange
(builder/onnx_allreduce.py); every rank's logits are compared with HF.

Tolerance (documented in `trtpaged build --help`): max |onnx - hf| must be at
most `atol + rtol * max |hf|`, with (atol, rtol) = TOLERANCES[dtype], or of the KV cache's
dtype when that is the less precise.

A graph over a quantized KV cache (int8, fp8_e4m3) computes what no HF forward
does: it is compared, with the same tolerance, with the eager step model running
the same steps over the same kind of cache (the torch backend: the kernel
library's quantization), and the kv_accuracy stage measures the cache against a
full-precision one.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from trtpaged.builder.probe import hf_logits, standard_probe
from trtpaged.kv_quant import is_quantized

# float32: the HF forward itself moves by ~3e-4 * max|logit| between float32 and float64 on SmolLM2,
# and the ONNX graph (numpy) is about as far from float64 as HF float32 is, in the other direction.
# A quantized cache's graph is compared with the eager step model over the same kind of cache: each
# rounds K/V to codes from its own float32 activations, and a last-bit difference at a rounding tie
# moves a code by a whole step, which later layers carry on. SmolLM2-135M (30 layers), same codes on
# every CPU path: max |onnx - eager| 0.38-0.44 (int8), 0.86-1.25 (fp8_e4m3) at max|logit| 34 (float32's
# tolerance, 0.07, failed the int8 build); the eager model's own float32 cache differs from the
# reference attention's by 0.002, and an int8 cache differs from a float32 one by 7.7.
TOLERANCES = {"float32": (1e-3, 2e-3), "float16": (5e-2, 1e-2), "bfloat16": (2e-1, 3e-2),
              "int8": (2e-1, 3e-2), "fp8_e4m3": (5e-1, 6e-2)}
_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


class VerificationError(RuntimeError):
    """The exported graph's logits differ from HF's beyond the tolerance."""


def unsupported_reason(dtype: str, kv_cache_dtype: str) -> str | None:
    """Why the CPU verifier cannot run a graph of these dtypes (numpy has no bfloat16), or None."""
    if dtype in _NUMPY_DTYPES and (kv_cache_dtype in _NUMPY_DTYPES or is_quantized(kv_cache_dtype)):
        return None
    return (f"numpy cannot run a bfloat16 graph (dtype {dtype}, kv_cache_dtype {kv_cache_dtype}); "
            "build float16 or float32 to verify")


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
    onnx_path: Union[Path, Sequence[Path]], hf_model: Any, vocab_size: int, block_size: int, dtype: str,
    kv_cache_dtype: str, step_model: Any = None,
) -> VerificationResult:
    """Runs the probe through the ONNX graph (or the rank graphs, jointly) and HF (or, for a quantized
    kv_cache_dtype, the eager whole `step_model` over a cache of that kv_cache_dtype); raises VerificationError past
    the tolerance."""
    from onnx.reference import ReferenceEvaluator

    from trtpaged.builder.onnx_allreduce import AllReduceExchange, reference_op
    from trtpaged.builder.onnx_reference import TrtpagedPagedAttention

    reason = unsupported_reason(dtype, kv_cache_dtype)
    if reason:
        raise VerificationError(reason)
    paths = [onnx_path] if isinstance(onnx_path, (str, Path)) else list(onnx_path)
    exchange = AllReduceExchange(len(paths))
    ops = [TrtpagedPagedAttention, reference_op(exchange)]
    sessions = [ReferenceEvaluator(str(p), new_ops=ops) for p in paths]
    seqs, steps, num_kv_blocks = standard_probe(vocab_size, block_size, all_rows=True)
    quantized = is_quantized(kv_cache_dtype)
    if quantized and step_model is None:
        raise VerificationError(f"kv_cache_dtype {kv_cache_dtype}: verifying the graph needs the step model "
                                "to compare with")
    pool_dtype = np.int8 if quantized else _NUMPY_DTYPES[kv_cache_dtype]
    pools = [np.zeros([num_kv_blocks] + [d.dim_value for d in _kv_input(s).type.tensor_type.shape.dim[1:]],
                      dtype=pool_dtype) for s in sessions]
    eager_pool = step_model.new_kv_cache(num_kv_blocks, block_size, kv_cache_dtype) if quantized else None
    worst, peak, rows = 0.0, 0.0, 0
    # where the reference's logits are finite, a 16-bit cache's range is what the graph can lose them to
    overflow = ("keys or values past float16's range (65504) overflow the float16 KV cache (the reference's logits "
                "are finite); build with kv_cache_dtype bfloat16 or float32"
                if kv_cache_dtype == "float16" and dtype != "float16" else None)  # fmt: skip
    for step in steps:
        feeds = {name: t.numpy() for name, t in step.inputs.items()}
        outs = _run_ranks(sessions, feeds, pools, exchange)
        pools = [pool for _, pool in outs]
        if quantized:
            with torch.no_grad():
                ref = step_model(*step.args(eager_pool))[0].double().numpy()
        else:
            ref = hf_logits(hf_model, seqs, step.rows).numpy()
        _check_finite(ref, "quantized-cache step model" if quantized else "transformers (the reference)", step)
        for rank, (logits, _) in enumerate(outs):
            _check_finite(logits, "ONNX graph" + (f" of rank {rank}" if len(outs) > 1 else ""), step, overflow)
        # max() would skip a NaN (nan > x is False): the checks above keep every value finite
        worst = max(worst, *(float(np.abs(logits.astype(np.float64) - ref).max()) for logits, _ in outs))
        peak = max(peak, float(np.abs(ref).max()))
        rows += len(step.rows)
    # a 16-bit KV cache under float32 activations rounds K and V as a 16-bit model would: its bound
    # (a quantized cache is compared with the step model over the same cache: the activations' bound)
    precision = max((dtype, kv_cache_dtype), key=lambda d: TOLERANCES.get(d, (0.0, 0.0))[1])
    atol, rtol = TOLERANCES[precision]
    method = (f"onnx.reference vs the eager step model, both with a {kv_cache_dtype} cache" if quantized
              else "onnx.reference vs transformers forward")
    result = VerificationResult(max_abs_diff=worst, tolerance=atol + rtol * peak, max_abs_logit=peak, rows=rows,
                                method=method)
    if not worst <= result.tolerance:
        named = dtype if precision == dtype else f"kv_cache_dtype {kv_cache_dtype}"
        what = "step model" if quantized else "hf"
        raise VerificationError(
            f"verification failed: max |onnx - {what}| logits = {worst:.3g} over {rows} rows, "
            f"tolerance {result.tolerance:.3g} "
            f"({named}: {atol} + {rtol} * max|logit| {peak:.3g})"
        )
    return result


def _check_finite(logits: np.ndarray, what: str, step: Any, cause: Optional[str] = None) -> None:
    """NaN or inf logits fail verification, whatever the difference says; `cause`: the likely one, when known."""
    finite = np.isfinite(logits)
    if not finite.all():
        raise VerificationError(f"verify: the {what} gives {int((~finite).sum())} NaN/inf logits of {finite.size} "
                                f"over {len(step.rows)} rows; " + (cause or "the model's weights or config are broken "
                                "(e.g. rope_theta, rms_norm_eps, NaN weights)"))


def _run_ranks(sessions: list, feeds: dict, pools: list, exchange: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each rank's (logits, pool) after one step; the ranks run concurrently (their all-reduces meet)."""
    def run(rank: int):
        try:
            inputs = {**feeds, "kv_cache": pools[rank]}
            return sessions[rank].run(None, {n: inputs[n] for n in sessions[rank].input_names})
        except BaseException:
            exchange.abort()  # the other ranks would wait for this one's all-reduce forever
            raise

    if len(sessions) == 1:
        return [tuple(run(0))]
    with ThreadPoolExecutor(len(sessions)) as pool:
        futures = [pool.submit(run, r) for r in range(len(sessions))]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:  # the rank that failed first, not the ones its abort woke
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return [tuple(f.result()) for f in futures]


def _kv_input(session: Any) -> Any:
    return next(i for i in session.proto_.graph.input if i.name == "kv_cache")
