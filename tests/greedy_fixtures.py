"""The tiny-model runtime tests' prompts and their Hugging Face greedy continuations, as module fixtures
shared by test_runtime_tiny.py and test_tensor_parallel_runtime.py: a module imports `prompts` and
`reference` from here and defines its own `hf` (the model the references come from)."""

from __future__ import annotations

import pytest
import torch

from runtime_helpers import hf_greedy

EOS = 257
MAX_TOKENS = 12
LENGTHS = (1, 5, 16, 17, 31, 54, 97, 40)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(hf, prompts) -> list[list[int]]:
    return [hf_greedy(hf, p, MAX_TOKENS, EOS) for p in prompts]
