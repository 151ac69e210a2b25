"""logit_bias, allowed_token_ids and bad_words: checked in the sampler against softmax(logits + bias) (and the
renormalised allowed distribution), then end to end on the tiny engine (greedy outputs against HF's)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime_helpers import hf_greedy, run_staggered, runtime_config, step_engine, tiny_hf
from trtpaged.errors import RequestError
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.sampler import SampleRow, greedy_kernel, sample
from trtpaged.runtime.sampling_params import SamplingParams

EOS = 257
DRAWS = 4000


def draw_frequencies(logits: torch.Tensor, params: SamplingParams, rows: int = DRAWS) -> torch.Tensor:
    """Empirical distribution of `rows` independent draws from one logits row."""
    batch = logits.expand(rows, -1).contiguous()
    tokens = [s.token_id for s in sample(batch, [SampleRow(i, params, [0], 1) for i in range(rows)])]
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[1]).float() / rows


def test_logit_bias_shifts_the_distribution_as_softmax_of_biased_logits():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    bias = {3: 2.5, 0: -1.5}
    got = draw_frequencies(logits, SamplingParams(temperature=1.0, logit_bias=bias))
    biased = logits[0].clone()
    for t, b in bias.items():
        biased[t] += b
    expected = torch.softmax(biased, dim=0)
    assert (got - expected).abs().max() < 0.03, (got, expected)
    assert (got - torch.softmax(logits[0], 0)).abs().max() > 0.2  # it did change the distribution


def test_logit_bias_minus_100_bans_and_plus_100_forces_a_token():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    best = int(logits.argmax())
    banned = draw_frequencies(logits, SamplingParams(temperature=1.0, logit_bias={best: -100}), 2000)
    assert banned[best] == 0
    forced = sample(logits, [SampleRow(0, SamplingParams(temperature=0.0, logit_bias={7: 100}), [0], 1)])
    assert forced[0].token_id == 7
    # the reported log-prob is the model's (raw logits), as OpenAI reports it
    assert forced[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], 0)[7]), abs=1e-5)


def test_allowed_token_ids_renormalise_over_the_allowed_set():
    logits = torch.tensor([[3.0, 0.0, 1.0, 2.0, 0.5]])
    allowed = (1, 2, 4)
    got = draw_frequencies(logits, SamplingParams(temperature=1.0, allowed_token_ids=allowed))
    expected = torch.zeros(5)
    expected[list(allowed)] = torch.softmax(logits[0, list(allowed)], 0)
    assert (got - expected).abs().max() < 0.03 and got[[0, 3]].sum() == 0


def test_bad_words_mask_only_where_the_output_ends_with_the_rest_of_the_word():
    logits = torch.zeros(1, 10)
    logits[0, 5] = 10.0  # greedy picks 5 unless it is masked
    params = SamplingParams(temperature=0.0, bad_words=("x",))
    word = ((3, 5),)  # the bad word as token ids: 3 then 5
    after_3 = sample(logits, [SampleRow(0, params, [9, 3], 1, bad_words=word)])
    after_4 = sample(logits, [SampleRow(0, params, [9, 4], 1, bad_words=word)])
    single = sample(logits, [SampleRow(0, params, [9], 1, bad_words=((5,),))])
    in_prompt = sample(logits, [SampleRow(0, params, [3], 1, bad_words=word)])  # the prompt does not count
    assert after_3[0].token_id != 5 and single[0].token_id != 5
    assert after_4[0].token_id == 5 and in_prompt[0].token_id == 5


def test_filtered_rows_leave_plain_greedy_rows_on_their_path_unchanged():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
    plain = SamplingParams(temperature=0.0)
    kernel = greedy_kernel()  # with the kernel library's one-pass path where it is built
    alone = sample(logits, [SampleRow(i, plain, [0], 1) for i in (0, 2)], kernel)
    mixed = sample(logits, [SampleRow(0, plain, [0], 1), SampleRow(1, SamplingParams(temperature=0.0,
                   allowed_token_ids=(4,)), [0], 1), SampleRow(2, plain, [0], 1)], kernel)  # fmt: skip
    assert [s.token_id for s in alone] == [mixed[0].token_id, mixed[2].token_id] and mixed[1].token_id == 4


@pytest.mark.parametrize("kwargs, field", [
    ({"logit_bias": {1: 101}}, "logit_bias"), ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"), ({"logit_bias": {"1": 1}}, "logit_bias"),
    ({"logit_bias": {i: 1 for i in range(1025)}}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["x"] * 65}, "bad_words"), ({"beam_width": 2, "logit_bias": {1: 1}}, "logit_bias"),
])  # fmt: skip
def test_filter_params_are_checked(kwargs, field):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


@pytest.fixture(scope="module")
def hf():
    return tiny_hf()


def make(hf) -> LLMEngine:
    config = runtime_config()
    return LLMEngine(step_engine(hf, config), config, hf.tokenizer, [EOS], vocab_size=320)


def test_engine_checks_ids_against_the_vocabulary(hf):
    engine = make(hf)
    for kwargs, field in (({"logit_bias": {320: 1}}, "logit_bias"),
                          ({"allowed_token_ids": [5, 999]}, "allowed_token_ids")):
        with pytest.raises(RequestError) as info:
            engine.add_request([1, 2, 3], SamplingParams(**kwargs))
        assert info.value.field == field
    assert not engine.has_unfinished()


def test_filters_end_to_end_and_unfiltered_requests_unchanged(hf):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 23, 40)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    reference = [hf_greedy(hf, p, 10, None) for p in prompts]
    engine = make(hf)
    filtered = [
        SamplingParams(max_tokens=10, temperature=1.0, seed=0, allowed_token_ids=tuple(range(65, 91)), ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, logit_bias={77: 100}, ignore_eos=True),
    ]
    requests = [(prompts[0], greedy), (prompts[1], filtered[0]), (prompts[1], greedy), (prompts[2], filtered[1]),
                (prompts[2], greedy)]  # fmt: skip
    outs = run_staggered(engine, requests)
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 4)] == reference
    assert all(65 <= t < 91 for t in outs[1].outputs[0].token_ids)
    assert outs[3].outputs[0].token_ids == [77] * 10
    letters = tuple(hf.tokenizer.encode("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False))
    spelled_in = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, allowed_token_ids=letters)
    base = run_staggered(engine, [(prompts[0], spelled_in)])[0].outputs[0].token_ids
    word = hf.tokenizer.decode(base[2:4])  # two letters the request generates
    banned = dataclasses.replace(spelled_in, bad_words=(word,))
    tokens = run_staggered(engine, [(prompts[0], banned)])[0].outputs[0].token_ids
    assert tokens[:2] == base[:2] and tokens != base  # the same until the word could complete
    assert all(tokens[i : i + 2] != base[2:4] for i in range(len(tokens) - 1))
    assert engine.kv.pool.num_free == engine.config.num_kv_blocks
