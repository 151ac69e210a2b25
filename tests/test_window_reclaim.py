"""Block reclamation for a model whose every layer has a sliding window (Mistral-style): blocks wholly
before a sequence's window go back to the pool as it advances. Checked against transformers' generate
(nothing a window still reads was freed or overwritten) and by exact block accounting at every step."""

from __future__ import annotations

import pytest
import torch

from runtime_helpers import hf_greedy, run_staggered, runtime_config, step_engine
from trtpaged.config import parse_config
from trtpaged.models import load_hf
from trtpaged.runtime.kv_cache_manager import KVCacheManager
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.errors import RequestError
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.runtime.sequence import Sequence

WINDOW, BLOCK, EOS, MAX_TOKENS = 12, 8, 257, 40


@pytest.fixture(scope="module")
def hf():
    tiny = {"architecture": "MistralForCausalLM", "sliding_window": WINDOW, "num_hidden_layers": 2, "head_dim": 16}
    return load_hf(parse_config({"model": {"tiny": tiny}}).model)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(9)
    system = torch.randint(0, 256, (29,), generator=g).tolist()
    return [system + torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 30, 7)] + [[5, 6, 7]]


@pytest.fixture(scope="module")
def reference(hf, prompts):
    return [hf_greedy(hf, p, MAX_TOKENS, None) for p in prompts]


def _engine(hf, reclaim: bool, **kw) -> LLMEngine:
    config = runtime_config(num_kv_blocks=kw.pop("num_kv_blocks", 48), block_size=BLOCK,
                            max_num_tokens=kw.pop("max_num_tokens", 16), reclaim_window=WINDOW if reclaim else 0, **kw)
    return LLMEngine(step_engine(hf, config), config, hf.tokenizer, [EOS])


def _check_accounting(engine: LLMEngine, batch) -> None:
    """During a step: every block a query of the step may read is held, each reclaimed entry is one the
    sequence's window has passed, and the pool's used count is exactly the distinct blocks the tables hold."""
    kv = engine.kv
    held = set()
    for seq in engine.scheduler.live_seqs():
        table = kv.tables.get(seq.seq_id, [])
        first_needed = max(0, seq.num_computed_tokens - WINDOW + 1) // BLOCK  # this step's first query
        assert all(b is not None for b in table[first_needed:]), "a block the window reads was reclaimed"
        dead = [j for j, b in enumerate(table) if b is None]
        assert dead == list(range(len(dead))), "reclaimed entries are a leading run"
        held |= {b.block_id for b in table if b is not None}
    assert kv.pool.num_used == len(held)
    assert kv.pool.num_free + kv.pool.num_used == kv.pool.num_kv_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_equals_hf_with_reclamation_and_exact_accounting(hf, prompts, reference, caching):
    engine = _engine(hf, reclaim=True, enable_prefix_caching=caching)
    original = engine.runner.step

    def step(batch):
        _check_accounting(engine, batch)
        return original(batch)

    engine.runner.step = step
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = run_staggered(engine, [(p, params) for p in prompts], 3)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    stats = engine.stats()
    assert stats["kv_blocks_reclaimed"] > 0
    assert engine.kv.pool.num_free == engine.config.num_kv_blocks  # none leaked
    if caching:
        assert stats["prefix_cache_hits_tokens"] >= 2 * 24  # the system prompt's 3 full blocks, twice


def test_reclamation_lowers_the_peak_and_keeps_outputs(hf, prompts, reference):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    peaks = {}
    for reclaim in (False, True):
        engine = _engine(hf, reclaim=reclaim)
        outputs = run_staggered(engine, [(p, params) for p in prompts], 1)
        assert [o.outputs[0].token_ids for o in outputs] == reference
        peaks[reclaim] = engine.kv.pool.peak_used
    # with: each sequence holds its window, a 16-token chunk's blocks and the prefix chain's parent at most
    assert peaks[True] <= 4 * ((WINDOW - 1 + 16) // BLOCK + 3) < peaks[False]


def test_a_pool_too_small_for_one_whole_sequence_still_generates_it(hf, prompts, reference):
    """31 + 40 tokens need 9 blocks; a windowed model needs only those its window covers."""
    engine = _engine(hf, reclaim=True, num_kv_blocks=6, max_batch_size=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = run_staggered(engine, [(prompts[0], params)], 1)
    assert outputs[0].outputs[0].token_ids == reference[0]
    assert engine.stats()["num_preemptions"] == 0


@pytest.mark.parametrize("caching", [True, False])
def test_a_prompt_longer_than_the_pool_runs_on_a_windowed_engine(hf, caching):
    """A windowed engine holds a prompt's window and one chunk at a time, so a prompt of more blocks than the pool
    is served (it was refused as needing every block at once), equal to HF, the pool whole after; a pool smaller
    than a window and a chunk need is still refused up front."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 200)]
    engine = _engine(hf, reclaim=True, num_kv_blocks=6, max_batch_size=2, enable_prefix_caching=caching)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outputs = run_staggered(engine, [(p, params) for p in prompts], 1)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p, 20, None) for p in prompts]
    assert engine.kv.pool.num_free == 6
    small = _engine(hf, reclaim=True, num_kv_blocks=5)
    with pytest.raises(RequestError, match="more than the whole pool"):
        small.add_request(prompts[1], params)


def test_reclaim_frees_shared_blocks_once_per_table_and_keeps_the_chain_parent():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, reclaim_window=5)
    seq = Sequence(0, list(range(30)))
    plan = kv.plan_allocation([(seq, 30, [])])
    kv.allocate(plan)
    seq.num_computed_tokens = 30
    kv.cache_computed_blocks(seq)
    assert kv.reclaim(seq) == 6  # positions < 26 are outside the next token's window: blocks 0..5
    assert kv.block_table(seq)[:6] == [0] * 6 and kv.pool.num_used == 2
    child = Sequence(1, list(range(30)))
    child.num_computed_tokens = 30
    kv.fork(seq, child)
    assert kv.pool.num_used == 2  # the child shares the two held blocks
    seq.token_ids += [1, 2, 3]
    seq.num_computed_tokens = 33
    assert kv.reclaim(seq) == 0  # block 6 (24..27) is passed, but block 7 is not cached yet: its parent stays
    kv.free(seq)
    kv.free(child)
    assert kv.pool.num_free == 16
    with pytest.raises(ValueError, match="reclaim_window"):
        KVCacheManager(4, 4, reclaim_window=-1)


def test_memory_plan_shows_sequences_that_fit_with_and_without_reclamation():
    from trtpaged.memory_plan import MemoryPlan

    plan = MemoryPlan(bytes_per_token=1024, bytes_per_block=16384, block_size=16, max_seq_len=8192, max_batch_size=512,
                      budget_rule="num_kv_blocks 4096", num_kv_blocks=4096, layer_windows=(1024,) * 4)
    text = "\n".join(plan.lines(8192))
    # 8192 tokens: 512 blocks each with the full table (8 fit); 1024 / 16 + 2 = 66 reclaimed (62 fit)
    assert "62 reclaimed (66 blocks each) vs 8 with the full table (512 blocks each)" in text
    interleaved = MemoryPlan(bytes_per_token=1024, bytes_per_block=16384, block_size=16, max_seq_len=8192,
                             max_batch_size=512, budget_rule="num_kv_blocks 4096", num_kv_blocks=4096,
                             layer_windows=(1024, 1024, 1024, 0))
    text = "\n".join(interleaved.lines(8192))
    # (3 * 66 + 512) / (4 * 512) = 34.7% of the full table: 23 sequences instead of 8, not taken
    assert "would hold 35% of it at 8192 tokens: 23 sequences instead of 8 (not taken)" in text


def test_bench_memory_window_comparison_on_a_long_output_trace():
    from trtpaged.bench.memory_bench import Budget, format_window_table, run_window_comparison
    from trtpaged.bench.workload import TraceRequest

    trace = [TraceRequest(prompt_len=64, output_len=600, arrival=0) for _ in range(12)]
    budget = Budget(num_kv_blocks=160, block_size=16, max_seq_len=1024, max_batch_size=12, max_num_tokens=256)
    rows = run_window_comparison(trace, budget, window=64)
    full, reclaimed = rows
    # full table: 42 blocks a sequence at the end, 3 fit, the rest preempted; reclaimed: 6 blocks each, all 12 run
    assert reclaimed["preemptions"] == 0 < full["preemptions"]
    assert reclaimed["mean_running"] > 11 > 2 * full["mean_running"]
    assert reclaimed["steps"] < full["steps"]
    assert "returned to the pool" in format_window_table(rows, 64)


def _hf_logprobs(hf, prompt: list[int], output: list[int]) -> list[float]:
    """Each output token's log-prob in transformers' forward over the whole sequence."""
    with torch.no_grad():
        logits = hf.model(torch.tensor([prompt + output])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return [float(row[t]) for row, t in zip(rows, output)]


@pytest.mark.parametrize("caching", [True, False])
def test_a_recomputed_group_shares_blocks_its_first_sequence_has_not_reclaimed(hf, prompts, caching):
    """Samples of a preempted n=3 request recompute; the first computes its history in one chunk and would reclaim
    the blocks behind its window before the others take them (was: they took holes, and their windows read
    another block's K/V: log-probs 0.2-0.4 off transformers'). Each sample's log-probs are transformers' on its
    own tokens, every step's accounting is exact, and the pool ends whole."""
    engine = _engine(hf, reclaim=True, num_kv_blocks=10, max_num_tokens=64, enable_prefix_caching=caching)
    original = engine.runner.step

    def step(batch):
        _check_accounting(engine, batch)
        return original(batch)

    engine.runner.step = step
    params = SamplingParams(max_tokens=30, temperature=1.0, n=3, seed=4, ignore_eos=True, logprobs=0)
    outputs = run_staggered(engine, [(p, params) for p in prompts[:3]], 1)
    assert engine.stats()["num_preemptions"] > 0 and engine.stats()["kv_blocks_reclaimed"] > 0
    for prompt, out in zip(prompts, outputs):
        for c in out.outputs:
            assert len(c.token_ids) == 30
            got = [entry[t] for t, entry in zip(c.token_ids, c.logprobs)]
            assert got == pytest.approx(_hf_logprobs(hf, prompt, c.token_ids), abs=1e-4)
    assert engine.kv.pool.num_free == engine.config.num_kv_blocks


def test_swap_preemption_keeps_the_reclaimed_holes(hf, prompts, reference):
    """Swapping out a sequence whose table has reclaimed entries moves the held blocks and keeps the holes (was:
    AttributeError on the first hole, out of engine.step)."""
    engine = _engine(hf, reclaim=True, num_kv_blocks=10, max_num_tokens=64, preemption_mode="swap", num_host_blocks=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = run_staggered(engine, [(p, params) for p in prompts], 1)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert engine.stats()["num_swap_outs"] > 0 and engine.stats()["kv_blocks_reclaimed"] > 0
    assert engine.kv.pool.num_free == engine.config.num_kv_blocks


def _step_all(engine: LLMEngine, arrivals) -> tuple[list[list[int]], list[str], list[int]]:
    """arrivals: (step, prompt, max_tokens), each added before that step; steps (checking the accounting during
    each) until all finish. (Tokens and finish reason of each, the pool's used blocks after each step.)"""
    original = engine.runner.step

    def step(batch):
        _check_accounting(engine, batch)
        assert engine.kv.pool.num_used <= engine.config.num_kv_blocks
        return original(batch)

    engine.runner.step = step
    pending, ids, done, used = sorted(arrivals, key=lambda a: a[0]), [], {}, []
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= len(used):
            _, prompt, max_tokens = pending.pop(0)
            ids.append(engine.add_request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                       ignore_eos=True)))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        used.append(engine.kv.pool.num_used)
    return [list(done[i].token_ids) for i in ids], [done[i].finish_reason for i in ids], used


def test_prefix_hits_before_the_window_are_holes_not_taken(hf):
    """A 48-token prompt computed and finished leaves its 6 blocks cached in a 6-block pool; the same 48 tokens + 8
    pass the window bound (6 blocks) but adopting all 6 hits and a new block would pass the pool (was: finished
    'length' with no token). The hits wholly before the window of its first token to compute (position 48) are holes
    in its table at once, not taken off the free queue: it generates transformers' tokens, within the pool."""
    engine = _engine(hf, reclaim=True, num_kv_blocks=6, max_batch_size=2, enable_prefix_caching=True)
    shared = [(7 * i + 3) % 250 + 2 for i in range(48)]
    second = shared + [11, 22, 33, 44, 55, 66, 77, 88]
    adopted = engine.kv._adopt_hits
    holes = []

    def adopt(seq, hits, dead=0):
        adopted(seq, hits, dead)
        holes.append((len(hits), engine.kv.tables[seq.seq_id].count(None)))

    engine.kv._adopt_hits = adopt
    tokens, reasons, used = _step_all(engine, [(0, shared, 1), (5, second, 10)])
    assert tokens == [hf_greedy(hf, shared, 1, None), hf_greedy(hf, second, 10, None)]
    assert reasons == ["length", "length"] and max(used) <= 6 and used[-1] == 0
    # 6 hits, window of position 48 starts at 37 (block 4): blocks 0-3 are holes, 4 (and 5, the chain parent) taken
    assert holes == [(6, 4)]
    assert engine.stats()["prefix_cache_hits_tokens"] == 48
    assert engine.kv.pool.num_free == 6


def test_a_preempted_request_is_recomputed_in_chunks_that_fit_the_pool(hf):
    """Two identical 30-token prompts (17 and 25 tokens out) on a 5-block pool, one chunk up to 512 tokens: the newer
    is preempted after 11 outputs; recomputed (prompt + outputs: 41 tokens) as one chunk it needs 6 blocks, more than
    the pool (was: finished 'length' with 11 of 25 tokens). It is recomputed in chunks of at most
    max(min(prompt, max_num_tokens), (pool - 2) * block_size - window) = 30 tokens: transformers' tokens, whole."""
    engine = _engine(hf, reclaim=True, num_kv_blocks=5, max_num_tokens=512, max_batch_size=4,
                     enable_prefix_caching=True)
    prompt = [(7 * i + 3) % 250 + 2 for i in range(30)]
    tokens, reasons, used = _step_all(engine, [(0, prompt, 17), (0, prompt, 25)])
    assert tokens == [hf_greedy(hf, prompt, 17, None), hf_greedy(hf, prompt, 25, None)]
    assert reasons == ["length", "length"] and max(used) <= 5 and used[-1] == 0
    assert engine.stats()["num_preemptions"] > 0 and engine.kv.pool.num_free == 5


def test_recompute_cap_leaves_a_prompt_chunk_and_non_windowed_engines_alone():
    from trtpaged.runtime.scheduler import recompute_cap, split_tokens

    c = runtime_config(num_kv_blocks=5, block_size=BLOCK, max_num_tokens=512, reclaim_window=WINDOW)
    assert recompute_cap(c, 30) == 30 and recompute_cap(c, 3) == (5 - 2) * BLOCK - WINDOW
    assert split_tokens([41], 512, 4, caps=[30]) == ([30], False)
    assert split_tokens([41], 512, 4) == ([41], True)
    assert split_tokens([30], 512, 4, caps=[30]) == ([30], True)
