"""Speculative decoding (n-gram) on the paged cache, against independent truths: HF generate and the same
engine without speculation (greedy, seeded), the exact target distribution (chi-square), exact block accounting."""

from __future__ import annotations

import collections
import random
import re

import pytest
import torch

from runtime_helpers import (RandomLogitsEngine, for_each_cpu_isa, hf_beams, hf_greedy, run_staggered,
                             runtime_config, serve_one_completion, step_engine, tiny_hf)  # fmt: skip
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.runtime.speculative import AcceptanceTracker, SpeculativeConfig, ngram_propose

EOS = 257
# speculate at any batch size and acceptance
ALWAYS = dict(disable_by_batch_size=None, min_acceptance_rate=0.0, verify_row_cost=0.0)


# ---- the proposer -----------------------------------------------------------------------------------
def _lookup_reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Plain-Python prompt lookup: of the longest suffix n-gram's earlier occurrences, the latest followed by
    k tokens, else the earliest."""
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == suffix]
        if starts:
            full = [s for s in starts if s + n + k <= len(tokens)]
            start = full[-1] if full else starts[0]
            return tokens[start + n : start + n + k]
    return []


def test_ngram_proposer_matches_a_plain_search():
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(0, 40))]
        k, n_min = rng.randrange(1, 6), rng.randrange(1, 3)
        n_max = n_min + rng.randrange(0, 3)
        assert ngram_propose(tokens, k, n_min, n_max) == _lookup_reference(tokens, k, n_min, n_max), tokens
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 3, 1, 3) == [9, 1, 2]
    assert ngram_propose([4, 4, 4, 4, 4], 3, 1, 1) == [4, 4, 4]


@pytest.mark.parametrize("bad, field", [
    (dict(method="eagle"), "method"), (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=17), "num_speculative_tokens"), (dict(prompt_lookup_min=3, prompt_lookup_max=2),
    "prompt_lookup_min"), (dict(disable_by_batch_size=0), "disable_by_batch_size"), ({"k": 2}, "unknown field"),
    (dict(min_acceptance_rate=1.5), "min_acceptance_rate"), ("[1]", "JSON object"),
])  # fmt: skip
def test_config_errors_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(bad)
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 2}').num_speculative_tokens == 2


# ---- exact block accounting ---------------------------------------------------------------------------
def assert_accounting(engine: LLMEngine) -> None:
    """Every block's ref_cnt is the number of device tables holding it; a live sequence holds exactly the
    blocks of its computed tokens; every cached block of a live sequence holds its accepted tokens."""
    kv, bs = engine.kv, engine.config.block_size
    refs = collections.Counter(b.block_id for table in kv.tables.values() for b in table)
    for block in kv.pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0), block
        assert block.in_free_queue == (block.ref_cnt == 0), block
    for group in engine.scheduler.running:
        for seq in group.seqs:
            table = kv.tables.get(seq.seq_id, [])
            assert len(table) == -(-seq.num_computed_tokens // bs), seq
            for j, block in enumerate(table[: seq.num_computed_tokens // bs]):
                if block.is_cached:
                    assert block.token_ids == tuple(seq.token_ids[j * bs : (j + 1) * bs])


def greedy_chain(table: torch.Tensor, prompt: list[int], n: int) -> list[int]:
    """RandomLogitsEngine's greedy output: each token is the argmax of the row of the one before."""
    out, last = [], prompt[-1]
    for _ in range(n):
        last = int(table[last % table.shape[0]].argmax())
        out.append(last)
    return out


def run_storm(engine: LLMEngine, table: torch.Tensor, rng: random.Random, check) -> tuple:
    """24 requests (a third with a shared 9-token prefix; even ones greedy, odd ones sampled and seeded) added
    at random steps, `check()` after every step; returns (request ids, finished outputs by id, the requests,
    the greedy ones' expected outputs by index)."""
    vocab = table.shape[0]
    shared = [rng.randrange(vocab) for _ in range(9)]
    requests, expected = [], {}
    for i in range(24):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 14))]
        greedy = i % 2 == 0
        params = SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0 if greedy else 1.0, seed=i,
                                ignore_eos=True)  # fmt: skip
        requests.append((prompt, params))
        if greedy:
            expected[i] = greedy_chain(table, prompt, params.max_tokens)
    ids, done = [], {}
    pending = list(requests)
    while pending or engine.has_unfinished():
        if pending and rng.random() < 0.5:
            ids.append(engine.add_request(*pending.pop(0)))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        check()
    return ids, done, requests, expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("caching", [True, False])
def test_accept_reject_storm_keeps_exact_accounting(mode, caching):
    """Greedy rows (long accepted runs) and sampled rows (mostly rejected) under block pressure, preemption
    and prefix-cache hits: the accounting holds after every step, greedy outputs are the model's, and
    the pool is whole at the end."""
    rng = random.Random(1)
    num_kv_blocks, vocab = 24, 12
    config = runtime_config(num_kv_blocks=num_kv_blocks, block_size=4, max_batch_size=6, max_num_tokens=40,
                            max_seq_len=96, preemption_mode=mode, num_host_blocks=64 if mode == "swap" else 0,
                            enable_prefix_caching=caching,
                            speculative=SpeculativeConfig(num_speculative_tokens=5, **ALWAYS))  # fmt: skip
    runner = RandomLogitsEngine(num_kv_blocks, vocab)
    engine = LLMEngine(runner, config, None, [])

    def check() -> None:
        assert_accounting(engine)
        if runner.batches:
            assert runner.batches[-1].num_tokens <= config.max_num_tokens

    ids, done, requests, expected = run_storm(engine, runner.table, rng, check)
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]  # rejections happened
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swap_outs"] > 0
    if caching:
        assert stats["prefix_cache_hits_tokens"] > 0
    for i, request_id in enumerate(ids):
        assert done[request_id].outputs[0].finish_reason == "length"
        assert len(done[request_id].outputs[0].token_ids) == requests[i][1].max_tokens
        if i in expected:
            assert done[request_id].outputs[0].token_ids == expected[i], i
    assert engine.kv.pool.num_free == num_kv_blocks
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)


def test_exactly_the_steps_that_decode_one_sequence_are_row_invariant():
    """The batch builder marks a step `row_invariant` when it decodes one sequence: its only sequence has every
    row's logits (its one new token, then any draft); a prefill chunk, or two sequences, keep the fast path."""
    config = runtime_config(num_kv_blocks=64, block_size=4, max_num_tokens=64,
                            speculative=SpeculativeConfig(num_speculative_tokens=3, **ALWAYS))  # fmt: skip
    runner = RandomLogitsEngine(64, 8)
    engine = LLMEngine(runner, config, None, [])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    run_staggered(engine, [([1, 2, 3, 4, 5, 6] * 3, params), ([3, 4] * 5, params)], every=6)
    kinds = collections.Counter()
    for batch in runner.batches:
        one_decoding = batch.query_start.numel() == 2 and batch.logits_index.numel() == batch.num_tokens
        assert batch.row_invariant == one_decoding
        kinds[(batch.row_invariant, batch.num_tokens > 1)] += 1
    assert all(kinds[kind] > 0 for kind in ((True, True), (True, False), (False, True))), kinds


def test_disabled_at_batch_size_and_budget_counts_drafts():
    """At `disable_by_batch_size` decoding sequences a step proposes nothing; below it, drafts count
    against max_num_tokens."""
    config = runtime_config(num_kv_blocks=64, block_size=4, max_batch_size=8, max_num_tokens=24,
                            speculative=SpeculativeConfig(num_speculative_tokens=16, disable_by_batch_size=3))
    runner = RandomLogitsEngine(64, 8)
    engine = LLMEngine(runner, config, None, [])
    for i in range(3):
        engine.add_request([1, 2, 3, 1, 2, 3, i],
                           SamplingParams(max_tokens=4 + 20 * i, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    decode_steps = runner.batches[1:]  # the first step prefills all three
    seqs = [int(b.query_start.shape[0]) - 1 for b in decode_steps]
    assert all(b.num_tokens == n for b, n in zip(decode_steps, seqs) if n >= 3)  # off: one token each
    assert any(b.num_tokens > n for b, n in zip(decode_steps, seqs) if n < 3)  # on once fewer remain
    assert engine.stats()["spec_decode_num_steps_disabled"] > 0
    config = runtime_config(num_kv_blocks=64, block_size=4, max_batch_size=8, max_num_tokens=8,
                            speculative=SpeculativeConfig(num_speculative_tokens=16))
    runner = RandomLogitsEngine(64, 8)
    engine = LLMEngine(runner, config, None, [])
    engine.add_request([1, 2, 3] * 4, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert max(b.num_tokens for b in runner.batches) == 8  # 1 + 16 proposed, cut to the budget


def test_sequences_below_the_acceptance_rate_stop_proposing():
    """Sampled sequences over a flat distribution reject nearly everything and stop verifying drafts after a
    few steps; greedy ones (a deterministic chain: everything accepted) keep speculating."""
    config = runtime_config(num_kv_blocks=64, block_size=4, max_batch_size=8, max_num_tokens=64,
                            speculative=SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=None))
    runner = RandomLogitsEngine(64, 6)
    runner.table.zero_()  # every token equally likely: a draft token is accepted with probability 1/6
    runner.table[:, 0] = 1e-3  # ... and greedy is the chain 0, 0, 0, ...
    engine = LLMEngine(runner, config, None, [])
    prompt = [0, 1, 2, 3, 4, 5] * 3
    engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    sampled = engine.stats()["spec_decode_num_drafts"]
    assert 1 <= sampled <= 20  # verified for a while, then only shadow proposals (a few come back above 0.6)
    engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] - sampled >= 12  # 59 tokens in runs of up to 5
    assert engine.kv.pool.num_free == 64


def _verified_share(num_seqs: int, row_cost: float) -> tuple[float, list[list[int]]]:
    """`num_seqs` seeded sampled sequences over a two-token random walk (each n-gram draft token is accepted
    with probability 1/2, independently), all at once: verified drafts per decoding sequence-step, and the
    outputs."""
    spec = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=None, verify_row_cost=row_cost)
    config = runtime_config(num_kv_blocks=128, block_size=4, max_batch_size=8, max_num_tokens=64, speculative=spec)
    runner = RandomLogitsEngine(128, 6)
    runner.table.fill_(-30.0)
    runner.table[:, :2] = 0.0  # tokens 0 and 1 equally likely after any token
    engine = LLMEngine(runner, config, None, [])
    for i in range(num_seqs):
        engine.add_request([0, 1, 1, 0, 1, 0, 0, 1], SamplingParams(max_tokens=60, temperature=1.0, seed=i,
                                                                    ignore_eos=True))  # fmt: skip
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert engine.kv.pool.num_free == 128
    seq_steps = sum(int(b.query_start.shape[0]) - 1 for b in runner.batches[1:])  # the first step prefills
    in_order = sorted(outputs, key=lambda request_id: int(request_id.rsplit("-", 1)[-1]))
    return engine.stats()["spec_decode_num_drafts"] / seq_steps, [outputs[k] for k in in_order]


def test_the_cost_rule_speculates_where_it_pays():
    """Drafts accepted half the time pay alone (a row costs 0.3 of a step) but not among 8 decoding sequences,
    whose step already yields 8 tokens for 1 + 0.3 * 7 of cost; with free rows they are always verified.
    What each request returns does not depend on any of it (seeded)."""
    alone, alone_out = _verified_share(1, 0.3)
    batch, batch_out = _verified_share(8, 0.3)
    free, free_out = _verified_share(8, 0.0)
    assert alone > 3 * batch and free > 0.9, (alone, batch, free)
    assert batch_out[0] == alone_out[0] and batch_out == free_out


def test_a_draft_model_sequence_that_does_not_pay_backs_off_and_probes():
    """Without free shadow proposals a sequence whose drafts are rejected probes one token at growing
    intervals (twice as long after each rejected probe, up to a cap); an accepted probe restarts the short
    interval. An n-gram sequence (free shadows) is never given a probe."""
    tracker = AcceptanceTracker(row_cost=0.3)
    for _ in range(4):
        tracker.observe(0, 4, 0)
        tracker.observe(1, 4, 0)

    def next_probe() -> int:
        for steps in range(1, 10_000):
            assert tracker.tokens(1, 4, 1) == 0  # free shadows: no probe
            if tracker.tokens(0, 4, 1, free_shadow=False):
                return steps
        raise AssertionError("no probe")

    gaps = []
    for _ in range(6):
        gaps.append(next_probe())
        tracker.observe(0, 1, 0)
    assert all(b == min(2 * a, gaps[-1]) for a, b in zip(gaps, gaps[1:])) and gaps[-1] > gaps[0], gaps
    assert next_probe() == gaps[-1]
    tracker.observe(0, 1, 1)  # accepted: back to the short wait
    assert next_probe() == gaps[0]


# ---- the tiny model against HF ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf():
    return tiny_hf()


def make(hf, spec=None, **kw) -> LLMEngine:
    config = runtime_config(speculative=spec, **kw)
    return LLMEngine(step_engine(hf, config), config, hf.tokenizer, [EOS])


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    rand = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 54)]
    passage = torch.randint(0, 256, (23,), generator=g).tolist()
    copy_heavy = [passage * 3, passage + [7, 7, 7] + passage[:5], [5, 6] * 20]
    return rand + copy_heavy


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_identical_to_hf_and_to_no_speculation(hf, prompts, k):
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=0)
    reference = [hf_greedy(hf, p, 40, EOS) for p in prompts]
    plain = run_staggered(make(hf), [(p, params) for p in prompts], every=2)
    engine = make(hf, SpeculativeConfig(num_speculative_tokens=k, **ALWAYS), block_size=8)
    spec = run_staggered(engine, [(p, params) for p in prompts], every=2)
    assert [o.outputs[0].token_ids for o in spec] == reference
    assert [o.outputs[0].token_ids for o in plain] == reference
    for a, b in zip(spec, plain):
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["num_steps"] < make_steps(hf, prompts, params)
    assert engine.kv.pool.num_free == engine.config.num_kv_blocks


def test_int4_engine_single_stream_returns_the_same_with_speculation(hf, prompts):
    # An int4 engine keeps float activations, whose CPU kernels run one row as int8 limbs and several as
    # float tiles (different rounding). A single stream's steps decode one sequence, so the runtime runs them
    # row_invariant: a verification step of 1 + k rows gives each row the logits of a one-row decode step.
    # Then greedy tokens and every returned log-prob are bit-identical with speculation on and off, on each
    # CPU ISA. (Without that, the log-probs differ on every ISA and a near-tie can flip a token.)
    from trtpaged.builder.quantize import quantized_step_model
    from trtpaged.config import parse_config
    from trtpaged.models import dims_from_hf_config
    from trtpaged.runtime.runners import TorchRunner

    built = parse_config({"model": {"tiny": {}}, "quantization": {"weights": "int4", "group_size": 32,
                                                                  "activations": "float"}})  # fmt: skip
    model = quantized_step_model(hf.model, built.model, dims_from_hf_config(hf.config), built.quantization,
                                 torch.float32)[0]  # fmt: skip

    def run(spec) -> list[tuple[list[int], list, float]]:
        config = runtime_config(speculative=spec)
        engine = LLMEngine(TorchRunner(model, model.new_kv_cache(config.num_kv_blocks, config.block_size)),
                           config, hf.tokenizer, [EOS])  # fmt: skip
        params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1)
        # one stream: the copy-heavy prompts one at a time
        outs = [run_staggered(engine, [(p, params)])[0].outputs[0] for p in prompts[3:]]
        if spec is not None:
            assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
        return [(o.token_ids, o.logprobs, o.cumulative_logprob) for o in outs]

    def check(isa: str) -> None:
        assert run(SpeculativeConfig(num_speculative_tokens=5, **ALWAYS)) == run(None), isa

    for_each_cpu_isa(check)


def make_steps(hf, prompts, params) -> int:
    engine = make(hf)
    run_staggered(engine, [(p, params) for p in prompts], every=2)
    return engine.stats()["num_steps"]


def test_stops_inside_an_accepted_run_are_exact(hf, prompts):
    """max_tokens, a stop token id and a stop string reached in the middle of a verified run end the
    output exactly where they end it without speculation."""
    base = SamplingParams(max_tokens=40, temperature=0.0)
    plain = make(hf)
    runs = {i: plain_tokens for i, plain_tokens in enumerate(
        o.outputs[0] for o in run_staggered(plain, [(p, base) for p in prompts]))}  # fmt: skip
    cases = []
    for i, p in enumerate(prompts):
        out = runs[i]
        cut = len(out.token_ids) // 2
        cases.append((p, SamplingParams(max_tokens=cut + 1, temperature=0.0, logprobs=0)))
        cases.append((p, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(out.token_ids[cut],),
                                        logprobs=0)))
        text = out.text
        if len(text) > 6:
            cases.append((p, SamplingParams(max_tokens=40, temperature=0.0,
                                            stop=(text[len(text) // 2 : len(text) // 2 + 2],),
                                            logprobs=1)))  # fmt: skip
    want = run_staggered(make(hf), cases)
    engine = make(hf, SpeculativeConfig(num_speculative_tokens=6, **ALWAYS))
    got = run_staggered(engine, cases)
    for a, b in zip(got, want):
        x, y = a.outputs[0], b.outputs[0]
        assert ((x.token_ids, x.text, x.finish_reason, x.stop_reason)
                == (y.token_ids, y.text, y.finish_reason, y.stop_reason))
        assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-3)
        assert (x.logprobs is None) == (y.logprobs is None) and len(x.logprobs or []) == len(y.logprobs or [])
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert engine.kv.pool.num_free == engine.config.num_kv_blocks


def test_prefix_cache_hit_on_blocks_a_speculating_sequence_registered(hf, prompts):
    """A request arriving mid-speculation whose prompt is the first request's text so far finds its full
    blocks (accepted tokens only) in the prefix cache, and both outputs are HF's."""
    first = prompts[3]
    engine = make(hf, SpeculativeConfig(num_speculative_tokens=4, **ALWAYS), block_size=8)
    a = engine.add_request(first, SamplingParams(max_tokens=40, temperature=0.0))
    for _ in range(4):
        engine.step()
        assert_accounting(engine)
    seq = engine.groups[a].seqs[0]
    second = list(seq.token_ids)
    b = engine.add_request(second, SamplingParams(max_tokens=20, temperature=0.0))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        assert_accounting(engine)
    assert done[b].num_cached_tokens >= 8 * ((len(second) - 1) // 8) - 8
    assert done[b].num_cached_tokens > 0
    assert done[a].outputs[0].token_ids == hf_greedy(hf, first, 40, EOS)
    assert done[b].outputs[0].token_ids == hf_greedy(hf, second, 20, EOS)
    assert engine.kv.pool.num_free == engine.config.num_kv_blocks


def test_preemption_mid_speculation_recompute_and_swap(hf, prompts):
    params = SamplingParams(max_tokens=30, temperature=0.0)
    reference = [hf_greedy(hf, p, 30, EOS) for p in prompts]
    for kw in (dict(), dict(preemption_mode="swap", num_host_blocks=64)):
        engine = make(hf, SpeculativeConfig(num_speculative_tokens=4, **ALWAYS), num_kv_blocks=16, block_size=8, **kw)
        assert [o.outputs[0].token_ids for o in run_staggered(engine, [(p, params) for p in prompts])] == reference
        stats = engine.stats()
        assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
        assert engine.kv.pool.num_free == engine.config.num_kv_blocks


def test_seeded_samples_the_same_with_and_without_speculation(hf, prompts):
    """A seeded request draws once from its generator per output token, speculating or not: the same tokens.
    Parallel samples (n=2) speculate on their shared blocks with copy-on-write."""
    cases = [(p, SamplingParams(max_tokens=24, temperature=0.8, top_k=3, seed=s, n=2)) for s, p in enumerate(prompts)]
    want = run_staggered(make(hf), cases)
    engine = make(hf, SpeculativeConfig(num_speculative_tokens=4, **ALWAYS))
    got = run_staggered(engine, cases)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert engine.stats()["num_block_copies"] > 0
    assert engine.kv.pool.num_free == engine.config.num_kv_blocks


def test_beam_search_runs_unspeculated_on_a_speculating_engine(hf, prompts):
    engine = make(hf, SpeculativeConfig(num_speculative_tokens=4, **ALWAYS))
    params = SamplingParams(max_tokens=8, beam_width=3, n=3, temperature=0.0)
    (out,) = run_staggered(engine, [(prompts[3], params)])
    assert [c.token_ids for c in out.outputs] == hf_beams(hf, prompts[3], 8, 3, EOS)
    assert engine.stats()["spec_decode_num_drafts"] == 0


def _target_probs(hf, context: list[int], temperature: float, top_k: int) -> torch.Tensor:
    with torch.no_grad():
        logits = hf.model(torch.tensor([context])).logits[0, -1].double() / temperature
    kth = torch.topk(logits, top_k).values[-1]
    return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=0)


def joint_probs(hf, prompt: list[int], temperature: float, top_k: int) -> dict[tuple[int, ...], float]:
    """The target's exact probability of every 3-token continuation under temperature and top-k (HF forward)."""
    expected: dict[tuple[int, ...], float] = {}
    p1 = _target_probs(hf, prompt, temperature, top_k)
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = _target_probs(hf, prompt + [t1], temperature, top_k)
        for t2 in torch.nonzero(p2).flatten().tolist():
            p3 = _target_probs(hf, prompt + [t1, t2], temperature, top_k)
            for t3 in torch.nonzero(p3).flatten().tolist():
                expected[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    return expected


def assert_target_distribution(engine: LLMEngine, hf, prompt: list[int], top_k: int, draws: int, min_accepted: int,
                               min_rejected: int) -> None:  # fmt: skip
    """`draws` unseeded 3-token samples (temperature 1, `top_k`) of `prompt` follow the target's exact joint
    probabilities (HF forward): chi-square, cells expected below 5 draws pooled into one as the approximation
    needs; and speculation took part, accepting and rejecting drafts."""
    from scipy.stats import chisquare

    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, ignore_eos=True)
    torch.manual_seed(0)
    outs = run_staggered(engine, [(prompt, params)] * draws, every=0)
    expected = joint_probs(hf, prompt, 1.0, top_k)
    counts = collections.Counter(tuple(o.outputs[0].token_ids) for o in outs)
    assert set(counts) <= set(expected)
    cells = sorted(expected)
    small = [c for c in cells if expected[c] * draws < 5]
    big = [c for c in cells if expected[c] * draws >= 5]
    observed = [counts.get(c, 0) for c in big] + ([sum(counts.get(c, 0) for c in small)] if small else [])
    wanted = [expected[c] * draws for c in big] + ([sum(expected[c] * draws for c in small)] if small else [])
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > min_accepted
    assert stats["spec_decode_num_draft_tokens"] - stats["spec_decode_num_accepted_tokens"] > min_rejected
    assert chisquare(observed, wanted).pvalue > 1e-3, (observed, [round(w) for w in wanted])


def test_sampled_distribution_is_the_targets(hf, prompts):
    """Chi-square of 3-token outputs (unseeded, speculating with rejections) against the target's exact
    joint probabilities from HF's forward, under the same temperature and top-k."""
    seed = prompts[0] + prompts[1][:5]
    prompt = seed + hf_greedy(hf, seed, 40, None)  # the model's own loops: its top tokens recur, drafts land in them
    engine = make(hf, SpeculativeConfig(num_speculative_tokens=3, **ALWAYS), num_kv_blocks=512, max_batch_size=64,
                  max_num_tokens=1024)  # fmt: skip
    assert_target_distribution(engine, hf, prompt, top_k=2, draws=1600, min_accepted=50, min_rejected=50)


# ---- the server ----------------------------------------------------------------------------------------
def test_server_speculates_and_exposes_spec_decode_metrics(tiny_engine_dir):
    """A real loopback server with --speculative-config semantics: the official openai client gets the same
    greedy text as `LLM` without speculation, and /metrics carries the spec_decode counters."""
    from trtpaged import LLM

    prompt = "abcabcabcabcabcabc"
    want = LLM(tiny_engine_dir, device="cpu").generate(prompt, SamplingParams(max_tokens=24, temperature=0.0))
    spec = SpeculativeConfig.parse('{"num_speculative_tokens": 4, "min_acceptance_rate": 0}')
    text, values = serve_one_completion(tiny_engine_dir, prompt, 24, spec)
    assert text == want[0].outputs[0].text
    label = '{method="ngram"}'
    drafts, proposed, accepted = (values[f"trtpaged:spec_decode_num_{k}_total{label}"]
                                  for k in ("drafts", "draft_tokens", "accepted_tokens"))  # fmt: skip
    assert 0 < drafts <= proposed and 0 < accepted <= proposed
    per_pos = [v for k, v in values.items() if k.startswith("trtpaged:spec_decode_num_accepted_tokens_per_pos_total")]
    assert 'trtpaged:spec_decode_num_accepted_tokens_per_pos_total{method="ngram",position="0"}' in values
    assert sum(per_pos) == accepted  # every accepted token at exactly one draft position
    assert not any("draft_model" in k or "draft_kv" in k for k in values)  # n-gram has no draft engine
    # the same counters under vLLM's names, for the dashboards that read those (README, "Metrics")
    vllm = {re.sub(r'model_name="[^"]*",|,model_name="[^"]*"', "", k.replace("vllm:", "trtpaged:")): v
            for k, v in values.items() if k.startswith("vllm:")}  # fmt: skip
    assert set(vllm) == {k for k in values if k.startswith("trtpaged:") and "steps_disabled" not in k}
    assert all(vllm[k] == values[k] for k in vllm)


# ---- SmolLM2 (slow) ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_int4(request):
    """The int4 SmolLM2 engine dir: $TRTPAGED_SMOLLM2_INT4_DIR when set (a prebuilt one), else built."""
    import os

    prebuilt = os.environ.get("TRTPAGED_SMOLLM2_INT4_DIR")
    return prebuilt if prebuilt else request.getfixturevalue("smollm2_int4_engine_dir")


@pytest.mark.slow
def test_smollm2_greedy_identical_with_speculation(smollm2_int4):
    from trtpaged import LLM
    from trtpaged.runtime.runners import TorchRunner

    llm = LLM(smollm2_int4, device="cpu", num_kv_blocks=64)
    passage = "The committee agreed to keep the library open on Sundays and to repair the roof of the community hall."
    texts = [llm.chat_prompt([{"role": "user", "content": "Repeat this passage word for word:\n\n" + passage}]),
             llm.tokenizer.encode("1, 2, 3, 4, 5, 6,"), llm.tokenizer.encode("The capital of France is")]

    def engine(spec):
        config = runtime_config(num_kv_blocks=64, speculative=spec)
        model = llm.engine.runner.model
        runner = TorchRunner(model, model.new_kv_cache(config.num_kv_blocks, config.block_size))
        return LLMEngine(runner, config, llm.tokenizer, llm.manifest.eos_token_ids)

    params = SamplingParams(max_tokens=16, temperature=0.0)
    spec_engine = engine(SpeculativeConfig(num_speculative_tokens=5))
    got = run_staggered(spec_engine, [(t, params) for t in texts])
    want = run_staggered(engine(None), [(t, params) for t in texts])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = spec_engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] >= 5 and stats["num_steps"] < 3 + 3 * 15


def test_the_default_row_cost_follows_the_engine_arithmetic(tiny_engine_dir) -> None:
    """Without verify_row_cost, an engine's speculation prices a verified row by how its linears compute (the
    per-row costs measured in runtime/verify_cost.py: float weights stream once whatever the rows, int8
    activations pay integer dot products per row, float activations on quantized weights FMA per row); a
    given value wins; null is the default, anything else outside [0, 1] is refused by name."""
    from trtpaged import LLM
    from trtpaged.runtime.verify_cost import default_verify_row_cost

    float_cost = default_verify_row_cost({})
    w4a8_cost = default_verify_row_cost({"weights": "int4", "activations": "int8", "group_size": 32})
    int4_cost = default_verify_row_cost({"weights": "int4", "activations": "float", "group_size": 32})
    assert 0 < float_cost < w4a8_cost < int4_cost <= 1
    llm = LLM(tiny_engine_dir, device="cpu", warmup=False, speculative_config={"num_speculative_tokens": 2})
    assert llm.stats()["spec_decode_verify_row_cost"] == float_cost
    given = LLM(tiny_engine_dir, device="cpu", warmup=False,
                speculative_config='{"num_speculative_tokens": 2, "verify_row_cost": 0.45}')
    assert given.stats()["spec_decode_verify_row_cost"] == 0.45
    assert SpeculativeConfig.parse('{"verify_row_cost": null}').row_cost == SpeculativeConfig().row_cost
    for bad in (-0.1, 1.5, float("nan"), True, "0.2"):
        with pytest.raises(ValueError, match="speculative_config.verify_row_cost: must be a number in"):
            SpeculativeConfig(verify_row_cost=bad)
