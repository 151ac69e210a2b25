"""A request's failure is its own: refused before anything is allocated, or failing alone inside a step.

The faults are injected where a real one would come from: the logits a runner returns (NaN or inf
in one request's rows), a request whose values slipped past validation (its beam scoring or
sampling raises), a forward that raises. The other requests are checked against the same requests
run without the faulty one.
"""

from __future__ import annotations

import math
import re
import time
from typing import Optional

import pytest
from click.testing import CliRunner

from runtime_helpers import RandomLogitsEngine, hf_from_engine_dir, runtime_config
from trtpaged.cli import main
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.outputs import RequestOutput
from trtpaged.runtime.sampler import NON_FINITE
from trtpaged.runtime.sampling_params import SamplingParams


def poison_at_kv_length(step, kv_length: int, value: float = float("nan")):
    """Wraps a runner's `step`: the logits of every sequence whose KV length is `kv_length` after the
    step (a prompt of that length at its first sample, or a sequence that grew to it) become `value`."""

    def poisoned(batch):
        logits = step(batch).clone()
        hit = (batch.positions[batch.logits_index.long()] + 1 == kv_length).nonzero().flatten()
        logits[hit] = value
        return logits

    return poisoned


def fake_engine(num_kv_blocks: int = 64) -> LLMEngine:
    runner = RandomLogitsEngine(num_kv_blocks, vocab=64)
    return LLMEngine(runner, runtime_config(num_kv_blocks=num_kv_blocks, block_size=4), eos_token_ids=[0])


def run(engine: LLMEngine, requests) -> dict[str, RequestOutput]:
    """Runs (prompt, params) requests, or (prompt, params, {field: value}): values no check would pass, set on
    the engine's own copy of the params once the request is queued (as if a range were wrong)."""
    ids = [add(engine, *r) for r in requests]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.kv.pool.num_used == 0 and not engine.groups
    return {i: done[i] for i in ids}


def add(engine: LLMEngine, prompt, params: SamplingParams, corrupt: Optional[dict] = None) -> str:
    request_id = engine.add_request(prompt, params)
    for name, value in (corrupt or {}).items():
        setattr(engine.groups[request_id].params, name, value)
    return request_id


def tokens(out: RequestOutput) -> list[tuple[list[int], str]]:
    return [(c.token_ids, c.finish_reason) for c in out.outputs]


# Prompts of 10+ tokens never reach KV length 5; those of 5 tokens fail at their first sample, those
# of 2 tokens after three decode steps (a parallel-sampling group after it forked, beams mid-search).
OTHERS = [
    (list(range(10, 22)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)),
    (list(range(30, 40)), SamplingParams(max_tokens=6, temperature=0.8, seed=11, n=2, ignore_eos=True)),
    (list(range(40, 51)), SamplingParams(max_tokens=5, beam_width=2, ignore_eos=True)),
    (list(range(1, 14)), SamplingParams(max_tokens=6, temperature=1.0, top_k=4, seed=3, logprobs=2, ignore_eos=True)),
]
VICTIMS = [
    ([5, 6, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)),
    ([5, 6], SamplingParams(max_tokens=6, temperature=0.9, seed=2, n=3, ignore_eos=True)),
    ([7, 8], SamplingParams(max_tokens=6, beam_width=3, ignore_eos=True)),
    ([9, 8, 7, 6, 5], SamplingParams(max_tokens=6, beam_width=2, ignore_eos=True)),
]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_fail_only_their_request(value):
    truth = list(run(fake_engine(), OTHERS).values())
    engine = fake_engine()
    engine.runner.step = poison_at_kv_length(engine.runner.step, 5, value)
    mixed = list(run(engine, OTHERS[:2] + VICTIMS + OTHERS[2:]).values())
    others, victims = mixed[:2] + mixed[2 + len(VICTIMS):], mixed[2 : 2 + len(VICTIMS)]
    assert [tokens(o) for o in others] == [tokens(o) for o in truth]
    assert all(o.error is None for o in others)
    for out in victims:
        assert out.finished and out.error and "not finite" in out.error, out
        assert out.outputs and {c.finish_reason for c in out.outputs} == {"error"}, out
    assert engine.stats()["kv_blocks_used"] == 0


def test_a_raising_beam_score_fails_only_its_request():
    # length_penalty 2000 (refused by SamplingParams today) made 2 ** 2000 raise OverflowError in the step
    runaway = SamplingParams(max_tokens=2, beam_width=2, ignore_eos=True)
    truth = list(run(fake_engine(), OTHERS).values())
    engine = fake_engine()
    mixed = list(run(engine, [([3, 4, 5], runaway, {"length_penalty": 2000.0})] + OTHERS).values())
    assert mixed[0].error == "sampling failed (OverflowError); see the log"
    assert [tokens(o) for o in mixed[1:]] == [tokens(o) for o in truth]


@pytest.mark.parametrize("corrupt", [{"top_p": None}, {"logprobs": "2"}])
def test_a_raising_batched_draw_is_retried_per_group(corrupt):
    # a value no validation would pass makes the batched draw raise: each group is then sampled
    # alone, and only the one that raises alone fails. A bad top_p raises before any row draws, a bad logprobs
    # after every row drew: the seeded requests draw again from where they were (was: from after that first
    # draw, so a seeded request's tokens skipped one and depended on the broken request beside it)
    broken = SamplingParams(max_tokens=3, temperature=1.0)
    truth = list(run(fake_engine(), OTHERS).values())
    mixed = list(run(fake_engine(), [([3, 4, 5], broken, corrupt)] + OTHERS).values())
    assert mixed[0].error == "sampling failed (TypeError); see the log"
    assert [tokens(o) for o in mixed[1:]] == [tokens(o) for o in truth]


def test_a_failure_of_every_group_is_the_steps_own_and_raises():
    broken = SamplingParams(max_tokens=3, temperature=1.0)
    engine = fake_engine()
    for prompt in ([3, 4, 5], [6, 7]):
        add(engine, prompt, broken, {"top_p": None})
    with pytest.raises(TypeError):
        engine.step()


def test_a_raising_forward_is_not_blamed_on_a_request(tiny_engine_dir):
    from trtpaged import LLM

    llm = LLM(tiny_engine_dir, device="cpu")
    runner = llm.engine.runner

    def broken(batch):
        raise RuntimeError("kernel failed")

    runner.step = broken
    try:
        with pytest.raises(RuntimeError, match="kernel failed"):
            llm.generate(["a", "b"], SamplingParams(max_tokens=3))
    finally:
        del runner.step
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.engine.has_unfinished()
    assert len(llm.generate(["a"], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3


def test_llm_generate_returns_the_failed_request_finished_with_error(tiny_engine_dir):
    from trtpaged import LLM

    llm = LLM(tiny_engine_dir, device="cpu")
    others = [[20, 21, 22, 23, 24, 25, 26, 27, 28, 29], "a longer prompt than five tokens"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    truth = llm.generate(others, params)
    runner = llm.engine.runner
    runner.step = poison_at_kv_length(runner.step, 5)
    try:
        outs = llm.generate([others[0], [7, 8, 9, 10, 11], others[1]], params)
    finally:
        del runner.step
    assert outs[1].error and outs[1].outputs[0].finish_reason == "error"
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [o.outputs[0].token_ids for o in truth]
    assert all(math.isfinite(o.outputs[0].cumulative_logprob) for o in (outs[0], outs[2]))
    assert llm.stats()["kv_blocks_used"] == 0


def test_generate_cli_refuses_a_huge_n_in_one_line(tiny_engine_dir):
    result = CliRunner().invoke(main, ["generate", str(tiny_engine_dir), "--prompt", "hi", "--n", str(10**12)])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert lines == ["Error: --n: 1000000000000 sequences exceeds max_batch_size (8)"], result.output


def test_generate_cli_reports_a_request_that_failed_in_a_step(tiny_engine_dir, monkeypatch):
    from trtpaged.runtime.runners.torch_runner import TorchRunner

    real_step = TorchRunner.step
    monkeypatch.setattr(TorchRunner, "step", lambda self, batch: poison_at_kv_length(
        lambda b: real_step(self, b), 8)(batch))  # fmt: skip
    result = CliRunner().invoke(main, ["generate", str(tiny_engine_dir), "--prompt", "hi", "--max-tokens", "20"])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-1] == "Error: the request failed: " + NON_FINITE, result.output


def test_a_beam_search_the_pool_cannot_hold_to_the_end_returns_its_beams_as_a_length_limit_would():
    # 3 beams of a 6-token prompt on a pool of 5 blocks of 4 tokens: the beams outgrow it after a few tokens and
    # the search is cut there. The truth: the same search with max_tokens at the cut on a pool that holds it.
    params = SamplingParams(max_tokens=40, beam_width=3, n=3, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 9]
    cut = run(fake_engine(num_kv_blocks=5), [(prompt, params)])["req-0"]
    assert len(cut.outputs) == 3 and cut.error is None, cut  # was: no output at all
    lengths = {len(c.token_ids) for c in cut.outputs}
    assert len(lengths) == 1 and 0 < lengths.pop() < 40
    limit = len(cut.outputs[0].token_ids)
    truth = run(fake_engine(), [(prompt, SamplingParams(max_tokens=limit, beam_width=3, n=3, ignore_eos=True))])
    expected = truth["req-0"].outputs
    assert [(c.token_ids, c.finish_reason) for c in cut.outputs] == [(c.token_ids, "length") for c in expected]
    assert [c.cumulative_logprob for c in cut.outputs] == pytest.approx([c.cumulative_logprob for c in expected])


@pytest.mark.parametrize("prompt,params,field", [
    ("caf\udce9", SamplingParams(max_tokens=2), "prompt"),  # a lone surrogate (JSON "\udce9", a bad decode)
    ("hi", SamplingParams(max_tokens=2, bad_words=["\ud800x"]), "bad_words"),
    (None, SamplingParams(max_tokens=2), "prompt"),
    (7, SamplingParams(max_tokens=2), "prompt"),
    ({"text": "hi"}, SamplingParams(max_tokens=2), "prompt"),  # vLLM's {"prompt": ...} is taken; other keys are not
])
def test_prompts_the_tokenizer_cannot_take_are_refused_naming_the_field(tiny_engine_dir, prompt, params, field):
    from trtpaged import LLM
    from trtpaged.errors import RequestError

    llm = LLM(tiny_engine_dir, device="cpu", warmup=False)
    with pytest.raises(RequestError) as info:  # was: TypeError from the tokenizers library, or from indexing
        llm.generate(prompt, params)
    assert info.value.field == field
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.engine.has_unfinished()
    with pytest.raises(RequestError, match=r"messages\[0\].content: not valid Unicode"):
        llm.chat([{"role": "user", "content": "\ud800"}], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="messages: must be a list of messages"):  # was: transformers' TypeError
        llm.chat("hi", SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="chat_template_kwargs: must be a mapping, got list"):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), chat_template_kwargs=[1])


def test_token_id_arrays_are_prompts_and_wrong_params_are_named(tiny_engine_dir):
    import numpy as np

    from trtpaged import LLM

    llm = LLM(tiny_engine_dir, device="cpu", warmup=False)
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    truth = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], greedy)]
    assert [o.outputs[0].token_ids for o in llm.generate(np.array([5, 6, 7]), greedy)] == truth[:1]
    assert [o.outputs[0].token_ids for o in llm.generate([np.array([5, 6, 7]), (8, 9)], greedy)] == truth
    with pytest.raises(TypeError, match="sampling_params: a SamplingParams or a list of them, got dict"):
        llm.generate("hi", {"max_tokens": 3})


def test_a_host_pool_beyond_the_hosts_memory_is_refused_before_loading(tiny_engine_dir, monkeypatch):
    from trtpaged import LLM
    from trtpaged.kv_budget import KVBudgetError
    from trtpaged.runtime.runners import torch_runner

    loaded = []
    monkeypatch.setattr(torch_runner.TorchRunner, "from_engine_dir", lambda *a, **k: loaded.append(a))
    with pytest.raises(KVBudgetError, match=r"num_host_blocks: 2147483647 blocks of \d+ bytes need") as info:
        LLM(tiny_engine_dir, device="cpu", preemption_mode="swap", num_host_blocks=2**31 - 1)  # was: torch alloc error
    assert info.value.field == "num_host_blocks" and not loaded
    with pytest.raises(ValueError, match="num_host_blocks: must be an integer >= 0, got 2.5"):
        LLM(tiny_engine_dir, device="cpu", preemption_mode="swap", num_host_blocks=2.5)
    with pytest.raises(KVBudgetError, match=r"kv_tiers.host_memory: 9.31e\+08 GiB exceeds what the host has") as info:
        LLM(tiny_engine_dir, device="cpu", kv_tiers={"host_memory": "1000000TB"})  # was: accepted, grew until OOM
    assert info.value.field == "kv_tiers.host_memory" and not loaded


@pytest.mark.parametrize("option,value", [("max_batch_size", 4.0), ("max_num_tokens", 100.0), ("max_seq_len", True),
                                          ("num_kv_blocks", "64")])
def test_llm_limits_that_are_not_integers_are_refused_before_loading(tiny_engine_dir, option, value):
    from trtpaged import LLM

    # was: a TypeError from the warm-up's range() (floats), max_seq_len True taken as 1, "must be >= 1, got 64"
    with pytest.raises(ValueError, match=f"{option}: must be an integer"):
        LLM(tiny_engine_dir, device="cpu", **{option: value})


def test_logprobs_beyond_max_logprobs_are_refused_naming_the_field(tiny_engine_dir):
    """At most max_logprobs (vLLM's default 20) top log-probs per token; a larger limit gives that many, each the
    log-softmax of the model's logits; -1 allows the whole vocabulary. Refused before anything is allocated."""
    import torch

    from trtpaged import LLM
    from trtpaged.errors import RequestError

    llm = LLM(tiny_engine_dir, device="cpu", warmup=False)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(RequestError, match=f"{name}: 21 exceeds max_logprobs \\(20\\)") as info:
            llm.generate([5, 6, 7], SamplingParams(max_tokens=2, **{name: 21}))
        assert info.value.field == name and info.value.limit == 20
        assert llm.stats()["kv_blocks_used"] == 0 and not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="max_logprobs: must be >= 0, or -1"):
        LLM(tiny_engine_dir, device="cpu", warmup=False, max_logprobs=2.5)
    vocab = llm.manifest.dims.vocab_size
    wide = LLM(tiny_engine_dir, device="cpu", warmup=False, max_logprobs=-1)
    (out,) = wide.generate([5, 6, 7], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=vocab))
    hf = hf_from_engine_dir(tiny_engine_dir)
    with torch.no_grad():
        truth = torch.log_softmax(hf.model(torch.tensor([[5, 6, 7]])).logits[0, 0].double(), dim=-1)
    entry = out.prompt_logprobs[1]  # the log-probs over the whole vocabulary at the second prompt position
    assert len(entry) == vocab
    assert max(abs(entry[t] - truth[t].item()) for t in range(vocab)) < 1e-4


def test_a_stream_cut_by_an_engine_failure_is_logged_with_what_it_sent(tiny_engine_dir, caplog):
    """The server log's line (which `diagnose` counts) of a stream that an engine failure ended carries the
    prompt and the tokens already streamed (was: prompt=0 completion=0)."""
    import logging

    from test_server import stream
    from trtpaged.server import start_server

    handle = start_server(tiny_engine_dir, port=0, device="cpu")
    runner = handle.llm.engine.runner
    real, calls = runner.step, []

    def fails_on_the_fourth_step(batch):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("kernel failed")
        return real(batch)

    runner.step = fails_on_the_fourth_step
    try:
        with caplog.at_level(logging.INFO, logger="trtpaged.server"):
            events = stream(handle, "/v1/completions", {"prompt": "hello there", "max_tokens": 8, "ignore_eos": True})
            for _ in range(50):  # the line is written once the response has ended
                if any("finish=EngineFailure" in r.getMessage() for r in caplog.records):
                    break
                time.sleep(0.1)
    finally:
        handle.shutdown(timeout=0)
    sent = [e for e in events if e != "[DONE]" and "choices" in e and e["choices"][0]["text"]]
    assert sent and "error" in events[-2], events  # tokens streamed, then the failure's error event
    line = next(r.getMessage() for r in caplog.records if "finish=EngineFailure" in r.getMessage())
    prompt, completion = (int(re.search(rf"{k}=(\d+)", line).group(1)) for k in ("prompt", "completion"))
    assert prompt == len(handle.llm.tokenizer.encode("hello there")) and completion >= len(sent) >= 1, line
