"""The block pool: reference-counted KV blocks, an LRU free queue and the prefix cache."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from trtpaged.runtime.free_block_queue import FreeBlockQueue
from trtpaged.runtime.kv_block import KVBlock, ParentRef

HashFn = Callable[[Optional[int], tuple[int, ...]], int]


def chain_hash(parent_hash: Optional[int], token_ids: tuple[int, ...]) -> int:
    """Hash of a full block: its predecessor's hash and its own token ids."""
    return hash((parent_hash, token_ids))


class BlockPool:
    """Owns every physical block of one KV pool.

    A block is *used* (ref_cnt > 0), or *free* and in the free queue. Free blocks
    that still hold a cached prefix stay findable through the cache until they
    are reused (lazy eviction): uncached blocks go to the front of the queue,
    cached ones to the back, so the least recently used cached block is evicted
    first. A cache hit compares token ids and the parent's exact identity, so a
    hash collision can cost a miss but never return wrong K/V.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, hash_fn: HashFn = chain_hash) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cache: dict[int, dict[int, KVBlock]] = {}  # hash -> {block_id: block}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out now (free, cached or not)."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached(self) -> int:
        """Blocks whose content is findable in the prefix cache (used or free)."""
        return sum(len(bucket) for bucket in self._cache.values())

    def allocate(self, count: int) -> list[KVBlock]:
        """Takes `count` blocks from the front of the free queue, evicting cached content."""
        if count > self.num_free:
            raise RuntimeError(f"allocate: {count} blocks requested, {self.num_free} free (check can_allocate first)")
        out = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.generation += 1  # a new identity: no stale chain link can reach it
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Takes one more reference on each block (a cache hit or a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drops one reference on each block, in the given order (pass tail blocks first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"free: block {block.block_id} has ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.is_cached:
                    self.free_queue.append(block)
                else:
                    self.free_queue.appendleft(block)

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent: ParentRef) -> Optional[KVBlock]:
        """The cached block holding exactly `token_ids` after `parent`, or None."""
        if not self.enable_caching:
            return None
        for block in self._cache.get(block_hash, {}).values():
            if block.token_ids == token_ids and block.parent == parent:
                return block
        return None

    def cache(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...], parent: ParentRef) -> bool:
        """Registers a full block in the prefix cache; False if caching is off or an equal block is there."""
        if not self.enable_caching or block.is_cached:
            return False
        if self.lookup(block_hash, token_ids, parent) is not None:
            return False
        block.block_hash, block.token_ids, block.parent = block_hash, token_ids, parent
        self._cache.setdefault(block_hash, {})[block.block_id] = block
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        bucket = self._cache[block.block_hash]
        del bucket[block.block_id]
        if not bucket:
            del self._cache[block.block_hash]
        block.block_hash = block.token_ids = block.parent = None
        self.num_evictions += 1

    def num_shared_refs(self) -> int:
        """Blocks saved by sharing: every reference beyond the first on a used block."""
        return sum(b.ref_cnt - 1 for b in self.blocks if b.ref_cnt > 1)
