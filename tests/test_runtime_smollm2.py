"""SmolLM2-135M through the runtime against Hugging Face generate (same GGUF weights)."""

from __future__ import annotations

import pytest

from runtime_helpers import hf_beams, hf_from_engine_dir, hf_greedy, run_staggered, runtime_config
from trtpaged import LLM, SamplingParams
from trtpaged.runtime.runners import TorchRunner
from trtpaged.runtime.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
TEXTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time",
    "def fibonacci(n):",
    "Water boils at",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Translate to French: Good morning, how are you today? My name is",
    "Q: What is the largest planet in the solar system?\nA:",
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def llm(smollm2_engine_dir):
    return LLM(smollm2_engine_dir, device="cpu", num_kv_blocks=128)


@pytest.fixture(scope="module")
def hf(smollm2_engine_dir):
    return hf_from_engine_dir(smollm2_engine_dir)


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(hf, prompts, llm):
    return [hf_greedy(hf, p, MAX_TOKENS, llm.manifest.eos_token_ids[0]) for p in prompts]


def variant(llm: LLM, **kw) -> LLMEngine:
    """Another runtime over the same loaded weights, with its own pool and limits."""
    config = runtime_config(**{"num_kv_blocks": 128, "max_batch_size": 8, "max_num_tokens": 256, **kw})
    model = llm.engine.runner.model
    engine = TorchRunner(model, model.new_kv_cache(config.num_kv_blocks, config.block_size))
    return LLMEngine(engine, config, llm.tokenizer, llm.manifest.eos_token_ids)


def tokens(engine, prompts, every=1):
    return [o.outputs[0].token_ids for o in run_staggered(engine, [(p, GREEDY) for p in prompts], every)]


def test_greedy_matches_hf_staggered(llm, prompts, reference):
    assert tokens(variant(llm), prompts, every=2) == reference


def test_greedy_matches_hf_with_preemption_and_chunked_prefill(llm, prompts, reference):
    small_pool = variant(llm, num_kv_blocks=9)
    assert tokens(small_pool, prompts) == reference
    assert small_pool.stats()["num_preemptions"] > 0
    chunked = variant(llm, max_num_tokens=16)
    assert tokens(chunked, prompts) == reference


def test_greedy_matches_hf_with_shared_system_prompt(llm, hf):
    questions = ["What is 2+2?", "Name a color.", "Who wrote Hamlet?"]
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in questions]
    eos = llm.manifest.eos_token_ids[0]
    reference = [hf_greedy(hf, p, 8, eos) for p in prompts]
    engine = variant(llm)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = run_staggered(engine, [(p, params) for p in prompts], every=2)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert engine.stats()["prefix_cache_hits_tokens"] >= 2 * 16


def test_beam_search_matches_hf(llm, hf, prompts):
    engine = variant(llm)
    params = SamplingParams(max_tokens=6, temperature=0.0, beam_width=3, n=3)
    outs = run_staggered(engine, [(p, params) for p in prompts[:2]])
    eos = llm.manifest.eos_token_ids[0]
    for prompt, out in zip(prompts[:2], outs):
        assert [c.token_ids for c in out.outputs] == hf_beams(hf, prompt, 6, 3, eos)


def test_capital_of_france(llm):
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(max_tokens=24, temperature=0.0))
    assert "Paris" in out.outputs[0].text


def test_a_bad_word_sent_with_a_leading_space_is_banned_without_it_too(llm, hf):
    """vLLM strips a bad word's leading spaces before it bans the word alone and after a space, so bad_words
    [" Paris"] keeps "Paris" out at the start of an answer too (was: " Paris" and "  Paris" banned, "Paris" not)."""
    prompt = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    first = hf_greedy(hf, prompt, 1, llm.manifest.eos_token_ids[0])[0]
    word = llm.tokenizer.decode([first])
    assert word.strip() == word and llm.tokenizer.encode(word, add_special_tokens=False) == [first], word
    engine = variant(llm)
    for sent in (" " + word, word):
        params = SamplingParams(max_tokens=1, temperature=0.0, bad_words=[sent])
        (out,) = run_staggered(engine, [(prompt, params)])
        assert out.outputs[0].token_ids != [first], sent
