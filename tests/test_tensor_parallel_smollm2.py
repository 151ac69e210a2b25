"""SmolLM2-135M (9 heads, 3 KV heads) on 3 ranks (gloo, loopback) against the 1-rank engine and HF.

Greedy tokens must equal the 1-rank engine's except at near-ties: where they part, the two tokens' logits
under HF's own forward (the independent truth) must be within a small fraction of the logit range.
"""

from __future__ import annotations

import pytest
import torch

from runtime_helpers import hf_from_engine_dir
from trtpaged import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
TEXTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time",
    "def fibonacci(n):",
    "Water boils at",
    "Translate to French: Good morning, how are you today? My name is",
]
NEAR_TIE = 1e-3  # of max |logit|: float32 sums in another order move logits by ~1e-5 of it


def test_three_ranks_greedy_equal_one_rank_except_near_ties(smollm2_engine_dir, smollm2_tp3_engine_dir):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with LLM(smollm2_engine_dir, device="cpu", num_kv_blocks=128) as one:
        prompts = [one.tokenizer.encode(t) for t in TEXTS]
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    with LLM(smollm2_tp3_engine_dir, device="cpu", num_kv_blocks=128) as three:
        assert three.engine.runner.world_size == 3
        got = [o.outputs[0].token_ids for o in three.generate(prompts, params)]
    exact = 0
    for prompt, a, b in zip(prompts, want, got):
        if a == b:
            exact += 1
            continue
        i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        hf = hf_from_engine_dir(smollm2_engine_dir)  # the truth, needed only where the two part
        with torch.no_grad():
            logits = hf.model(input_ids=torch.tensor([prompt + a[:i]])).logits[0, -1].float()
        gap = abs(float(logits[a[i]] - logits[b[i]]))
        assert gap <= NEAR_TIE * float(logits.abs().max()), (TEXTS[prompts.index(prompt)], i, gap)
    assert exact >= len(TEXTS) - 1
