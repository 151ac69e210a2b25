"""Prompt log-probs (SamplingParams.prompt_logprobs) against Hugging Face's log-softmax of its own forward.

They come from the prefill step's rows: checked with the whole prompt in one step, in chunks
(chunked prefill), after prefix-cache hits (a scoring request takes none) and across preemption.
"""

from __future__ import annotations

import pytest
import torch

from runtime_helpers import run_staggered, runtime_config, step_engine, tiny_hf
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.sampling_params import SamplingParams

EOS = 257
TOL = 1e-4  # float32 engine vs float32 HF forward


@pytest.fixture(scope="module")
def hf():
    return tiny_hf()


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row j is the log-softmax that scores prompt token j + 1."""
    with torch.no_grad():
        logits = hf.model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def make(hf, **kw) -> LLMEngine:
    config = runtime_config(**kw)
    return LLMEngine(step_engine(hf, config), config, hf.tokenizer, [EOS])


def check(entries, prompt, reference, k):
    """Every entry holds the prompt token's log-prob and the top-k, all equal to HF's, and the prompt token's rank
    in HF's row (max abs diff returned)."""
    assert entries[0] is None and len(entries) == len(prompt)
    worst = 0.0
    for j, entry in enumerate(entries[1:]):
        row = reference[j]
        top = torch.topk(row, k).indices.tolist() if k else []
        assert set(entry) == {prompt[j + 1], *top}
        lp = float(row[prompt[j + 1]])  # rank 1: the most likely; a tie within TOL may fall either way
        assert int((row > lp + TOL).sum()) + 1 <= entry.rank <= int((row >= lp - TOL).sum()), (j, entry.rank)
        for token, lp in entry.items():
            worst = max(worst, abs(lp - float(row[token])))
        check_logprob_fields(entry, top, prompt[j + 1], entry.rank)
    assert worst < TOL
    return worst


def check_logprob_fields(entry, top, token, token_rank, tokenizer=None):
    """vLLM's Logprob fields: `.logprob` the value itself, `.rank` the place of a top-k entry (the scored token's
    own rank otherwise), `.decoded_token` the token decoded alone (when the engine has a tokenizer)."""
    for t, lp in entry.items():
        assert lp.logprob == float(lp)
        assert lp.rank == (top.index(t) + 1 if t in top else token_rank if t == token else None), (t, lp.rank)
        if tokenizer is not None:
            assert lp.decoded_token == tokenizer.decode([t])


@pytest.mark.parametrize("max_num_tokens", [256, 24])  # one step, and chunks of 24 (odd splits of 97)
def test_prompt_logprobs_match_hf_forward(hf, max_num_tokens):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 2, 17, 54, 97)]
    engine = make(hf, max_num_tokens=max_num_tokens)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=4)
    outs = run_staggered(engine, [(p, params) for p in prompts])
    for prompt, out in zip(prompts, outs):
        check(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 4)
    assert engine.kv.pool.num_free == engine.config.num_kv_blocks


def test_sampled_tokens_logprobs_carry_vllm_ranks_and_texts(hf):
    """Per output token: the sampled token's log-prob and rank (tokens at least as likely, itself included) in HF's
    distribution, and the top-3 with their places, each with its text decoded alone."""
    prompt = [(5 * i + 2) % 250 for i in range(30)]
    params = SamplingParams(max_tokens=10, temperature=1.5, seed=7, logprobs=3, ignore_eos=True)
    out = run_staggered(make(hf), [(prompt, params)])[0]
    (c,) = out.outputs
    with torch.no_grad():
        logits = hf.model(torch.tensor([prompt + c.token_ids[:-1]])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 :]
    ranks = []
    for row, token, entry in zip(rows, c.token_ids, c.logprobs, strict=True):
        top = torch.topk(row, 3).indices.tolist()
        assert set(entry) == {token, *top}
        lp = float(row[token])
        assert abs(entry[token] - lp) < TOL
        rank = entry[token].rank if token not in top else None
        if rank is not None:
            assert int((row > lp + TOL).sum()) + 1 <= rank <= int((row >= lp - TOL).sum()), rank
        ranks.append(rank)
        check_logprob_fields(entry, top, token, rank, hf.tokenizer)
    assert any(r is not None and r > 3 for r in ranks), ranks  # at 1.5 some draws fall outside the top 3
    assert c.cumulative_logprob == pytest.approx(float(rows.gather(1, torch.tensor(c.token_ids)[:, None]).sum()),
                                                 abs=1e-4)  # fmt: skip
    # vLLM: cumulative_logprob is None when logprobs were not asked for (was: the sum all the same)
    params = SamplingParams(max_tokens=10, temperature=1.5, seed=7, ignore_eos=True)
    (plain,) = run_staggered(make(hf), [(prompt, params)])[0].outputs
    assert plain.token_ids == c.token_ids and plain.cumulative_logprob is None and plain.logprobs is None


def test_prefix_cache_hits_do_not_drop_prompt_logprobs(hf):
    """A scoring request recomputes a prompt whose blocks are cached; a plain request still takes the hits."""
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(6)).tolist()
    reference = hf_prompt_logprobs(hf, prompt)
    engine = make(hf)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    first = run_staggered(engine, [(prompt, plain)])[0]
    assert first.num_cached_tokens == 0 and first.prompt_logprobs is None
    queries = engine.stats()["prefix_cache_queries_tokens"]
    scored = run_staggered(engine, [(prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0))])[0]
    assert scored.num_cached_tokens == 0  # took no hits
    # and was not looked up, so it is no query (vLLM's count): it lowered the hit rate /metrics shows
    assert engine.stats()["prefix_cache_queries_tokens"] == queries
    check(scored.prompt_logprobs, prompt, reference, 0)
    again = run_staggered(engine, [(prompt, plain)])[0]
    assert again.num_cached_tokens == 64  # the cache still serves plain requests (4 full blocks of 16)


def test_prompt_logprobs_survive_preemption(hf):
    """A pool too small for every request at once preempts (recompute); positions already scored are kept."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 45, 50, 35)]
    engine = make(hf, num_kv_blocks=12, max_num_tokens=32)
    params = SamplingParams(max_tokens=30, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    outs = run_staggered(engine, [(p, params) for p in prompts])
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        check(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 1)


def test_prompt_logprobs_field_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-2)  # -1 is the whole vocabulary (vLLM)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1.5)


def test_tied_tokens_never_share_a_rank():
    """Exact ties (a low-precision lm_head's logits tie often): a scored entry's ranks are distinct, its top-k
    tokens' are their places 1..k (as vLLM reports them) and the prompt token's is a rank its log-prob can have
    (the tokens above it ahead, its ties either way), in the runtime's entries and in vLLM's server field."""
    from trtpaged.runtime.batch_builder import PromptRows
    from trtpaged.runtime.scoring import score_prompts
    from trtpaged.server.responses import TokenStrings, vllm_prompt_logprobs

    row = torch.tensor([2.0, 2.0, 2.0, 1.0, 1.0, 0.0])
    prompt = [5, 0, 1, 2, 3, 4, 5]  # each token scored by the same row: tied at the top, tied below the top-k, last
    for k in (0, 1, 2, 3, 4):
        (entries,) = score_prompts(row.repeat(6, 1), [PromptRows("r", 1, list(range(6)))], {"r": (prompt, k)}).values()
        field = vllm_prompt_logprobs([None, *entries], TokenStrings({t: str(t) for t in range(6)}))
        logprobs = torch.log_softmax(row, 0)
        for token, entry, shown in zip(prompt[1:], entries, field[1:]):
            ranks = {int(t): v.rank for t, v in shown.items()}
            assert ranks[token] == entry.rank and len(set(ranks.values())) == len(ranks), (k, token, ranks)
            assert sorted(r for t, r in ranks.items() if t != token or len(entry) == k) == list(range(1, k + 1))
            lp = logprobs[token]
            assert int((logprobs > lp).sum()) + 1 <= entry.rank <= int((logprobs >= lp).sum()), (k, token, ranks)


def test_completions_top_logprobs_keep_the_best_of_tokens_shown_alike(hf):
    """Byte tokens of a cut character all read "\ufffd": keyed by text, the completions format kept the last, i.e.
    the worst-ranked one's log-prob (vLLM does the same); it now keeps the best's, as the chosen token shows."""
    from trtpaged.server.responses import TokenStrings, completion_logprobs

    alike = [t for t in range(300) if hf.tokenizer.decode([t]) == "\ufffd"][:3]
    other = next(t for t in range(300) if hf.tokenizer.decode([t]) not in ("\ufffd", ""))
    assert len(alike) == 3
    entry = {alike[0]: -0.04, other: -1.2, alike[1]: -2.5, alike[2]: -5.36}
    strings = TokenStrings({t: hf.tokenizer.decode([t]) for t in entry})
    body, _ = completion_logprobs([alike[0]], [entry], strings, 0)
    assert body.token_logprobs == [-0.04]
    assert body.top_logprobs == [{"\ufffd": -0.04, hf.tokenizer.decode([other]): -1.2}]


def test_a_position_whose_logits_are_not_finite_has_no_entry_and_the_others_are_exact():
    """A request fails on non-finite logits (a model whose values overflow): its prompt log-probs were NaN for those
    positions (handed to a Python caller as such); they are None, and the finite rows' entries are log_softmax's."""
    from trtpaged.runtime.batch_builder import PromptRows
    from trtpaged.runtime.scoring import score_prompts

    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(3))
    logits[1, 4], logits[3, 0] = float("nan"), float("inf")
    prompt = [7, 2, 5, 1, 8]
    (entries,) = score_prompts(logits, [PromptRows("r", 1, [0, 1, 2, 3])], {"r": (prompt, 2)}).values()
    assert entries[1] is None and entries[3] is None
    for row in (0, 2):
        token, truth = prompt[row + 1], torch.log_softmax(logits[row], 0)
        assert entries[row][token].logprob == pytest.approx(float(truth[token]), abs=1e-6)
        assert set(entries[row]) == {token, *torch.topk(truth, 2).indices.tolist()}


@pytest.mark.slow
def test_prompt_logprobs_match_hf_on_smollm2(smollm2_engine_dir):
    """SmolLM2-135M (float32 engine) over HTTP-free LLM.generate, chunked: within verification's float32 tolerance."""
    from runtime_helpers import hf_from_engine_dir
    from trtpaged import LLM
    from trtpaged.builder.verify import TOLERANCES

    llm = LLM(smollm2_engine_dir, device="cpu", num_kv_blocks=64, max_num_tokens=32)
    hf = hf_from_engine_dir(smollm2_engine_dir)
    text = "The capital of France is Paris. The capital of Italy is Rome, and the capital of Spain is Madrid."
    prompt = llm.tokenizer.encode(text)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    with torch.no_grad():
        logits = hf.model(torch.tensor([prompt])).logits[0].float()
    atol, rtol = TOLERANCES["float32"]
    worst = check_within(out.prompt_logprobs, prompt, torch.log_softmax(logits, -1)[:-1],
                         atol + rtol * float(logits.abs().max()))  # fmt: skip
    print(f"SmolLM2 prompt log-probs: {len(prompt)} tokens, max abs diff vs HF {worst:.2e}")


def check_within(entries, prompt, reference, tol):
    assert entries[0] is None and len(entries) == len(prompt)
    worst = max(abs(lp - float(reference[j][t])) for j, e in enumerate(entries[1:]) for t, lp in e.items())
    assert worst <= tol, (worst, tol)
    return worst
