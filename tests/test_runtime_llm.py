"""The `LLM` API and `trtpaged generate` on the tiny engine dir (built by the builder)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from runtime_helpers import hf_from_engine_dir, hf_greedy
from trtpaged import LLM, SamplingParams
from trtpaged.cli import main


@pytest.fixture(scope="module")
def llm(tiny_engine_dir):
    return LLM(tiny_engine_dir, device="cpu")


def test_generate_text_and_token_prompts_match_hf(llm, tiny_engine_dir):
    hf = hf_from_engine_dir(tiny_engine_dir)
    prompts = ["hello there", [5, 6, 7, 8, 9, 10], "a much longer prompt that spans more than one block of sixteen"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    assert [o.prompt for o in outs] == [prompts[0], None, prompts[2]]
    assert outs[1].prompt_token_ids == prompts[1]
    eos = llm.manifest.eos_token_ids[0]
    for out in outs:
        expected = hf_greedy(hf, out.prompt_token_ids, 10, eos)
        completion = out.outputs[0]
        assert completion.token_ids == expected
        assert completion.text == llm.tokenizer.decode(expected, skip_special_tokens=True)
        assert completion.finish_reason in ("stop", "length")


def test_stats_and_engine_plan_path(llm, tiny_engine_dir):
    stats = llm.stats()
    for key in ("kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "kv_utilisation",
                "kv_blocks_saved_by_sharing", "prefix_cache_hits_tokens", "num_preemptions", "num_steps"):
        assert key in stats
    assert stats["kv_blocks_total"] == llm.manifest.kv_cache.num_blocks
    with pytest.raises(ValueError, match=r"max_num_tokens: must be in \[1, 256\]"):
        LLM(tiny_engine_dir, max_num_tokens=100000)


def test_refusal_names_the_limit(llm):
    with pytest.raises(ValueError, match="max_seq_len"):
        llm.generate([[1] * (llm.config.max_seq_len + 1)])


def test_cli_generate_streams(tiny_engine_dir):
    result = CliRunner().invoke(main, ["generate", str(tiny_engine_dir), "--prompt", "hi", "--max-tokens", "6", "--chat"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(
        main, ["generate", str(tiny_engine_dir), "--prompt", "hi", "--max-tokens", "4", "--n", "2", "--temperature", "1", "--seed", "3"]
    )
    assert result.exit_code == 0 and result.output.count("--- [") == 2
    result = CliRunner().invoke(main, ["generate", str(tiny_engine_dir), "--prompt", "hi", "--beam-width", "3", "--max-tokens", "4"])
    assert result.exit_code == 0 and result.output.count("--- [") == 1


def test_generate_refusing_one_prompt_queues_none_of_them(tiny_engine_dir):
    llm = LLM(tiny_engine_dir, device="cpu")
    with pytest.raises(ValueError, match=r"max_seq_len \(512\)"):
        llm.generate(["hello", [5] * 600], SamplingParams(max_tokens=8, temperature=0.0))
    assert not llm.engine.has_unfinished()
    assert llm.stats()["num_waiting"] == 0 and llm.stats()["kv_blocks_used"] == 0
    assert [o.prompt for o in llm.generate(["world"], SamplingParams(max_tokens=8, temperature=0.0))] == ["world"]
    assert llm.stats()["prefix_cache_queries_tokens"] == len("world")  # "hello" never ran


def test_failed_step_returns_every_block(tiny_engine_dir) -> None:
    """An engine step that raises must not leave the call's requests queued or holding blocks."""
    llm = LLM(tiny_engine_dir)
    backend = llm.engine.runner
    real_step = backend.step
    calls = {"n": 0}

    def failing_step(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real_step(batch)

    backend.step = failing_step
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(["hello there", "general kenobi"], SamplingParams(max_tokens=8, temperature=0.0))
    backend.step = real_step
    assert not llm.engine.has_unfinished()
    assert llm.stats()["kv_blocks_used"] == 0
    # and the LLM keeps working
    out = llm.generate(["hello there"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
