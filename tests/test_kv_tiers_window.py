"""KV-tier prefix hits on a model whose every layer has a sliding window (Mistral): the hits wholly before the window
of the first token to compute are probed in their tier, not read, and are holes in the table, as the pool's own hits
there are (`KVCacheManager.dead_hits`); only the blocks the window reads are read and loaded. The pool's blocks
loaded after such holes are found again through their tier chain. A model with a global layer reads and loads every
hit, as before.

The truth: transformers' `generate` and the same engine without tiers (greedy tokens), the tiers' counters (blocks
read and only probed), and exact block accounting at every step (the pool's used blocks are the distinct blocks the
tables hold, holes a leading run, every block a query of the step reads held; the pool whole after).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch

from runtime_helpers import hf_greedy, runtime_config
from test_families import WINDOW, _config
from test_kv_tiers import redis_url  # noqa: F401  (a fixture: the CI's Redis server, or one of the test's own)
from trtpaged.models import dims_from_hf_config, load_hf, step_model_from_hf
from trtpaged.runtime.kv_cache_manager import KVCacheManager
from trtpaged.runtime.kv_tiers.config import KVTierConfig
from trtpaged.runtime.kv_tiers.entry import ROOT, chain_key, engine_fingerprint
from trtpaged.runtime.kv_tiers.host import HostMemoryTier
from trtpaged.runtime.kv_tiers.stack import BlockRecord, TierHit, TierStack
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.outputs import RequestOutput
from trtpaged.runtime.runners import TorchRunner
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.runtime.sequence import Sequence

BS = 8
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# the blocks before its own that a query's window reaches (WINDOW 12, blocks of 8: 2): of 10 prefix blocks, the
# first 8 lie wholly before the window of token 80
LIVE = -(-(WINDOW - 1) // BS)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT = _prompt(1, 10 * BS + 3)  # 10 full blocks
FOLLOW_UP = PROMPT[: 10 * BS] + _prompt(9, 5)  # shares them; its first token to compute is 80
EVICTING = [_prompt(s, 10 * BS + 3) for s in (2, 3)]


class Model:
    """A tiny random family (test_families' config) with its step model, and engines over it."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.hf = load_hf(_config(family).model)
        self.dims = dims_from_hf_config(self.hf.config)
        self.step_model = step_model_from_hf(self.hf.model, self.dims)

    def engine(self, num_kv_blocks: int, tiers: Optional[KVTierConfig] = None) -> LLMEngine:
        pool = self.step_model.new_kv_cache(num_kv_blocks, BS)
        stack = None
        if tiers is not None:
            fingerprint = engine_fingerprint(model=self.family, kv_cache_dtype="float32", block_size=BS, rank=0)
            stack = tiers.build(fingerprint, pool[0].numel() * pool.element_size())
        config = runtime_config(num_kv_blocks=num_kv_blocks, block_size=BS, max_num_tokens=16, max_batch_size=4,
                                reclaim_window=self.dims.max_window)  # fmt: skip
        return LLMEngine(TorchRunner(self.step_model, pool), config, self.hf.tokenizer, [], tiers=stack)

    def greedy(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        return hf_greedy(self.hf, prompt, max_tokens, None)


@pytest.fixture(scope="module")
def mistral() -> Model:
    return Model("mistral-window")


@pytest.fixture(scope="module")
def qwen2() -> Model:
    """Qwen2 with max_window_layers 1: its first layer is global, so no block is ever left out."""
    return Model("qwen2-window")


def check_accounting(engine: LLMEngine, window: int) -> None:
    """During a step: holes are a leading run, every block a query of the step may read is held, and the pool's
    used count is exactly the distinct blocks the tables hold."""
    kv, held = engine.kv, set()
    for seq in engine.scheduler.live_seqs():
        table = kv.tables.get(seq.seq_id, [])
        holes = [j for j, b in enumerate(table) if b is None]
        assert holes == list(range(len(holes))), "holes are a leading run"
        first_read = max(0, seq.num_computed_tokens - window + 1) // BS if window else 0
        assert all(b is not None for b in table[first_read:]), "a block the window reads is a hole"
        held |= {b.block_id for b in table if b is not None}
    assert kv.pool.num_used == len(held)


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
    """Runs the requests to the end, checking the block accounting before every step."""
    original = engine.runner.step

    def step(batch):
        check_accounting(engine, engine.config.reclaim_window)
        return original(batch)

    engine.runner.step = step
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    engine.runner.step = original
    return [done[i] for i in ids]


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(c.token_ids) for out in outputs for c in out.outputs]


def evict_prompt_into_tier(engine: LLMEngine) -> None:
    """PROMPT computed, then pushed out of the pool into the tier by other prompts."""
    run(engine, [(PROMPT, GREEDY)])
    for prompt in EVICTING:
        run(engine, [(prompt, GREEDY)])
    engine.kv.tiers.flush()


def deltas(engine: LLMEngine, before: dict, tier: str) -> dict[str, float]:
    after = engine.stats()
    names = {"read": f"kv_tier_{tier}_hits", "probed": f"kv_tier_{tier}_probes", "loaded": "kv_tier_blocks_loaded",
             "tier_hit_tokens": "prefix_cache_tier_hits_tokens", "hit_tokens": "prefix_cache_hits_tokens",
             "computed": "num_tokens_computed"}  # fmt: skip
    return {name: after[key] - before[key] for name, key in names.items()}


def assert_pool_whole(engine: LLMEngine) -> None:
    kv = engine.kv
    assert kv.pool.num_free == kv.pool.num_kv_blocks and all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv.tables and not kv._loads and kv.staged_blocks() == 0


def tier_config(tier: str, tmp_path: Path, request) -> KVTierConfig:
    """One tier alone: host memory, a disk directory, or a Redis server (skipped where there is none)."""
    if tier == "host":
        return KVTierConfig(host_memory=1 << 22)
    if tier == "disk":
        return KVTierConfig(disk_path=str(tmp_path), disk_size=1 << 22)
    if shutil.which("redis-server") is None or importlib.util.find_spec("redis") is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh installs it)")
    return KVTierConfig(remote=request.getfixturevalue("redis_url"))


# ---- the engine -------------------------------------------------------------------------------
@pytest.mark.parametrize("tier", ["host", "disk", "remote"])
def test_tier_hits_before_the_window_are_probed_not_read_nor_loaded(mistral, tier, tmp_path: Path, request):
    """FOLLOW_UP finds PROMPT's 10 blocks in the tier: the 2 its window reads are read and loaded, the 8 before it
    are only probed (was: all 10 read and loaded), all 80 tokens count as cached, and its tokens are the reference's
    (transformers', and the engine's without tiers)."""
    reference = tokens(run(mistral.engine(16), [(FOLLOW_UP, GREEDY)]))
    assert reference == [mistral.greedy(FOLLOW_UP)]
    engine = mistral.engine(16, tier_config(tier, tmp_path, request))
    evict_prompt_into_tier(engine)
    before = engine.stats()
    assert tokens(run(engine, [(FOLLOW_UP, GREEDY)])) == reference
    assert deltas(engine, before, tier) == {"read": LIVE, "probed": 10 - LIVE, "loaded": LIVE, "tier_hit_tokens": 80,
                                            "hit_tokens": 80, "computed": len(FOLLOW_UP) - 80 + MAX_TOKENS - 1}
    assert_pool_whole(engine)
    engine.close()


def test_a_tier_prefix_longer_than_the_pool_is_restored_not_refused(mistral):
    """An 8-block pool: FOLLOW_UP's 10 tier hits were all loaded, so its plan took more blocks than the pool and it
    was refused (no token); it takes only the window's 2 now."""
    engine = mistral.engine(8, KVTierConfig(host_memory=1 << 22))
    evict_prompt_into_tier(engine)
    before = engine.stats()
    assert tokens(run(engine, [(FOLLOW_UP, GREEDY)])) == [mistral.greedy(FOLLOW_UP)]
    assert deltas(engine, before, "host")["loaded"] == LIVE
    assert_pool_whole(engine)
    engine.close()


def test_blocks_loaded_after_holes_are_found_again_and_the_tier_chain_goes_on(mistral):
    """A conversation: turn 2 restores PROMPT's window from the tier after 8 holes; turn 3 (turn 2 and its answer
    and more) finds turn 2's blocks in the pool through their tier chain (was, with holes and no such lookup:
    recomputed), reading and loading nothing. Written back, the blocks are in the tier under the keys chained over
    every token, holes included."""
    engine = mistral.engine(24, KVTierConfig(host_memory=1 << 22))
    evict_prompt_into_tier(engine)
    turn2 = PROMPT[: 10 * BS] + _prompt(9, 40)
    (answer,) = tokens(run(engine, [(turn2, GREEDY)]))
    assert answer == mistral.greedy(turn2)
    turn3 = turn2 + answer + _prompt(11, 20)
    before = engine.stats()
    assert tokens(run(engine, [(turn3, GREEDY)])) == [mistral.greedy(turn3)]
    cached = (len(turn2) + MAX_TOKENS - 1) // BS * BS  # turn 2's full blocks
    moved = deltas(engine, before, "host")
    assert moved["read"] == moved["loaded"] == 0 and moved["hit_tokens"] == cached
    assert moved["computed"] == len(turn3) - cached + MAX_TOKENS - 1
    assert engine.reset_prefix_cache()  # the pool's cached blocks go to the tier first
    engine.kv.tiers.flush()
    (host,) = engine.kv.tiers.tiers
    fp, parent, conversation = engine.kv.tiers.fingerprint, ROOT, turn3 + [0]
    for j in range(cached // BS):
        parent = chain_key(fp, parent, conversation[j * BS : (j + 1) * BS])
        assert host.contains(parent), f"block {j} is not in the tier under its chained key"
    assert_pool_whole(engine)
    engine.close()


def test_requests_preempted_and_recomputed_over_tier_hits_equal_transformers(mistral):
    """An 8-block pool and two requests sharing the tier prefix, one with two samples: the other is preempted and
    recomputed; every completion is transformers' and no block is left over."""
    engine = mistral.engine(8, KVTierConfig(host_memory=1 << 22))
    evict_prompt_into_tier(engine)
    prompts = [FOLLOW_UP, PROMPT[: 10 * BS] + _prompt(10, 7)]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, n=n) for n in (2, 1)]
    outputs = run(engine, list(zip(prompts, params)))
    assert tokens(outputs) == [mistral.greedy(prompts[0], 30)] * 2 + [mistral.greedy(prompts[1], 30)]
    assert engine.stats()["num_preemptions"] > 0
    assert_pool_whole(engine)
    engine.close()


def test_a_model_with_a_global_layer_reads_and_loads_every_tier_hit(qwen2):
    engine = qwen2.engine(16, KVTierConfig(host_memory=1 << 22))
    assert engine.config.reclaim_window == 0
    evict_prompt_into_tier(engine)
    before = engine.stats()
    assert tokens(run(engine, [(FOLLOW_UP, GREEDY)])) == [qwen2.greedy(FOLLOW_UP)]
    assert deltas(engine, before, "host") == {"read": 10, "probed": 0, "loaded": 10, "tier_hit_tokens": 80,
                                              "hit_tokens": 80, "computed": len(FOLLOW_UP) - 80 + MAX_TOKENS - 1}
    assert_pool_whole(engine)
    engine.close()


# ---- the manager, block by block ---------------------------------------------------------------
def _manager(window: int) -> KVCacheManager:
    """Blocks of 4 tokens; a host tier holding blocks 0..9 of TOKENS (payload: the block's index), the pool blocks
    0 and 1 (cached, free)."""
    fp = engine_fingerprint(model="window test")
    kv = KVCacheManager(16, 4, tiers=TierStack([HostMemoryTier(1 << 20)], fp, background=False),
                        reclaim_window=window)  # fmt: skip
    parent = ROOT
    for j in range(10):
        record = BlockRecord(chain_key(fp, parent, TOKENS[4 * j : 4 * j + 4]), parent, tuple(TOKENS[4 * j : 4 * j + 4]))
        kv.tiers.tiers[0].put_block(record, bytes([j]) * 8)
        parent = record.key
    first = Sequence(100, TOKENS[:9])
    kv.allocate(kv.plan_allocation([(first, 9, [])]))
    first.num_computed_tokens = 9
    kv.cache_computed_blocks(first)
    kv.free(first)
    return kv


TOKENS = list(range(1, 45))  # 11 blocks of 4: the prefix may cover 10


def _admit(kv: KVCacheManager, seq: Sequence) -> tuple[list, int]:
    """Prefetches and allocates the sequence as the scheduler does; (its hits, the blocks its plan took)."""
    assert kv.prefetch(seq)
    hits = kv.find_cached_prefix(seq)
    plan = kv.plan_allocation([(seq, len(seq.token_ids) - len(hits) * 4, hits)])
    kv.allocate(plan)
    seq.num_computed_tokens = len(hits) * 4
    return hits, plan.num_kv_blocks


def _counters(kv: KVCacheManager) -> tuple[int, int]:
    counters = kv.tiers.tiers[0].counters
    return counters.hits, counters.probes


def test_pool_and_tier_hits_before_the_window_are_holes_and_the_chain_resumes_after_them():
    """Pool hits 0-1 and tier hits 2-9, window 12 (the first token to compute, 40, reads blocks 7-9): blocks 0-6
    are holes (the tier ones probed, not read, staging only 7-9), 7-9 are loaded, the plan takes those 3 and the new
    block 10; block 7, after a hole, is cached under its tier parent key, so a second sequence finds 7-9 (and the
    holes before them probed again) with no read nor load. The tier keys go on over the holes."""
    kv = _manager(window=12)
    seq = Sequence(1, TOKENS[:41])
    assert kv.prefetch(seq) and kv.staged_blocks() == 3
    hits, taken = _admit(kv, seq)
    assert [type(h).__name__ for h in hits] == ["KVBlock"] * 2 + ["TierHit"] * 8
    assert [h.payload is None for h in hits[2:]] == [True] * 5 + [False] * 3
    assert _counters(kv) == (3, 5) and taken == 3 + 1
    table = kv.tables[seq.seq_id]
    assert table[:7] == [None] * 7 and all(b is not None for b in table[7:]) and kv.pool.num_used == 4
    assert sorted(kv.take_tier_transfers()[1]) == [(table[j].block_id, bytes([j]) * 8) for j in (7, 8, 9)]
    assert [kv._records[table[j].block_id].key for j in (7, 8, 9)] == kv._tier_keys[seq.seq_id][7:10]
    seq.token_ids += TOKENS[41:44]  # block 10 computed in full
    seq.num_computed_tokens = 44
    kv.cache_computed_blocks(seq)
    parent = kv._tier_keys[seq.seq_id][9]
    assert kv._records[table[10].block_id] == BlockRecord(chain_key(kv.tiers.fingerprint, parent, TOKENS[40:44]),
                                                          parent, tuple(TOKENS[40:44]))  # fmt: skip
    other = Sequence(2, TOKENS[:41])
    hits, taken = _admit(kv, other)
    assert [type(h).__name__ for h in hits] == ["KVBlock"] * 2 + ["TierHit"] * 5 + ["KVBlock"] * 3
    assert _counters(kv) == (3, 10) and taken == 1  # 7-9 shared with the first sequence, one new block
    assert kv.tables[other.seq_id][7:10] == table[7:10] and kv.pool.num_used == 5
    for s in (seq, other):
        kv.free(s)
    assert kv.pool.num_free == 16


def test_a_run_that_ends_early_reads_the_probed_hits_its_window_then_needs():
    """The tier lacks block 8, so the run ends after block 7 and the first token to compute is 32, whose window (12)
    reads blocks 5-7: the load probed 2-6 while it assumed the whole run (window of 40: blocks 7-9), so it reads 5 and
    6 once the run's end is known (`TierStack._settle`); 2-4 stay holes, and the plan takes 3 loads and 3 new blocks."""
    kv = _manager(window=12)
    host = kv.tiers.tiers[0]
    missing = next(key for key, (record, _, _) in host._blocks.items() if record.tokens == tuple(TOKENS[32:36]))
    del host._blocks[missing]
    seq = Sequence(1, TOKENS[:41])
    hits, taken = _admit(kv, seq)
    assert [type(h).__name__ for h in hits] == ["KVBlock"] * 2 + ["TierHit"] * 6
    assert [h.payload is None for h in hits[2:]] == [True] * 3 + [False] * 3
    assert _counters(kv) == (3, 5) and taken == 3 + 3  # reads 7, then 5 and 6; probe lookups 2-6
    table = kv.tables[seq.seq_id]
    assert table[:5] == [None] * 5 and all(b is not None for b in table[5:])
    assert sorted(kv.take_tier_transfers()[1]) == [(table[j].block_id, bytes([j]) * 8) for j in (5, 6, 7)]
    kv.free(seq)
    assert kv.pool.num_free == 16


def test_the_last_pool_hit_stays_the_chain_parent_of_a_tier_hit_inside_the_window():
    """Window 30: the first token to compute, 40, reads blocks 2-9, the tier's 8, all read and loaded; pool block 1
    is kept (their chain parent in the pool) and block 0 is a hole, so a later lookup walks the pool's chain."""
    kv = _manager(window=30)
    seq = Sequence(1, TOKENS[:41])
    hits, taken = _admit(kv, seq)
    assert _counters(kv) == (8, 0) and taken == 1 + 8 + 1
    assert kv.tables[seq.seq_id][0] is None and kv.tables[seq.seq_id][1] is hits[1]
    assert len(kv._pool_run(Sequence(2, TOKENS[:41]))) == 10
    kv.free(seq)
    assert kv.pool.num_free == 16


def test_a_recomputed_group_sharing_blocks_reads_every_tier_hit():
    """`shared` (a recomputed group's sequences share blocks again): another sequence may take blocks before this
    one's window, so every tier hit is read, and the run leaves the last two tokens."""
    kv = _manager(window=12)
    seq = Sequence(1, TOKENS[:41])
    assert kv.prefetch(seq, shared=True)
    hits = kv.find_cached_prefix(seq, shared=True)
    assert len(hits) == 9 and all(h.payload is not None for h in hits if isinstance(h, TierHit))
    assert _counters(kv) == (7, 0)
