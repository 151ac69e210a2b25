"""Regressions found by QA: each test failed before its fix."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from runtime_helpers import RandomLogitsEngine, runtime_config
from trtpaged import LLM, SamplingParams
from trtpaged.cli import main
from trtpaged.runtime.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def fake_engine(**kw) -> LLMEngine:
    config = runtime_config(**{"num_blocks": 64, "block_size": 4, "max_seq_len": 32, **kw})
    return LLMEngine(RandomLogitsEngine(config.num_blocks), config, eos_token_ids=[0])


def run(engine: LLMEngine):
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    return done


def test_generate_refusing_one_prompt_queues_none_of_them(tiny_engine_dir):
    llm = LLM(tiny_engine_dir, device="cpu")
    with pytest.raises(ValueError, match=r"max_seq_len \(512\)"):
        llm.generate(["hello", [5] * 600], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.stats()["num_waiting"] == 0 and llm.stats()["kv_blocks_used"] == 0
    assert [o.prompt for o in llm.generate(["world"], GREEDY)] == ["world"]
    assert llm.stats()["prefix_cache_queries_tokens"] == len("world")  # "hello" never ran


def test_prompt_filling_max_seq_len_is_refused():
    e = fake_engine()
    with pytest.raises(ValueError, match=r"max_seq_len \(32\).*no room"):
        e.add_request(list(range(1, 33)), GREEDY)
    assert not e.has_unfinished() and e.kv.pool.num_used == 0
    e.add_request(list(range(1, 32)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    (out,) = run(e)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_sampling_params_accept_vllm_spellings_and_reject_bad_types():
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    assert SamplingParams(top_k=-1).top_k == 0
    for bad in (dict(stop=[""]), dict(stop=[1]), dict(stop=5), dict(n=2.0), dict(max_tokens=2.5),
                dict(temperature="0.5"), dict(top_p=float("nan")), dict(stop_token_ids=["a"])):
        with pytest.raises(ValueError, match=r"SamplingParams\.\w+"):
            SamplingParams(**bad)


def test_max_tokens_none_runs_to_max_seq_len():
    e = fake_engine()
    e.add_request([1, 2, 3], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    e.add_request([1, 2, 3], SamplingParams(max_tokens=None, beam_width=2, ignore_eos=True))
    outs = run(e)
    assert [len(o.outputs[0].token_ids) for o in outs] == [29, 29]


def test_tiny_temperature_samples_greedily_instead_of_crashing():
    e = fake_engine()
    e.add_request([1, 2, 3], SamplingParams(max_tokens=6, temperature=1e-45, seed=0, ignore_eos=True))
    e.add_request([1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    a, b = run(e)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_build_with_inconsistent_tiny_heads_is_a_clear_error(tmp_path):
    data = {
        "model": {"tiny": {"hidden_size": 64, "num_attention_heads": 3, "num_key_value_heads": 1}},
        "max_seq_len": 64, "kv_cache": {"num_blocks": 8},
    }
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["build", str(tmp_path / "m.yaml"), "-o", str(tmp_path / "out" / "eng")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "model.tiny" in result.output and "not a multiple of the number of attention heads" in result.output
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m.yaml"]


def test_failed_step_returns_every_block(tiny_engine_dir) -> None:
    """An engine step that raises must not leave the call's requests queued or holding blocks."""
    from trtpaged import LLM, SamplingParams

    llm = LLM(tiny_engine_dir)
    backend = llm.engine.engine
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
