"""The runtime on the tiny model against Hugging Face generate: greedy, preemption, chunking, prefix hits, beams,
sharing."""

from __future__ import annotations

import pytest
import torch

from greedy_fixtures import EOS, MAX_TOKENS, prompts as prompts, reference as reference  # the shared fixtures
from runtime_helpers import hf_beams, hf_greedy, run_staggered, runtime_config, step_engine, tiny_hf
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def hf():
    return tiny_hf()


def make(hf, **kw) -> LLMEngine:
    config = runtime_config(**kw)
    return LLMEngine(step_engine(hf, config), config, hf.tokenizer, [EOS])


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def greedy_tokens(engine, prompts, every=1):
    return [o.outputs[0].token_ids for o in run_staggered(engine, [(p, GREEDY) for p in prompts], every)]


def test_greedy_matches_hf_with_staggered_arrivals(hf, prompts, reference):
    engine = make(hf)
    assert greedy_tokens(engine, prompts, every=2) == reference
    assert engine.stats()["num_preemptions"] == 0 and engine.kv.pool.num_free == engine.config.num_kv_blocks


def test_greedy_matches_hf_when_blocks_run_out(hf, prompts, reference):
    engine = make(hf, num_kv_blocks=12)  # 192 slots for 261 prompt tokens
    assert greedy_tokens(engine, prompts) == reference
    assert engine.stats()["num_preemptions"] > 0


def test_greedy_matches_hf_with_swap_preemption(hf, prompts, reference):
    engine = make(hf, num_kv_blocks=12, preemption_mode="swap", num_host_blocks=32)
    assert greedy_tokens(engine, prompts) == reference
    assert engine.stats()["num_swap_outs"] > 0


def test_greedy_matches_hf_with_chunked_prefill(hf, prompts, reference):
    engine = make(hf, max_num_tokens=16)
    chunks = []
    original = engine.runner.step
    engine.runner.step = lambda batch: chunks.append(batch.num_tokens) or original(batch)
    assert greedy_tokens(engine, prompts) == reference
    assert max(chunks) <= 16 and engine.stats()["num_steps"] > len(prompts) + MAX_TOKENS


def test_greedy_matches_hf_with_prefix_cache_hits(hf):
    g = torch.Generator().manual_seed(2)
    system = torch.randint(0, 256, (40,), generator=g).tolist()
    prompts = [system + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 20, 1)]
    reference = [hf_greedy(hf, p, MAX_TOKENS, EOS) for p in prompts]
    engine = make(hf)
    assert greedy_tokens(engine, prompts, every=3) == reference
    stats = engine.stats()
    assert stats["prefix_cache_hits_tokens"] >= 3 * 32  # two full system blocks for every later prompt


@pytest.mark.parametrize("width, length_penalty, early_stopping", [(2, 1.0, False), (4, 0.5, True), (3, 2.0, "never")])
def test_beam_search_matches_hf(hf, prompts, width, length_penalty, early_stopping):
    engine = make(hf)
    params = SamplingParams(
        max_tokens=10, temperature=0.0, beam_width=width, n=width,
        length_penalty=length_penalty, early_stopping=early_stopping,
    )
    outs = run_staggered(engine, [(p, params) for p in prompts[1:5]])
    for prompt, out in zip(prompts[1:5], outs):
        expected = hf_beams(hf, prompt, 10, width, EOS, length_penalty=length_penalty, early_stopping=early_stopping)
        assert [c.token_ids for c in out.outputs] == expected
    assert engine.stats()["num_block_copies"] > 0  # beams forked and copied their shared last block on write
    assert engine.kv.pool.num_used == 0


def test_beam_search_with_a_repetition_penalty_matches_hf(hf, prompts):
    """HF applies its repetition penalty to the beams' log-probs; so do the beams here (they were scored
    without it: HF's beams without the penalty came back)."""
    engine = make(hf)
    params = SamplingParams(max_tokens=10, beam_width=3, n=3, repetition_penalty=3.0)
    outs = run_staggered(engine, [(p, params) for p in prompts[1:4]])
    for prompt, out in zip(prompts[1:4], outs):
        expected = hf_beams(hf, prompt, 10, 3, EOS, repetition_penalty=3.0)
        assert [c.token_ids for c in out.outputs] == expected
        assert expected != hf_beams(hf, prompt, 10, 3, EOS)  # the penalty changes the beams
    assert engine.kv.pool.num_used == 0


def test_parallel_samples_share_the_prompt_blocks(hf):
    engine = make(hf)
    prompt = list(range(40))  # 2 full blocks + 8 tokens
    engine.add_request(prompt, SamplingParams(max_tokens=4, n=4, temperature=1.0, seed=3, ignore_eos=True))
    engine.step()  # prefill once, then fork into 4 samples
    assert engine.kv.pool.num_used == 3
    assert engine.stats()["kv_blocks_saved_by_sharing"] == 3 * 3
    engine.step()  # every sample writes its token: 3 copy the shared last block, the last one keeps it
    assert engine.num_block_copies == 3
    assert engine.kv.pool.num_used == 2 + 4
    tables = [engine.kv.block_table(s) for s in engine.scheduler.running[0].seqs]
    assert len({tuple(t[:2]) for t in tables}) == 1 and len({t[2] for t in tables}) == 4
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.pool.num_used == 0


def test_seeded_sampling_reproducible_across_batch_compositions(hf, prompts):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, top_k=50, seed=1234, n=2)
    alone = run_staggered(make(hf), [(prompts[3], params)])[0]
    other = SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    mixed = run_staggered(make(hf, max_num_tokens=24),
                          [(prompts[6], other), (prompts[3], params), (prompts[1], other)])[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in mixed.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids


def test_seeds_that_differ_only_in_their_high_bits_draw_differently(hf, prompts):
    """torch's CPU generator keeps 32 bits of a seed: 5, 5 + 2**32 and 5 + 2**40 drew the same tokens (and so did 0
    and -2**63). Each seed of the int64 range draws its own, and the same seed the same."""
    engine = make(hf)
    seeds = [5, 5 + 2**32, 5 + 2**40, 5, 0, -(2**63)]
    runs = run_staggered(engine, [(prompts[3], SamplingParams(max_tokens=8, temperature=1.0, seed=s)) for s in seeds])
    tokens = [tuple(r.outputs[0].token_ids) for r in runs]
    assert tokens[0] == tokens[3] and len({tokens[i] for i in (0, 1, 2, 4, 5)}) == 5, tokens


def test_stop_reasons_and_the_text_a_stop_token_leaves(hf, prompts, reference):
    """vLLM's rules: a stop token id is the stop reason and its text is left out unless include_stop_str_in_output
    (the text is then that of the tokens before it, or up to it, as max_tokens cuts them); the model's own EOS
    has no stop reason."""
    engine = make(hf)
    ids = reference[2]
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    def text(**kw):
        return run_staggered(engine, [(prompts[2], SamplingParams(temperature=0.0, **kw))])[0].outputs[0]
    for include, length in ((False, k), (True, k + 1)):
        out = text(max_tokens=MAX_TOKENS, stop_token_ids=[ids[k]], include_stop_str_in_output=include)
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[: k + 1], "stop", ids[k])
        assert out.text == text(max_tokens=length).text
    eos = text(max_tokens=MAX_TOKENS, logit_bias={EOS: 100.0})
    assert (eos.token_ids, eos.finish_reason, eos.stop_reason) == ([EOS], "stop", None)
    # EOS listed as a stop token too: vLLM looks for EOS first (no stop reason), unless EOS is ignored
    for ignore_eos, reason in ((False, None), (True, EOS)):
        both = text(max_tokens=MAX_TOKENS, logit_bias={EOS: 100.0}, stop_token_ids=[EOS], ignore_eos=ignore_eos)
        assert (both.token_ids, both.finish_reason, both.stop_reason) == ([EOS], "stop", reason)


def test_min_tokens_holds_off_eos_stop_tokens_and_stop_strings(hf, prompts, reference):
    """With EOS pushed to the top (logit_bias), min_tokens 5 makes the model's other choices first: the first 5
    tokens are Hugging Face's greedy ones, then EOS (under ignore_eos as well). A stop token id or stop string met
    before min_tokens does not end the output; once past it they do."""
    engine = make(hf)
    ids = reference[2]
    assert EOS not in ids[:5]
    def run(**kw):
        return run_staggered(engine, [(prompts[2], SamplingParams(temperature=0.0, **kw))])[0].outputs[0]
    out = run(max_tokens=MAX_TOKENS, logit_bias={EOS: 100.0}, min_tokens=5)
    assert (out.token_ids, out.finish_reason) == (ids[:5] + [EOS], "stop")
    # ignore_eos too: EOS still may not come before min_tokens (vLLM masks it; it was sampled from the first token)
    ignored = run(max_tokens=8, logit_bias={EOS: 100.0}, min_tokens=5, ignore_eos=True)
    assert (ignored.token_ids, ignored.finish_reason) == (ids[:5] + [EOS] * 3, "length")
    k = next(i for i in range(1, 6) if ids[i] not in ids[:i])
    held = run(max_tokens=MAX_TOKENS, stop_token_ids=[ids[k]], min_tokens=k + 2)
    assert ids[k] not in held.token_ids[: k + 2] and len(held.token_ids) >= k + 2
    stop = run(max_tokens=MAX_TOKENS).text[:1]
    assert run(max_tokens=MAX_TOKENS, stop=[stop]).text == ""
    late = run(max_tokens=MAX_TOKENS, stop=[stop], min_tokens=3)
    assert late.text.startswith(run(max_tokens=3).text) and (late.finish_reason, late.stop_reason) in (
        ("stop", stop), ("length", None))  # fmt: skip
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_beams_that_end_on_a_stop_token_leave_its_text_out(hf, prompts):
    engine = make(hf)
    beams = dict(max_tokens=10, temperature=0.0, beam_width=3, n=3)
    free = run_staggered(engine, [(prompts[3], SamplingParams(**beams))])[0].outputs
    stops = sorted({c.token_ids[4] for c in free})  # tokens the beams reach: some hypotheses end on them
    for include in (False, True):
        outs = run_staggered(engine, [(prompts[3], SamplingParams(stop_token_ids=stops, skip_special_tokens=False,
                                                                  include_stop_str_in_output=include, **beams))])
        ended = [c for c in outs[0].outputs if c.finish_reason == "stop"]
        assert ended
        for c in ended:
            shown = c.token_ids if include else c.token_ids[:-1]
            assert c.stop_reason == c.token_ids[-1] in stops
            assert c.text == hf.tokenizer.decode(shown, skip_special_tokens=False)


@pytest.mark.parametrize("num_stops", [2, 5])
def test_beam_search_whose_best_tokens_are_stop_tokens_matches_hf(hf, prompts, num_stops):
    """Stop token ids end beams as EOS does, so HF's truth is eos_token_id = [EOS] + stop ids, which keeps
    (1 + #ids) x width candidates a step: `width` beams run on when the most likely next tokens all end one
    (with candidates counted from EOS alone the search ended after one token, or ran with fewer beams)."""
    engine = make(hf)
    for prompt in prompts[1:4]:
        with torch.no_grad():
            next_logits = hf.model(torch.tensor([prompt])).logits[0, -1]
        stops = [t for t in next_logits.topk(num_stops + 1).indices.tolist() if t != EOS][:num_stops]
        params = SamplingParams(max_tokens=8, temperature=0.0, beam_width=3, n=3, early_stopping="never",
                                stop_token_ids=stops, include_stop_str_in_output=True)  # fmt: skip
        out = run_staggered(engine, [(prompt, params)])[0]
        expected = hf_beams(hf, prompt, 8, 3, [EOS, *stops], early_stopping="never")
        assert [c.token_ids for c in out.outputs] == expected
    assert engine.kv.pool.num_used == 0


def test_stop_token_ids_logprobs_and_abort(hf, prompts, reference):
    engine = make(hf)
    stop_at = reference[2][3]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[stop_at], logprobs=2)
    out = run_staggered(engine, [(prompts[2], params)])[0].outputs[0]
    assert out.token_ids == reference[2][: reference[2].index(stop_at) + 1] and out.finish_reason == "stop"
    assert len(out.logprobs) == len(out.token_ids) and all(len(lp) >= 2 for lp in out.logprobs)
    request = engine.add_request(prompts[6], GREEDY)
    engine.step()
    assert engine.abort(request) and engine.kv.pool.num_used == 0


@pytest.mark.parametrize("beam", [False, True])
def test_a_recomputed_group_shares_its_prompt_again(hf, beam):
    """An n-sample request (or a beam search) preempted by recompute shares again what its sequences have in
    common: each waits for the blocks an earlier one computes. Under load it ends as it does alone (was: every
    sequence recomputed its whole history into blocks of its own, more than this pool holds, and the request
    ended early with finish_reason "length")."""
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 256, (40,), generator=g).tolist()  # 2 full blocks + 8 tokens
    if beam:
        params = SamplingParams(max_tokens=20, temperature=0.0, beam_width=4, n=4, ignore_eos=True)
    else:
        params = SamplingParams(max_tokens=20, n=4, temperature=1.0, seed=7, ignore_eos=True)
    other = SamplingParams(max_tokens=60 if beam else 30, temperature=0.0, ignore_eos=True)
    num_kv_blocks = 8 if beam else 12  # beams share more than the prompt: their common prefixes, as a tree
    alone = run_staggered(make(hf, num_kv_blocks=num_kv_blocks, enable_prefix_caching=False), [(prompt, params)])[0]
    engine = make(hf, num_kv_blocks=num_kv_blocks, enable_prefix_caching=False)
    loaded = run_staggered(engine, [(list(range(20)), other), (prompt, params)])[1]
    assert engine.stats()["num_preemptions"] > 0  # the scenario is the one intended
    assert [c.finish_reason for c in loaded.outputs] == [c.finish_reason for c in alone.outputs] == ["length"] * 4
    assert [c.token_ids for c in loaded.outputs] == [c.token_ids for c in alone.outputs]
    assert all(len(c.token_ids) == 20 for c in loaded.outputs)
    assert engine.kv.pool.num_used == 0


def test_a_recomputed_group_whose_prefix_is_cached_goes_on(hf):
    """A preempted n=2 request whose first sample's full blocks are all still in the prefix cache: the sample
    that waits to share them is not left waiting for a sequence with nothing left to compute (was: the request,
    and every one queued behind it, never scheduled again). It ends as it does without the preemption."""
    from trtpaged.runtime.scheduler import SchedulerOutput

    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (32,), generator=g).tolist()
    params = SamplingParams(max_tokens=30, n=2, temperature=1.0, seed=1, ignore_eos=True)
    alone = run_staggered(make(hf), [(prompt, params)])[0]
    engine = make(hf)
    rid = engine.add_request(prompt, params)
    group = engine.scheduler.running[0] if engine.scheduler.running else engine.scheduler.waiting[0]
    while len(group.seqs[0].token_ids) < 49:  # 48 tokens computed: 3 full blocks, all cached
        engine.step()
    engine.scheduler._preempt(group, SchedulerOutput())  # what a full pool does to the newest request
    later = engine.add_request(list(range(9)), SamplingParams(max_tokens=4, temperature=0.0))
    done = {}
    for _ in range(200):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished():
            break
    assert set(done) == {rid, later}
    assert [c.token_ids for c in done[rid].outputs] == [c.token_ids for c in alone.outputs]
    assert engine.kv.pool.num_used == 0


def test_a_group_waiting_to_share_can_be_swapped_out_and_back(hf):
    """Swap preemption with a host pool too small for a whole n=3 group recomputes it (and plans its re-sharing);
    preempted again while its samples wait to share, it is swapped: the waiting samples hold no blocks and get
    none back (was: empty tables, and the next step raised 'sharing blocks into a sequence that already has
    blocks'). Every request ends as it does alone."""
    g = torch.Generator().manual_seed(8)
    requests = [(torch.randint(0, 256, (30,), generator=g).tolist(),
                 SamplingParams(max_tokens=20, n=3, temperature=1.0, seed=i, ignore_eos=True)) for i in range(3)]
    config = dict(num_kv_blocks=12, block_size=8, max_num_tokens=12, preemption_mode="swap", num_host_blocks=3,
                  enable_prefix_caching=False)  # fmt: skip
    alone = [run_staggered(make(hf, **config), [r])[0] for r in requests]  # the pool cuts each at the same token
    engine = make(hf, **config)
    got = run_staggered(engine, requests)
    # the scenario is the one intended: swaps, and preemptions of a whole request beyond them (recomputed); counted
    # per request, as num_swap_outs is (stats' num_preemptions counts each sample: one swap of a group is 3)
    swaps = engine.stats()["num_swap_outs"]
    assert swaps > 0 and sum(o.num_preemptions for o in got) > swaps
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in alone]
    assert engine.kv.pool.num_used == 0


class _OutputPenalties:
    """vLLM's presence and frequency penalties as a transformers logits processor: over the output tokens only
    (those after the prompt's `num_prompt` tokens)."""

    def __init__(self, num_prompt: int, presence: float, frequency: float) -> None:
        self.num_prompt, self.presence, self.frequency = num_prompt, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.num_prompt :], minlength=scores.shape[1]).float()
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def _hf_penalised_greedy(hf, prompt: list[int], params: SamplingParams, steps: int) -> list[int]:
    """Greedy tokens of the HF model with the request's logit_bias, transformers' repetition penalty (prompt and
    output) and the output-only penalties applied to each step's logits, EOS ignored."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    processors = [RepetitionPenaltyLogitsProcessor(params.repetition_penalty),
                  _OutputPenalties(len(prompt), params.presence_penalty, params.frequency_penalty)]  # fmt: skip
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            scores = hf.model(ids).logits[:, -1, :].float()
            for token, bias in (params.logit_bias or {}).items():
                scores[0, token] += bias
            for processor in processors:
                scores = processor(ids, scores)
            ids = torch.cat([ids, scores.argmax(dim=1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_greedy_equivalent_extremes_with_penalties_at_their_bounds_match_hf(hf, prompts):
    """Settings that leave one token each step (a temperature far below 1e-5, top_k 1, top_p 1e-9, min_p 1) with
    every penalty at its bound over 40 tokens, n=2 forks and preemption: exactly the reference's greedy tokens,
    penalties counted from each sequence's own history (repetition: prompt and output; presence, frequency:
    output only)."""
    steps = 40
    cases = [dict(temperature=1e-30, repetition_penalty=100.0, frequency_penalty=-2.0),
             dict(temperature=0.7, top_k=1, repetition_penalty=0.01, presence_penalty=2.0, seed=2**63 - 1),
             dict(temperature=3.0, top_p=1e-9, presence_penalty=-2.0, frequency_penalty=2.0, n=2, seed=-(2**63)),
             dict(temperature=1.0, min_p=1.0, presence_penalty=2.0, frequency_penalty=-2.0, n=2,
                  logit_bias={t: -100.0 for t in range(0, 256, 2)})]  # fmt: skip
    requests = [(p, SamplingParams(max_tokens=steps, ignore_eos=True, **kw)) for kw in cases for p in prompts[1:4]]
    engine = make(hf, num_kv_blocks=20)
    outs = run_staggered(engine, requests, every=2)
    for (prompt, params), out in zip(requests, outs):
        expected = _hf_penalised_greedy(hf, prompt, params, steps)
        assert [c.token_ids for c in out.outputs] == [expected] * params.n, params
    assert engine.stats()["num_preemptions"] > 0 and engine.kv.pool.num_used == 0
