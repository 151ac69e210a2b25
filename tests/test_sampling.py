"""SamplingParams validation, logits processing, seeded draws, logprobs, detokenisation, stop strings, beam scoring."""

from __future__ import annotations

import math

import pytest
import torch

from trtpaged.runtime.beam_search import BeamSearch
from trtpaged.runtime.detokenizer import IncrementalDetokenizer
from trtpaged.runtime.output_processor import find_stop_string
from trtpaged.runtime.sampler import Sampler, apply_penalties, filter_logits, make_generator
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.runtime.sequence import Sequence


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"beam_width": 2, "n": 3}, "n"),
        ({"beam_width": 2, "stop": ["x"]}, "stop"),
    ],
)
def test_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="END").stop == ("END",)


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda **kw: torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, **kw))).tolist()
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.8) == [True, True, False, False]
    assert kept(top_p=0.81) == [True, True, True, False]
    assert kept(top_p=0.1) == [True, False, False, False]
    assert kept(min_p=0.5) == [True, True, False, False]


def test_penalties():
    seq = Sequence(0, [1, 2])
    seq.append_token(3)
    seq.append_token(3)
    logits = torch.tensor([1.0, 2.0, -2.0, 4.0, 0.5])
    out = apply_penalties(logits.clone(), seq, SamplingParams(repetition_penalty=2.0))
    assert out.tolist() == [1.0, 1.0, -4.0, 2.0, 0.5]
    out = apply_penalties(logits.clone(), seq, SamplingParams(presence_penalty=1.0, frequency_penalty=0.5))
    assert out.tolist() == [1.0, 2.0, -2.0, 2.0, 0.5]  # only output token 3: 4 - 1 - 2*0.5


def test_greedy_and_logprobs():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    result = Sampler().sample(logits, Sequence(0, [0]), SamplingParams(temperature=0.0, logprobs=2))
    expected = torch.log_softmax(logits, -1)
    assert result.token_id == 1
    assert result.logprob == pytest.approx(float(expected[1]))
    assert set(result.top_logprobs) == {1, 3}


def test_seeded_sampling_is_reproducible_and_per_index():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=42)

    def draw(index):
        seq = Sequence(0, [0])
        seq.generator = make_generator(42, index)
        return [Sampler().sample(logits, seq, params).token_id for _ in range(20)]

    assert draw(0) == draw(0)
    assert draw(0) != draw(1)
    assert make_generator(None, 0) is None


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    seq = Sequence(0, [0])
    seq.generator = make_generator(1, 0)
    draws = [Sampler().sample(probs.log(), seq, SamplingParams(temperature=1.0)).token_id for _ in range(2000)]
    assert abs(draws.count(0) / 2000 - 0.7) < 0.05


def test_detokenizer_never_splits_multibyte_characters():
    from trtpaged.models.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()  # one token per byte: every non-ASCII character spans several tokens
    text = "héllo 世界 🙂 ok"
    ids = tok.encode(text)
    assert len(ids) > len(text)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt: "))
    pieces = [detok.add(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text
    assert pieces[ids.index(tok.encode("🙂")[0])] == ""  # held back until the character is complete


def test_detokenizer_flushes_an_incomplete_tail():
    from trtpaged.models.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(tok.encode("a")[0]) == "a"
    assert detok.add(tok.encode("世")[0]) == ""
    assert detok.flush() == "\ufffd"


def test_find_stop_string():
    assert find_stop_string("hello wor", ["world"], 3) is None
    assert find_stop_string("hello world", ["world", "lo"], 2) == (6, "world")
    assert find_stop_string("hello world", ["world", "o w"], 7) == (4, "o w")
    assert find_stop_string("abcSTOP", ["STOP"], 1) == (3, "STOP")
    assert find_stop_string("STOPabc", ["STOP"], 1) is None  # found earlier already


def test_beam_search_scores_and_length_penalty():
    params = SamplingParams(beam_width=2, temperature=0.0, length_penalty=1.0, max_tokens=5)
    beam = BeamSearch(params, eos_token_ids=[0], max_new_tokens=5)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))  # EOS is the best first token
    keep = beam.step([[]], [0.0], logits)
    assert [(c.parent, c.token_id) for c in keep] == [(0, 1), (0, 2)]
    assert len(beam.finished) == 1 and beam.finished[0].token_ids == (0,)
    assert beam.finished[0].score == pytest.approx(math.log(0.5))
    logits = torch.log(torch.tensor([[0.9, 0.05, 0.05], [0.9, 0.05, 0.05]]))
    keep = beam.step([[1], [2]], [math.log(0.3), math.log(0.2)], logits)
    # (1, EOS) scores log(0.27)/2 > log(0.5)/1, so the pool of 2 is full and no running beam can beat it
    assert [h.token_ids for h in beam.finished] == [(1, 0), (0,)]
    assert beam.done and keep == []


def test_beam_search_stops_at_max_tokens():
    params = SamplingParams(beam_width=2, temperature=0.0, max_tokens=1)
    beam = BeamSearch(params, eos_token_ids=[0], max_new_tokens=1)
    beam.step([[]], [0.0], torch.log(torch.tensor([[0.1, 0.6, 0.3]])))
    assert beam.done and [h.token_ids for h in beam.best(2)] == [(1,), (2,)]
