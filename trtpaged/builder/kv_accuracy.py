"""Accuracy of a quantized KV cache (int8, fp8_e4m3), measured at build.

The same step model runs each built-in prompt (accuracy.PROMPTS, plus one long prompt for long
context) three times through the real prefill + decode path:

1. with a full-precision (float32) cache, greedy: the reference tokens and logits;
2. with the quantized cache, teacher-forced on the reference tokens: max |logit - reference logit|
   over every generated position, and top-1 agreement (the reference token is still the argmax);
3. with the quantized cache, greedy on its own: greedy agreement, the tokens generated before the
   first difference from the reference (and the fraction of positions equal), and at that first
   difference the reference's top-1 minus top-2 logit (both runs saw the same tokens up to there, so
   this is the margin the quantized cache had to flip: a near-tie when it is below the teacher-forced
   logit error).

Tolerance (a build past it fails, with the figures): KV_ACCEPT[kv_cache_dtype] is the least teacher-forced
top-1 agreement over all prompts (docs/quantization.md, "KV cache").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from trtpaged.builder.accuracy import PROMPTS, AccuracyError

NEW_TOKENS = 64
LONG_PROMPT_TOKENS = 1024
KV_ACCEPT = {"int8": 0.95, "fp8_e4m3": 0.85}


@dataclass(frozen=True)
class PromptKVAccuracy:
    prompt_tokens: int
    new_tokens: int
    max_abs_diff: float  # teacher-forced, over the generated positions
    top1_agreement: float  # teacher-forced
    greedy_prefix: int  # tokens generated identically before the first difference (free-running)
    greedy_equal: float  # fraction of generated positions with the same token (free-running)
    divergence_gap: Optional[float] = None  # reference top-1 minus top-2 logit at the first difference
    divergence_shift: Optional[float] = None  # how much the quantized cache moved that margin (teacher-forced)


@dataclass(frozen=True)
class KVAccuracyReport:
    kv_cache_dtype: str
    threshold: float
    prompts: list[PromptKVAccuracy]

    @property
    def max_abs_diff(self) -> float:
        return max(p.max_abs_diff for p in self.prompts)

    @property
    def top1_agreement(self) -> float:
        return sum(p.top1_agreement * p.new_tokens for p in self.prompts) / sum(p.new_tokens for p in self.prompts)

    def as_dict(self) -> dict[str, Any]:
        return {"kv_cache_dtype": self.kv_cache_dtype, "threshold": self.threshold, "max_abs_diff": self.max_abs_diff,
                "top1_agreement": self.top1_agreement, "prompts": [asdict(p) for p in self.prompts]}  # fmt: skip

    def line(self) -> str:
        greedy = ", ".join(f"{p.greedy_prefix}/{p.new_tokens}" for p in self.prompts)
        gaps = [f"{p.divergence_gap:.3g} (moved {p.divergence_shift:.3g})" for p in self.prompts
                if p.divergence_gap is not None and p.divergence_shift is not None]
        at = f", reference top-2 gap at the first difference {', '.join(gaps)}" if gaps else ""
        return (f"KV {self.kv_cache_dtype} vs float32 cache: max |dlogit| {self.max_abs_diff:.3g}, "
                f"teacher-forced top-1 {self.top1_agreement:.1%} over {sum(p.new_tokens for p in self.prompts)} "
                "tokens; greedy identical "
                f"for {greedy} tokens{at} (prompts of {', '.join(str(p.prompt_tokens) for p in self.prompts)} tokens)")


def _generate(step_model: Any, prompt: list[int], kv_cache_dtype: str, block_size: int, new_tokens: int,
              forced: Optional[list[int]] = None) -> tuple[list[int], torch.Tensor]:
    """Prefill then one decode step per token: (generated tokens, their logits [new_tokens, vocab]).
    With `forced`, those tokens are fed back instead of the argmax (teacher forcing)."""
    i32 = torch.int32
    n = len(prompt)
    blocks = -(-(n + new_tokens) // block_size)
    cache = step_model.new_kv_cache(blocks, block_size, kv_cache_dtype)
    table = torch.arange(blocks, dtype=i32)[None, :]
    tokens: list[int] = []
    rows = []
    ids, start = prompt, 0
    with torch.inference_mode():
        for i in range(new_tokens):
            m = len(ids)
            logits, cache = step_model(torch.tensor(ids, dtype=i32), torch.arange(start, start + m, dtype=i32),
                                       torch.tensor([0, m], dtype=i32), torch.tensor([start + m], dtype=i32), table,
                                       torch.tensor([m - 1], dtype=i32), cache)
            row = logits[0].float()
            rows.append(row)
            tokens.append(int(row.argmax()))
            ids, start = [forced[i] if forced is not None else tokens[-1]], start + m
    return tokens, torch.stack(rows)


def _prompts(tokenizer: Any, vocab_size: int, max_seq_len: int, new_tokens: int) -> list[list[int]]:
    out = []
    for text in PROMPTS:
        ids = [min(int(t), vocab_size - 1) for t in tokenizer.encode(text)] or [0]
        out.append(ids)
    # long context: the prompts repeated up to LONG_PROMPT_TOKENS (or what max_seq_len leaves)
    long_len = min(LONG_PROMPT_TOKENS, max_seq_len - new_tokens)
    if long_len > 2 * max(len(p) for p in out):
        joined = [t for p in out for t in p]
        out.append((joined * (long_len // len(joined) + 1))[:long_len])
    return out


def measure_kv_accuracy(step_model: Any, tokenizer: Any, kv_cache_dtype: str, block_size: int, max_seq_len: int,
                        new_tokens: int = NEW_TOKENS, check: bool = True) -> KVAccuracyReport:
    """The three runs per prompt; raises AccuracyError when teacher-forced top-1 agreement is below
    KV_ACCEPT[kv_cache_dtype] (unless check is False)."""
    new_tokens = min(new_tokens, max_seq_len - 8)
    vocab = step_model.dims.vocab_size
    results = []
    for prompt in _prompts(tokenizer, vocab, max_seq_len, new_tokens):
        prompt = prompt[: max_seq_len - new_tokens]
        ref_tokens, ref_logits = _generate(step_model, prompt, "float32", block_size, new_tokens)
        _, forced_logits = _generate(step_model, prompt, kv_cache_dtype, block_size, new_tokens, forced=ref_tokens)
        for what, logits in (("the float32 cache", ref_logits), (f"the {kv_cache_dtype} cache", forced_logits)):
            if not bool(torch.isfinite(logits).all()):
                raise AccuracyError(f"kv_accuracy: the step model with {what} gives NaN/inf logits; the weights "
                                    "or the config are broken")
        free_tokens, _ = _generate(step_model, prompt, kv_cache_dtype, block_size, new_tokens)
        same = [a == b for a, b in zip(ref_tokens, free_tokens)]
        prefix = same.index(False) if False in same else len(same)
        gap = shift = None
        if prefix < len(same):  # both runs saw the same tokens so far: forced_logits[prefix] is the free run's
            top2 = ref_logits[prefix].topk(2)
            a, b = top2.indices.tolist()
            gap = float(top2.values[0] - top2.values[1])
            shift = gap - float(forced_logits[prefix, a] - forced_logits[prefix, b])
        top1 = float((forced_logits.argmax(-1) == torch.tensor(ref_tokens)).float().mean())
        results.append(PromptKVAccuracy(len(prompt), new_tokens, float((forced_logits - ref_logits).abs().max()),
                                        top1, prefix, sum(same) / len(same), gap, shift))  # fmt: skip
    report = KVAccuracyReport(kv_cache_dtype, KV_ACCEPT[kv_cache_dtype], results)
    if check and report.top1_agreement < report.threshold:
        raise AccuracyError(f"kv_accuracy: {report.line()}; kv_cache_dtype {kv_cache_dtype} needs teacher-forced top-1 "
                            f"agreement >= {report.threshold:.0%}")
    return report
