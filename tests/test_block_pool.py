"""Block pool and KV-cache manager: exact block orders, LRU eviction, prefix hits, copy-on-write, swap."""

from __future__ import annotations

import pytest
import torch

from trtpaged.runtime.block_pool import BlockPool, chain_hash
from trtpaged.runtime.block_pool import FreeBlockQueue
from trtpaged.runtime.block_pool import KVBlock
from trtpaged.runtime.kv_cache_manager import KVCacheManager
from trtpaged.runtime.sequence import Sequence

BS = 4


def ids(blocks):
    return [b.block_id for b in blocks]


def seq(seq_id, tokens):
    return Sequence(seq_id, list(tokens))


def compute(kv, s, n, hits=()):
    """Allocates and 'runs' one step of n tokens for s; returns the copies."""
    copies = kv.allocate(kv.plan_allocation([(s, n, hits)]))
    s.num_computed_tokens = (len(hits) * BS if hits else s.num_computed_tokens) + n  # as the scheduler does
    kv.cache_computed_blocks(s)
    return copies


def _blocks_needed(kv, requests) -> int:
    return kv.plan_allocation(requests).num_kv_blocks


def test_free_queue_o1_ops():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    q.appendleft(blocks[2])
    assert q.popleft() is blocks[2]
    q.append(blocks[2])
    assert ids(q) == [0, 1, 3, 4, 2]
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[2])
    for _ in range(5):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_allocate_free_exact_order_and_refcounts():
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert ids(a) == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    assert pool.num_free == 3 and pool.num_used == 3
    pool.free(a[::-1])  # uncached blocks go to the front: reused first
    assert ids(pool.free_queue) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(RuntimeError, match="ref_cnt 0"):
        pool.free([a[0]])
    with pytest.raises(RuntimeError, match="7 blocks requested, 6 free"):
        pool.allocate(7)


def test_cached_blocks_evicted_lru_last():
    kv = KVCacheManager(num_kv_blocks=6, block_size=BS)
    s = seq(0, range(9))  # two full blocks + 1 token
    compute(kv, s, 9)
    assert kv.block_table(s) == [0, 1, 2] and kv.pool.num_cached == 2
    assert _blocks_needed(kv, [(seq(9, range(8)), 1, ())]) == 1
    kv.free(s)
    # the uncached tail goes to the front; cached blocks to the back, chain tail first
    assert ids(kv.pool.free_queue) == [2, 3, 4, 5, 1, 0]
    t = seq(1, [100 + i for i in range(17)])
    compute(kv, t, 17)  # needs 5 blocks: evicts block 1 (LRU), keeps block 0
    assert kv.block_table(t) == [2, 3, 4, 5, 1]
    assert kv.pool.num_evictions == 1
    # block 0 is still cached but its child was evicted: a hit stops after one block
    u = seq(2, list(range(8)) + [7, 7])
    hits = kv.find_cached_prefix(u)
    assert ids(hits) == [0]


def test_prefix_hit_shares_blocks_and_counts():
    kv = KVCacheManager(num_kv_blocks=16, block_size=BS)
    system = list(range(10, 22))  # three full blocks
    a, b = seq(0, system + [1, 2]), seq(1, system + [3])
    compute(kv, a, 14)
    hits = kv.find_cached_prefix(b)
    assert ids(hits) == kv.block_table(a)[:3]
    assert _blocks_needed(kv, [(b, 1, hits)]) == 1
    compute(kv, b, 1, hits)
    assert b.num_computed_tokens == 13
    assert kv.block_table(b)[:3] == kv.block_table(a)[:3]
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_table(a)[:3]] == [2, 2, 2]
    assert kv.prefix_hits_tokens == 12
    assert kv.stats([a, b])["kv_blocks_saved_by_sharing"] == 3


def test_last_token_never_a_hit():
    kv = KVCacheManager(num_kv_blocks=8, block_size=BS)
    a = seq(0, range(8))
    compute(kv, a, 8)
    hits = kv.find_cached_prefix(seq(1, range(8)))  # identical prompt: the last block is recomputed
    assert len(hits) == 1


def test_hash_collisions_never_return_wrong_blocks():
    kv = KVCacheManager(num_kv_blocks=16, block_size=BS, hash_fn=lambda parent, tokens: 0)
    a = seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(kv, a, 9)
    # same second block, different first block: every hash collides, yet nothing may match
    hits = kv.find_cached_prefix(seq(1, [9, 9, 9, 9, 5, 6, 7, 8, 9]))
    assert hits == []
    hits = kv.find_cached_prefix(seq(2, [1, 2, 3, 4, 5, 6, 7, 8, 1]))
    assert ids(hits) == kv.block_table(a)[:2]


@pytest.mark.parametrize("hash_fn", [chain_hash, lambda parent, tokens: 0], ids=["chain_hash", "every_hash_collides"])
def test_cache_salt_shares_blocks_only_under_the_same_salt(hash_fn):
    """vLLM's cache_salt: a prompt's cached blocks are hits for the same prompt under the same salt (unsalted: for
    unsalted ones) and for no other salt, even when every hash collides (the salt is the first block's parent)."""
    kv = KVCacheManager(num_kv_blocks=32, block_size=BS, hash_fn=hash_fn)
    prompt = list(range(10, 23))  # three full blocks + 1 token
    owners = {}
    for salt in ("tenant-a", None, "tenant-b"):
        owner = Sequence(len(owners), prompt, cache_salt=salt)
        assert kv.find_cached_prefix(owner) == []  # nothing cached under this salt yet
        compute(kv, owner, 13)
        owners[salt] = owner
    assert kv.pool.num_cached == 3 * 3 and kv.pool.num_used == 3 * 4
    tables = {salt: kv.block_table(s) for salt, s in owners.items()}
    assert len({b for t in tables.values() for b in t}) == 3 * 4  # no block shared across salts
    for k, salt in enumerate(("tenant-a", None, "tenant-b")):
        again = Sequence(10 + k, prompt, cache_salt=salt)
        hits = kv.find_cached_prefix(again)
        assert ids(hits) == tables[salt][:3]
        assert _blocks_needed(kv, [(again, 1, hits)]) == 1  # only its last block is new
        compute(kv, again, 1, hits)
        assert kv.block_table(again)[:3] == tables[salt][:3]
    for salt in ("tenant-c", "Tenant-a", "tenant-a "):  # an unknown salt, or one that is almost another
        stranger = Sequence(99, prompt, cache_salt=salt)
        assert kv.find_cached_prefix(stranger) == [] and _blocks_needed(kv, [(stranger, 13, ())]) == 4
    assert kv.prefix_hits_tokens == 3 * 3 * BS
    assert kv.stats(list(owners.values()))["kv_blocks_saved_by_sharing"] == 3 * 3
    # a fork (n samples, beams) keeps its parent's salt, and so caches under it
    child = owners["tenant-a"].fork(50, 1)
    assert child.cache_salt == "tenant-a"


def test_stale_parent_after_eviction_cannot_match():
    kv = KVCacheManager(num_kv_blocks=3, block_size=BS)
    a = seq(0, [1, 1, 1, 1, 2, 2, 2, 2, 3])
    compute(kv, a, 9)
    kv.free(a)
    b = seq(1, [5, 5, 5, 5, 5])  # takes the uncached tail block, then evicts block 1 (LRU)
    compute(kv, b, 5)
    hits = kv.find_cached_prefix(seq(2, [1, 1, 1, 1, 2, 2, 2, 2, 3]))
    assert ids(hits) == [0]  # block 0 survived; its child did not


def test_fork_and_copy_on_write_with_torch_indexing():
    kv = KVCacheManager(num_kv_blocks=8, block_size=BS)
    pool = torch.zeros(8, 2)
    parent = seq(0, range(6))
    compute(kv, parent, 6)
    pool[kv.block_table(parent)[1]] = 7.0  # the partly filled block's content
    children = [parent.fork(i, i) for i in (1, 2, 3)]
    for c in children:
        kv.fork(parent, c)
    shared = kv.block_table(parent)[1]
    assert kv.pool.blocks[shared].ref_cnt == 4
    for s in [parent] + children:
        s.token_ids.append(99)
    requests = [(s, 1, ()) for s in [parent] + children]
    assert _blocks_needed(kv, requests) == 3  # the last writer keeps the original
    free_before = kv.pool.num_free
    copies = kv.allocate(kv.plan_allocation(requests))
    assert kv.pool.num_free == free_before - 3
    assert [src for src, _ in copies] == [shared] * 3
    for src, dst in copies:
        pool[dst] = pool[src]
    tables = [kv.block_table(s) for s in [parent] + children]
    assert len({t[1] for t in tables}) == 4 and len({t[0] for t in tables}) == 1
    assert all(float(pool[t[1]][0]) == 7.0 for t in tables)
    assert kv.pool.blocks[shared].ref_cnt == 1


def test_the_plan_is_exact_with_hits_in_free_queue():
    kv = KVCacheManager(num_kv_blocks=4, block_size=BS)
    a = seq(0, range(9))
    compute(kv, a, 9)
    kv.free(a)
    b = seq(1, list(range(8)) + [50, 51, 52, 53, 54, 55, 56, 57])
    hits = kv.find_cached_prefix(b)
    need = _blocks_needed(kv, [(b, 8, hits)])
    assert need == 4  # two hits taken off the free queue + two new blocks
    assert _blocks_needed(kv, [(b, 8, hits)]) <= kv.pool.num_free
    compute(kv, b, 8, hits)
    assert kv.pool.num_free == 0
    c = seq(2, range(100, 101))
    assert _blocks_needed(kv, [(c, 1, ())]) > kv.pool.num_free


def test_swap_out_and_in_keeps_sharing():
    kv = KVCacheManager(num_kv_blocks=8, block_size=BS, num_host_blocks=8)
    p = seq(0, range(6))
    compute(kv, p, 6)
    c = p.fork(1, 1)
    kv.fork(p, c)
    pairs = kv.swap_out([p, c])
    assert len(pairs) == 2 and kv.pool.num_free == 8 and kv.host_pool.num_free == 6
    assert kv.can_swap_in([p, c])
    back = kv.swap_in([p, c])
    assert len(back) == 2 and kv.block_table(p) == kv.block_table(c)
    assert kv.host_pool.num_free == 8


def test_utilisation_counts_distinct_tokens():
    kv = KVCacheManager(num_kv_blocks=8, block_size=BS)
    a = seq(0, range(6))
    compute(kv, a, 6)
    stats = kv.stats([a])
    assert stats["kv_tokens_stored"] == 6 and stats["kv_slots_allocated"] == 8
    assert stats["kv_utilisation"] == pytest.approx(0.75)
