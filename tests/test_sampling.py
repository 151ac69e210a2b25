"""SamplingParams validation, logits processing, seeded draws, logprobs, detokenisation, stop strings, beam scoring."""

from __future__ import annotations

import math

import pytest
import torch

from trtpaged.errors import RequestError
from trtpaged.runtime.beam_search import BeamSearch
from trtpaged.runtime.detokenizer import IncrementalDetokenizer
from trtpaged.runtime.output_processor import find_stop_string
from trtpaged.runtime.sampler import SampleRow, apply_penalties, filter_logits, greedy_kernel, sample
from trtpaged.runtime.sequence import make_generator
from trtpaged.runtime.sampling_params import SamplingParams


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
        ({"beam_width": 2, "top_k": 5}, "top_k"),  # beams follow the log-probs: a sampling filter is not applied
        ({"beam_width": 2, "top_p": 0.9}, "top_p"),
        ({"beam_width": 2, "min_p": 0.1}, "min_p"),
        ({"beam_width": 2, "logprobs": 1}, "logprobs"),
    ],
)
def test_params_errors_name_the_field(kwargs, field):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="END").stop == ("END",)


def reference_penalties(logits: torch.Tensor, token_ids: list[int], num_prompt: int, p: SamplingParams) -> torch.Tensor:
    """The per-row semantics: HF repetition penalty over prompt + output, OpenAI presence/frequency over output."""
    logits = logits.clone()
    if p.repetition_penalty != 1.0 and token_ids:
        seen = torch.tensor(token_ids).unique()
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    output = token_ids[num_prompt:]
    if (p.presence_penalty or p.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor(output), minlength=logits.shape[0]).float()
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The per-row semantics, in vLLM's order: temperature, then min-p, then top-k, top-p (the top token always
    kept)."""
    logits = logits / p.temperature
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < logits.shape[0]:
        logits = logits.masked_fill(logits < torch.topk(logits, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= p.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)


def row(i: int, params: SamplingParams, tokens=(0,), num_prompt: int = 1, seed=None, index: int = 0) -> SampleRow:
    return SampleRow(i, params, list(tokens), num_prompt, make_generator(seed, index))


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda **kw: torch.isfinite(filter_logits(logits, [SamplingParams(temperature=1.0, **kw)]))[0].tolist()
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.8) == [True, True, False, False]
    assert kept(top_p=0.81) == [True, True, True, False]
    assert kept(top_p=0.1) == [True, False, False, False]
    assert kept(min_p=0.5) == [True, True, False, False]
    # vLLM's order: min-p first (0.5 and 0.3 kept, renormalised to 0.625 and 0.375), then top-p over what is left;
    # with min-p last (transformers' order) top-p's 0.6 of the whole distribution would keep 0.5 and 0.3 both
    assert kept(min_p=0.5, top_p=0.6) == [True, False, False, False]
    assert kept(min_p=0.5, top_p=0.7) == [True, True, False, False]


def test_a_top_p_1_row_beside_a_top_p_row_keeps_its_whole_support():
    # one dominant logit and a tail of tiny ones: float32's running sum of the sorted probabilities reaches 1.0
    # well before the tail ends, so a cut at ">= 1.0" would drop tail tokens a row with top_p 1 must keep
    logits = torch.full((2, 64), -20.0)
    logits[:, 0] = 0.0
    probs = torch.softmax(logits[0], dim=0)
    assert bool((probs.sort(descending=True).values.cumsum(0)[:-1] >= 1.0).any())  # the case is the hard one
    from transformers.generation.logits_process import TopPLogitsWarper

    params = [SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)]
    batched = torch.softmax(filter_logits(logits.clone(), params), dim=1)
    for i, p in enumerate(params):
        hf = torch.softmax(TopPLogitsWarper(p.top_p)(None, logits[i : i + 1].clone()), dim=1)[0]
        assert (batched[i] > 0).tolist() == (hf > 0).tolist()
        assert torch.allclose(batched[i], hf)
    assert (batched[0] > 0).tolist() == (probs > 0).tolist()  # every token with nonzero probability
    alone = torch.softmax(filter_logits(logits[:1].clone(), params[:1]), dim=1)[0]
    assert torch.equal(batched[0], alone)


def test_penalties():
    logits = torch.tensor([[1.0, 2.0, -2.0, 4.0, 0.5]] * 2)
    rows = [row(0, SamplingParams(repetition_penalty=2.0), [1, 2, 3, 3], 2),
            row(1, SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), [1, 2, 3, 3], 2)]
    out = apply_penalties(logits.clone(), rows)
    assert out[0].tolist() == [1.0, 1.0, -4.0, 2.0, 0.5]
    assert out[1].tolist() == [1.0, 2.0, -2.0, 2.0, 0.5]  # only output token 3: 4 - 1 - 2*0.5


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.2, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=1.0),
    SamplingParams(temperature=1.0),
]


def test_batched_filtering_equals_the_per_row_reference():
    torch.manual_seed(0)
    vocab = 97
    logits = torch.randn(len(MIXED), vocab) * 3
    histories = [torch.randint(0, vocab, (n,)).tolist() for n in (3, 54, 7, 20, 33, 12, 1)]
    rows = [row(i, p, h, max(1, len(h) // 2)) for i, (p, h) in enumerate(zip(MIXED, histories))]
    penalised = apply_penalties(logits.clone(), rows)
    random = [i for i, p in enumerate(MIXED) if not p.greedy]
    batched = torch.softmax(filter_logits(penalised[random], [MIXED[i] for i in random]), dim=1)
    for j, i in enumerate(random):
        expected_logits = reference_penalties(logits[i], histories[i], rows[i].num_prompt_tokens, MIXED[i])
        assert torch.allclose(penalised[i], expected_logits, atol=1e-6)
        assert torch.allclose(batched[j], reference_probs(expected_logits, MIXED[i]), atol=1e-6)
    greedy = [s.token_id for s in sample(logits, rows)]
    for i, p in enumerate(MIXED):
        if p.greedy:
            expected = reference_penalties(logits[i], histories[i], rows[i].num_prompt_tokens, p)
            assert greedy[i] == int(torch.argmax(expected))


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 1.0, 0.0]])
    (first, second) = sample(logits, [row(0, SamplingParams(temperature=0.0, logprobs=2)),
                                      row(1, SamplingParams(temperature=0.0))])
    expected = torch.log_softmax(logits[0], -1)
    assert first.token_id == 1 and second.token_id == 0
    assert first.logprob == pytest.approx(float(expected[1]))
    assert first.top_logprobs == pytest.approx({1: float(expected[1]), 3: float(expected[3])})
    assert second.top_logprobs is None


def test_plain_greedy_batch_takes_the_one_pass_path_with_the_same_result():
    # all rows greedy without penalties or top log-probs: the kernel library's greedy_rows (when
    # built) must pick torch.argmax's token and log_softmax's log-prob, rows in any order
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(3)) * 3
    logits[1, 10] = logits[1, 20] = logits[1].max() + 1  # a tie: the first index
    order = [3, 1, 4, 1]
    samples = sample(logits, [row(i, SamplingParams(temperature=0.0)) for i in order], greedy_kernel())
    reference = torch.log_softmax(logits.double(), dim=1)
    for s, i in zip(samples, order):
        assert s.token_id == int(logits[i].argmax())
        assert s.logprob == pytest.approx(float(reference[i, s.token_id]), abs=1e-5)
        assert s.top_logprobs is None


def test_seeded_draws_do_not_depend_on_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, 100)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=42)

    def draws(batch: list[SampleRow]) -> list[int]:
        return [s.token_id for s in sample(logits, batch)]

    others = [row(i, p) for i, p in zip((0, 1, 3, 4), MIXED[1:5])]  # unseeded rows around it
    seeded = row(2, params, seed=42)
    alone = [draws([seeded])[0] for _ in range(20)]
    seeded, sibling = row(2, params, seed=42), row(5, params, seed=42, index=1)
    mixed = [draws(others[:2] + [seeded] + others[2:] + [sibling])[2] for _ in range(20)]
    assert alone == mixed
    assert len(set(alone)) > 1  # it does sample
    assert make_generator(None, 0) is None


def test_sampling_follows_the_distribution():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    rows = [row(0, SamplingParams(temperature=1.0), seed=1), row(1, SamplingParams(temperature=1.0))]
    draws = [[s.token_id for s in sample(probs.log(), rows)] for _ in range(2000)]
    assert abs(sum(d[0] == 0 for d in draws) / 2000 - 0.7) < 0.05
    assert abs(sum(d[1] == 2 for d in draws) / 2000 - 0.8) < 0.05


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


@pytest.mark.parametrize("clean_up", [False, True])  # tokenizers' DecodeStream, and the Python decodes
def test_a_character_the_prompt_ends_inside_of_is_the_outputs_text(clean_up):
    """A prompt cut inside a multi-byte character (token-id prompts, right truncation): the output token that
    completes it emits the character, whole, and nothing of the prompt before it (vLLM's rule; was: the window's
    prompt text came out again in front of it, or the character was dropped)."""
    from trtpaged.models.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    tok.clean_up_tokenization_spaces = clean_up
    for text, cut in (("ab 🙂 ok", 4), ("ab 🙂 ok", 5), ("xé!", 2), ("🙂🙂", 6)):
        ids = tok.encode(text)
        prompt, output = ids[:cut], ids[cut:]
        detok = IncrementalDetokenizer(tok, prompt)
        pieces = [detok.add(t) for t in output]
        completed = tok.decode(ids)[len(tok.decode(prompt).rstrip("\ufffd")) :]
        assert "".join(pieces) + detok.flush() == completed, (text, cut, pieces)


@pytest.mark.parametrize("clean_up", [False, True])
def test_a_character_the_prompt_ends_inside_of_and_the_output_does_not_complete_stays_the_prompts(clean_up):
    """A prompt cut inside a character whose next bytes never come (the output starts a new character): the
    output's text is its own tokens' decode (HF's decode of the output ids; vLLM's slow detokenizer's, not its
    fast one's, which keeps the U+FFFD), without the U+FFFD of
    the prompt's dangling bytes in front (was: "\ufffd-19" for "-19"); streamed or flushed at the end."""
    from trtpaged.models.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    tok.clean_up_tokenization_spaces = clean_up
    for prompt_text, cut, output_text in (("xé", 2, "-19"), ("🙂", 2, "ok 🙂"), ("a世", 3, "b"), ("é", 1, "\u00e9")):
        prompt = tok.encode(prompt_text)[:cut]
        output = tok.encode(output_text)
        detok = IncrementalDetokenizer(tok, prompt)
        pieces = [detok.add(t) for t in output]
        assert "".join(pieces) + detok.flush() == tok.decode(output), (prompt_text, cut, pieces)


@pytest.mark.parametrize("clean_up", [False, True])
def test_a_dangling_prompt_byte_before_a_sentencepiece_word_start(clean_up):
    """The same with a SentencePiece-style tokenizer (byte fallback, "▁" for a space, the decoder strips a
    leading one): the output's first token starts a word, so its text in context begins with a space that its
    decode alone drops; the answer is the text in context after the prompt's (HF's decode of prompt + output,
    less the prompt's), space kept and U+FFFD left out."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "▁a", "a", "▁-", "-", "1", "9"):
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=clean_up)
    prompt = [vocab["▁a"], vocab["<0xE4>"]]  # "a", then the first byte of a three-byte character
    for output in ([vocab["▁-"], vocab["1"], vocab["9"]], [vocab["-"], vocab["1"]]):
        detok = IncrementalDetokenizer(tok, prompt)
        text = "".join(detok.add(t) for t in output) + detok.flush()
        assert text == tok.decode(prompt + output)[len(tok.decode(prompt)) :] and "\ufffd" not in text, text


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
    decision = beam.step([[]], [0.0], logits)
    assert beam.finished == [] and not beam.done  # step decides, the scheduler applies
    beam.apply(decision)
    keep = decision.running
    assert [(c.parent, c.token_id) for c in keep] == [(0, 1), (0, 2)]
    assert len(beam.finished) == 1 and beam.finished[0].token_ids == (0,)
    assert beam.finished[0].score == pytest.approx(math.log(0.5))
    logits = torch.log(torch.tensor([[0.9, 0.05, 0.05], [0.9, 0.05, 0.05]]))
    decision = beam.step([[1], [2]], [math.log(0.3), math.log(0.2)], logits)
    beam.apply(decision)
    keep = decision.running
    # (1, EOS) scores log(0.27)/2 > log(0.5)/1, so the pool of 2 is full and no running beam can beat it
    assert [h.token_ids for h in beam.finished] == [(1, 0), (0,)]
    assert beam.done and keep == ()


def test_beam_penalties_act_on_the_beams_log_probs():
    """HF's order: the penalties change each beam's log-probs (not its logits), repetition over the prompt and the
    beam's own tokens, presence and frequency over the beam's tokens; each candidate's score is its beam's score
    plus the penalised log-prob, computed here by hand."""
    params = SamplingParams(beam_width=2, n=2, max_tokens=4, repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.25)  # fmt: skip
    logits = torch.tensor([[1.0, 2.0, 0.5, 0.0, -1.0], [0.0, 1.5, 2.5, -0.5, 1.0]])
    outputs, cumulative, prompt = [[1, 1], [2]], [-1.0, -1.5], [3]
    lp = torch.log_softmax(logits, dim=-1).tolist()
    expected = {}
    for b, (out, row) in enumerate(zip(outputs, lp)):
        for t, value in enumerate(row):
            if t in prompt or t in out:
                value *= 2.0  # a log-prob is negative: the penalty makes it more so
            count = out.count(t)
            value -= 0.25 * count + (0.5 if count else 0.0)
            expected[(b, t)] = cumulative[b] + value
    decision = BeamSearch(params, eos_token_ids=[4], max_new_tokens=4).step(outputs, cumulative, logits, prompt)
    best = sorted(expected.items(), key=lambda kv: -kv[1])
    running = [(b, t) for (b, t), _ in best if t != 4][:2]
    assert [(c.parent, c.token_id) for c in decision.running] == running
    for c in decision.running:
        assert c.cumulative_logprob == pytest.approx(expected[(c.parent, c.token_id)], abs=1e-6)


def test_beam_search_stops_at_max_tokens():
    params = SamplingParams(beam_width=2, temperature=0.0, max_tokens=1)
    beam = BeamSearch(params, eos_token_ids=[0], max_new_tokens=1)
    beam.apply(beam.step([[]], [0.0], torch.log(torch.tensor([[0.1, 0.6, 0.3]]))))
    assert beam.done and [h.token_ids for h in beam.best(2)] == [(1,), (2,)]


def test_sampling_params_accept_vllm_spellings_and_reject_bad_types():
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2  # vLLM's "no seed"
    for bad, field in ((dict(stop=[""]), "stop"), (dict(stop=[1]), "stop"), (dict(stop=5), "stop"), (dict(n=2.0), "n"),
                       (dict(max_tokens=2.5), "max_tokens"), (dict(temperature="0.5"), "temperature"),
                       (dict(top_p=float("nan")), "top_p"), (dict(stop_token_ids=["a"]), "stop_token_ids")):
        with pytest.raises(RequestError) as info:
            SamplingParams(**bad)
        assert info.value.field == field


def test_tiny_temperature_samples_greedily_instead_of_crashing():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    tiny = [row(i, SamplingParams(temperature=1e-45, seed=0)) for i in range(3)]
    assert [s.token_id for s in sample(logits, tiny)] == logits.argmax(dim=1).tolist()


@pytest.mark.parametrize(
    "field, inside, outside, limit",
    [
        ("repetition_penalty", (0.01, 100.0), (1e-300, 0.0099, 100.5, 1e308), "[0.01, 100]"),
        ("length_penalty", (-10.0, 10.0), (-1e308, -10.5, 2000.0, 1e308), "[-10, 10]"),
        ("presence_penalty", (-2.0, 2.0), (-2.01, 2.01), "[-2, 2]"),
        ("temperature", (0.0, 1e-6, 3.4e38), (-1e-300, 3.5e38, 1e308), "[0, 3.4e38]"),
        ("top_p", (1e-300, 1.0), (0.0, 1.0001), "(0, 1]"),
    ],
)
def test_numeric_ranges_are_inclusive_and_name_the_limit(field, inside, outside, limit):
    for value in inside:
        SamplingParams(**{field: value})
    for value in outside:
        with pytest.raises(RequestError) as info:
            SamplingParams(**{field: value})
        assert info.value.field == field and (limit is None or info.value.limit == limit), (value, info.value)


def test_stop_lists_are_capped_in_count_and_length():
    from trtpaged.runtime.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

    assert len(SamplingParams(stop=["s"] * MAX_STOP_STRINGS, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS).stop) == 32
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS])
    for kwargs, field, limit in ((dict(stop=["s"] * 80_000), "stop", MAX_STOP_STRINGS),
                                 (dict(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]), "stop", MAX_STOP_STRING_CHARS),
                                 (dict(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids",
                                  MAX_STOP_TOKEN_IDS)):  # fmt: skip
        with pytest.raises(RequestError) as info:
            SamplingParams(**kwargs)
        assert (info.value.field, info.value.limit) == (field, limit)
        assert len(str(info.value)) < 200  # one line, not the list echoed back
    with pytest.raises(RequestError, match="stop: not valid Unicode"):  # was: taken, and it could never match
        SamplingParams(stop=["ok", "\ud800"])


def test_extreme_values_within_range_sample_finite_tokens():
    # every option at its bound, with logits as large as a float32 model plausibly emits:
    # the arithmetic stays finite, so every row gets a token (none is refused as non-finite)
    logits = torch.randn(8, 97, generator=torch.Generator().manual_seed(4)) * 1e4
    history = list(range(0, 97, 3))
    edges = [SamplingParams(temperature=t, repetition_penalty=rp, presence_penalty=pp, frequency_penalty=-pp,
                            top_p=1e-300 if t else 1.0, min_p=1.0 if rp > 1 else 0.0)
             for t in (1e-5, 3.4e38) for rp in (0.01, 100.0) for pp in (-2.0, 2.0)]  # fmt: skip
    samples = sample(logits, [row(i, p, history, 5) for i, p in enumerate(edges)])
    assert all(s is not None and math.isfinite(s.logprob) for s in samples), samples
    # at the largest temperature the filters still act: top_k 1 is the argmax (was, at 1e39: a uniform draw)
    capped = sample(logits, [row(i, SamplingParams(temperature=3.4e38, top_k=1, seed=i)) for i in range(8)])
    assert [s.token_id for s in capped] == logits.argmax(dim=1).tolist()


def test_min_p_keeps_its_support_at_any_temperature():
    """min_p keeps the tokens with p >= min_p * p_max; at temperature T a token's p / p_max is its ratio at 1 raised
    to 1/T, so transformers' MinPLogitsWarper with min_p ** T over the unscaled logits (float64) is the reference.
    At a large temperature every float32 probability rounds to one value: min_p 1 at T >= 1e6 kept the whole
    vocabulary (a uniform draw where the argmax is the one token it allows)."""
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = torch.randn(97, generator=torch.Generator().manual_seed(6)) * 3
    temperatures = (0.5, 1.0, 1e3, 1e6, 1e20, 3.4e38)
    params = [SamplingParams(temperature=t, min_p=m) for t in temperatures for m in (0.1, 0.9, 1.0)]
    kept = torch.isfinite(filter_logits(logits.repeat(len(params), 1), params))
    for got, p in zip(kept, params):
        reference = MinPLogitsWarper(p.min_p**p.temperature)(None, logits.double().unsqueeze(0))[0]
        assert got.tolist() == torch.isfinite(reference).tolist(), p
    hottest = SamplingParams(temperature=3.4e38, min_p=1.0)
    drawn = sample(logits.repeat(8, 1), [row(i, hottest, seed=i) for i in range(8)])
    assert {s.token_id for s in drawn} == {int(logits.argmax())}


def test_beam_scores_stay_finite_at_the_length_penalty_bounds():
    for length_penalty in (-10.0, 10.0):
        beam = BeamSearch(SamplingParams(beam_width=2, length_penalty=length_penalty), [0], 2**31)
        for length in (1, 2, 2**31):
            assert math.isfinite(beam._penalised(-1e6, length)), (length_penalty, length)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), "all -inf"])
def test_a_non_finite_row_gets_no_token_and_the_others_are_unchanged(poison):
    logits = torch.randn(5, 60, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=7),
              SamplingParams(temperature=1.0, top_k=5, seed=8), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.7, seed=9)]  # fmt: skip
    rows = lambda: [row(i, p, (1, 2), 1, seed=p.seed) for i, p in enumerate(params)]  # fresh generators
    clean = sample(logits, rows())
    bad = logits.clone()
    if poison == "all -inf":
        bad[2] = float("-inf")
    else:
        bad[2, 17] = poison
    for only_greedy in (False, True):  # the one-pass greedy path and the general one
        pick = [0, 2, 3] if only_greedy else range(5)
        subset = [r for i, r in enumerate(rows()) if i in pick]
        if only_greedy:
            subset = [row(r.logits_row, SamplingParams(temperature=0.0)) for r in subset]
            clean_subset = sample(logits, subset, greedy_kernel())
        got = sample(bad, subset, only_greedy and greedy_kernel())
        for r, s, c in zip(subset, got, clean_subset if only_greedy else clean):
            assert (s is None) == (r.logits_row == 2), (poison, only_greedy, r.logits_row, s)
            if s is not None:
                assert (s.token_id, s.logprob, s.top_logprobs) == (c.token_id, c.logprob, c.top_logprobs)


def test_penalties_that_overflow_a_row_fail_that_row_only():
    # values past SamplingParams' checks (as if a range were wrong): the row's penalised logits go
    # inf, and that row alone gets no token
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(6)) * 10
    runaway = SamplingParams(temperature=1.0)
    runaway.repetition_penalty = 1e-300
    rows = [row(0, SamplingParams(temperature=0.0)), row(1, runaway, range(40), 40),
            row(2, SamplingParams(seed=1), seed=1)]
    got = sample(logits, rows)
    assert got[1] is None and got[0] is not None and got[2] is not None
    assert got[2].token_id == sample(logits, [row(2, SamplingParams(seed=1), seed=1)])[0].token_id


def test_bytes_that_are_no_utf8_in_a_byte_fallback_vocabulary_do_not_stop_the_stream():
    """A SentencePiece-style vocabulary with byte fallback (Llama 2's, Mistral's, their GGUFs'): output bytes that
    are no UTF-8 (<0xF3> <0xB6> then ASCII <0x6E>) change text tokenizers' DecodeStream had emitted, and it raised
    "Invalid prefix encountered while decoding stream", failing the request (was: LLM.generate raised); the
    stream now goes on with the Python decodes, and the text before and after is the tokenizer's decode of it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "e": 258, "▁the": 259}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    output = [1 + 0xCE, 1 + 0x9A, 1 + 0xF3, 1 + 0xB6, 1 + 0x6E, 258, 259]
    detok = IncrementalDetokenizer(tok, [259])
    text = "".join(detok.add(t) for t in output) + detok.flush()
    assert text.startswith(tok.decode(output[:2])) and text.endswith(tok.decode(output[-2:])), text
    assert tok.decode(output[:2]) == "Κ"
