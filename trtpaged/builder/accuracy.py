"""Accuracy of a quantized engine against the unquantized model, measured at build.

For a few built-in prompts, the unquantized HF model greedily continues each
prompt; then every position of prompt + continuation is scored, teacher-forced,
by (a) the HF model with the de-quantized weights (full-precision activations:
what the ONNX / TensorRT graph computes) and (b) the eager step model the torch
backend runs (on a CPU with the kernel library: integer kernels, activations
quantized to int8 per 32 inputs; elsewhere de-quantized weights, float
activations).
Reported per path: max |logit - reference logit| over all positions, top-1
agreement, and agreement where the reference's top-2 gap is at least the near-tie
band (a flip inside a near-tie is rounding, not damage): NEAR_TIE, or the RMS logit
error the weights' own rounding causes in path (a) where that is larger. Random
weights (a tiny test model) have logits so flat that int4 rounding flips a third of
their tokens; judged inside that band they agree as a real model's do, while a broken
layout, whose errors are as large as the logits' spread, leaves too few positions
outside it (MIN_CLEAR) to pass.

Tolerances (a build past them fails, with the figures): ACCEPT[scheme] is the
least top-1 agreement away from near-ties, for path (a) and path (b). Quantizing
the activations too costs agreement of its own (SmolLM2 with its Q4_1 weights
carried exactly: 100% with float activations, 97.8% with int8 activations over
140 positions), so (b)'s bounds are looser.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "Photosynthesis is the process by which plants",
)
NEW_TOKENS = 24
NEAR_TIE = 0.01
MIN_CLEAR = 0.25  # the least share of positions outside the near-tie band for agreement to be judged
# least top-1 agreement away from near-ties per weights scheme: (float activations, torch backend);
# "exact": every weight carried bit for bit from the source (docs/quantization.md)
ACCEPT = {"exact": (0.97, 0.90), "int8": (0.95, 0.90), "int4": (0.80, 0.75)}


class AccuracyError(RuntimeError):
    """A quantized engine disagrees with the unquantized model beyond its scheme's tolerance."""


@dataclass(frozen=True)
class PathAccuracy:
    max_abs_diff: float
    agreement: float  # top-1 equal to the reference's, all positions
    agreement_away_from_ties: float  # positions whose reference top-2 gap >= near_tie
    positions: int
    near_tie: float = NEAR_TIE  # the band: NEAR_TIE, or path (a)'s RMS logit error where larger
    clear_share: float = 1.0  # positions outside the band


@dataclass(frozen=True)
class AccuracyReport:
    scheme: str
    threshold: tuple[float, float]
    full_precision_activations: PathAccuracy
    torch_backend: PathAccuracy
    torch_backend_activations: str  # "int8 per 32 inputs" or "float"

    def as_dict(self) -> dict[str, Any]:
        band = self.full_precision_activations.near_tie
        return {"scheme": self.scheme, "threshold": self.threshold, "near_tie": band,
                "prompts": len(PROMPTS), "new_tokens": NEW_TOKENS,
                "full_precision_activations": asdict(self.full_precision_activations),
                "torch_backend": {**asdict(self.torch_backend), "activations": self.torch_backend_activations}}

    def line(self) -> str:
        a, b = self.full_precision_activations, self.torch_backend
        return (f"vs unquantized: top-1 {a.agreement:.1%} / {b.agreement:.1%} (float activations / torch backend, "
                f"{self.torch_backend_activations} activations), "
                f"away from ties (top-2 gap >= {a.near_tie:.3g}) {a.agreement_away_from_ties:.1%} / "
                f"{b.agreement_away_from_ties:.1%}, "
                f"max |dlogit| {a.max_abs_diff:.3g} / {b.max_abs_diff:.3g} over {a.positions} positions")


def _sequences(hf_model: Any, tokenizer: Any) -> list[list[int]]:
    """Each prompt followed by the unquantized model's own greedy continuation."""
    out = []
    for text in PROMPTS:
        ids = [int(t) for t in tokenizer.encode(text)][:64] or [0]
        ids = [min(i, hf_model.config.vocab_size - 1) for i in ids]
        prompt = torch.tensor([ids])
        with torch.inference_mode():
            gen = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append([int(t) for t in gen[0]])
    return out


def _hf_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def _step_logits(step_model: Any, tokens: list[int], block_size: int) -> torch.Tensor:
    """One prefill step over all of `tokens`, every row's logits (the torch backend's own path)."""
    n = len(tokens)
    blocks = -(-n // block_size)
    cache = step_model.new_kv_cache(blocks, block_size)
    i32 = torch.int32
    with torch.inference_mode():
        logits, _ = step_model(torch.tensor(tokens, dtype=i32), torch.arange(n, dtype=i32),
                               torch.tensor([0, n], dtype=i32), torch.tensor([n], dtype=i32),
                               torch.arange(blocks, dtype=i32)[None, :], torch.arange(n, dtype=i32), cache)
    return logits


def _rms_error(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    squares = sum(float((r - g).pow(2).sum()) for r, g in zip(ref, got))
    return (squares / max(sum(r.numel() for r in ref), 1)) ** 0.5


def _compare(ref: list[torch.Tensor], got: list[torch.Tensor], what: str, near_tie: float = NEAR_TIE) -> PathAccuracy:
    worst, agree, agree_clear, clear, total = 0.0, 0, 0, 0, 0
    for r, g in zip(ref, got):
        for name, t in (("the unquantized model", r), (what, g)):
            bad = int((~torch.isfinite(t)).sum())
            if bad:  # max() skips NaN and argmax of NaN rows is arbitrary: fail, naming the path
                raise AccuracyError(f"accuracy: {name} gives {bad} NaN/inf logits of {t.numel()}; "
                                    "the weights or the config are broken")
        worst = max(worst, float((r - g).abs().max()))
        top2 = r.topk(2, dim=-1).values
        clear_rows = (top2[:, 0] - top2[:, 1]) >= near_tie
        same = r.argmax(-1) == g.argmax(-1)
        agree += int(same.sum())
        agree_clear += int((same & clear_rows).sum())
        clear += int(clear_rows.sum())
        total += r.shape[0]
    return PathAccuracy(worst, agree / total, agree_clear / max(clear, 1), total, near_tie, clear / max(total, 1))


def measure_accuracy(hf_model: Any, tokenizer: Any, dequantized_hf: Any, step_model: Any, block_size: int,
                     scheme: str) -> AccuracyReport:
    """Compares both quantized paths with the unquantized model; raises AccuracyError past ACCEPT[scheme]."""
    seqs = _sequences(hf_model, tokenizer)
    truth = [_hf_logits(hf_model, s) for s in seqs]
    full = [truth[i] if dequantized_hf is hf_model else _hf_logits(dequantized_hf, s) for i, s in enumerate(seqs)]
    eager = [_step_logits(step_model, s, block_size) for s in seqs]
    from trtpaged.models.qlinear import uses_int8_activations

    int8 = uses_int8_activations(step_model)
    activations = "int8 per 32 inputs" if int8 else "float"
    bounds = ACCEPT[scheme] if int8 else (ACCEPT[scheme][0], ACCEPT[scheme][0])
    band = max(NEAR_TIE, _rms_error(truth, full))  # the weights' own rounding noise
    report = AccuracyReport(scheme, bounds, _compare(truth, full, "HF with the de-quantized weights", band),
                            _compare(truth, eager, "the torch backend's step model", band), activations)
    clear = report.full_precision_activations.clear_share
    if clear < MIN_CLEAR:
        raise AccuracyError(f"accuracy: {report.line()}; the weights' rounding moves the logits by {band:.3g} RMS, "
                            f"more than the top-2 gap at {1 - clear:.0%} of positions (at most "
                            f"{1 - MIN_CLEAR:.0%} may be): too far from the unquantized model to judge")
    got = (report.full_precision_activations.agreement_away_from_ties, report.torch_backend.agreement_away_from_ties)
    if any(g < t for g, t in zip(got, report.threshold)):
        need = " / ".join(f"{t:.0%}" for t in report.threshold)
        raise AccuracyError(f"accuracy: {report.line()}; scheme {scheme} needs top-1 agreement away from "
                            f"near-ties >= {need} (float activations / torch backend)")
    return report


def measure_graph_accuracy(hf_model: Any, tokenizer: Any, graph_hf: Any) -> PathAccuracy:
    """The TensorRT graph's weights (HF with them, full-precision activations: what the graph computes) against
    the unquantized model, where the build re-quantized tensors for the graph (builder/tensorrt_graph.py).
    The caller judges it (the torch engine does not run these weights)."""
    seqs = _sequences(hf_model, tokenizer)
    return _compare([_hf_logits(hf_model, s) for s in seqs], [_hf_logits(graph_hf, s) for s in seqs],
                    "HF with the TensorRT graph's weights")


def graph_accuracy_reason(result: PathAccuracy, scheme: str) -> str | None:
    """Why the TensorRT graph's weights are too far from the unquantized model for `scheme`, or None."""
    need = ACCEPT[scheme][0]
    if result.agreement_away_from_ties >= need:
        return None
    return (f"the TensorRT graph's re-quantized weights agree with the unquantized model's top-1 on "
            f"{result.agreement_away_from_ties:.1%} of {result.positions} positions away from near-ties "
            f"(max |dlogit| {result.max_abs_diff:.3g}); scheme {scheme} needs {need:.0%}")
