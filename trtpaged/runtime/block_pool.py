"""The block pool: KV blocks with reference counts, their LRU free queue and the prefix cache.

One structure in one module (as vLLM keeps a block and its free queue together):
`KVBlock` carries the free-queue links, `FreeBlockQueue` threads them, `BlockPool`
owns both and the hash -> block cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

# (block_id, generation) of the block a cached block follows in its hash chain; for a sequence's first block, the
# sequence's cache salt (None: unsalted), so that blocks of different salts never match, whatever their hashes; for a
# block after a hole (a block before a sliding window that was never loaded), the tier key of the block before it
# (kv_tiers/entry.py: it names the whole prefix before the block).
ParentRef = Union[None, str, tuple[int, int], bytes]


@dataclass(eq=False)
class KVBlock:
    """A fixed-size slot range of the KV pool.

    `generation` is bumped every time the block is evicted from the prefix cache
    and reused, so a `(block_id, generation)` pair names one exact content: a
    cached child whose parent was evicted can never be matched through it.
    The free-queue links live in the block itself so removal is O(1).
    """

    block_id: int
    ref_cnt: int = 0
    generation: int = 0
    block_hash: Optional[int] = None  # set while the block is in the prefix cache
    token_ids: Optional[tuple[int, ...]] = None  # the tokens whose K/V it holds, when cached
    parent: ParentRef = None  # chain predecessor, when cached
    prev_free: Optional["KVBlock"] = field(default=None, repr=False)
    next_free: Optional["KVBlock"] = field(default=None, repr=False)
    in_free_queue: bool = False

    @property
    def ref(self) -> tuple[int, int]:
        """This block's identity as a chain parent."""
        return (self.block_id, self.generation)

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None


class FreeBlockQueue:
    """Free blocks in eviction order: the front is reused first.

    The links are fields of `KVBlock`, so taking a cached block back out of the
    queue on a prefix-cache hit costs O(1), unlike a `deque.remove`.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        if block.in_free_queue:
            raise ValueError(f"block {block.block_id}: already in the free queue")
        nxt = anchor.next_free
        assert nxt is not None
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = block
        nxt.prev_free = block
        block.in_free_queue = True
        self._len += 1

    def append(self, block: KVBlock) -> None:
        """Puts a block at the back: evicted last (most recently used)."""
        tail_prev = self._tail.prev_free
        assert tail_prev is not None
        self._insert_after(tail_prev, block)

    def appendleft(self, block: KVBlock) -> None:
        """Puts a block at the front: reused first (it holds nothing worth keeping)."""
        self._insert_after(self._head, block)

    def remove(self, block: KVBlock) -> None:
        """Takes a block out of the queue wherever it is."""
        if not block.in_free_queue:
            raise ValueError(f"block {block.block_id}: not in the free queue")
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        block.in_free_queue = False
        self._len -= 1

    def popleft(self) -> KVBlock:
        """Removes and returns the front block."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("free block queue is empty")
        self.remove(block)
        return block


HashFn = Callable[[Optional[int], tuple[int, ...]], int]


def chain_hash(parent_hash: Optional[int], token_ids: tuple[int, ...]) -> int:
    """Hash of a full block: its predecessor's hash and its own token ids."""
    return hash((parent_hash, token_ids))


def root_hash(cache_salt: Optional[str]) -> Optional[int]:
    """The parent hash of a sequence's first block: None, or one of its cache salt (vLLM's `cache_salt`: the salt
    goes into the first block's hash, and through the chain into every later one)."""
    return None if cache_salt is None else hash(("cache_salt", cache_salt))


class BlockPool:
    """Owns every physical block of one KV pool.

    A block is *used* (ref_cnt > 0), or *free* and in the free queue. Free blocks
    that still hold a cached prefix stay findable through the cache until they
    are reused (lazy eviction): uncached blocks go to the front of the queue,
    cached ones to the back, so the least recently used cached block is evicted
    first. A cache hit compares token ids and the parent's exact identity, so a
    hash collision can cost a miss but never return wrong K/V.
    """

    def __init__(self, num_kv_blocks: int, enable_caching: bool = True, hash_fn: HashFn = chain_hash) -> None:
        if num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {num_kv_blocks}")
        self.num_kv_blocks = num_kv_blocks
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.blocks = [KVBlock(block_id=i) for i in range(num_kv_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cache: dict[int, dict[int, KVBlock]] = {}  # hash -> {block_id: block}
        self._num_cached = 0  # blocks in _cache's buckets
        self.num_evictions = 0
        self._num_shared_refs = 0  # references beyond the first on used blocks
        self.peak_used = 0  # most blocks in use at once
        self.peak_shared_refs = 0  # most blocks saved by sharing at once
        # Called with a cached block just before its content is dropped for reuse (write-back to the tiers).
        self.on_evict: Optional[Callable[[KVBlock], None]] = None

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out now (free, cached or not)."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_kv_blocks - len(self.free_queue)

    @property
    def num_cached(self) -> int:
        """Blocks whose content is findable in the prefix cache (used or free)."""
        return self._num_cached

    def allocate(self, count: int) -> list[KVBlock]:
        """Takes `count` blocks from the front of the free queue, evicting cached content."""
        if count > self.num_free:
            raise RuntimeError(f"allocate: {count} blocks requested, {self.num_free} free (plan the allocation first)")
        out = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.generation += 1  # a new identity: no stale chain link can reach it
            block.ref_cnt = 1
            out.append(block)
        self.peak_used = max(self.peak_used, self.num_used)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Takes one more reference on each block (a cache hit or a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            else:
                self._num_shared_refs += 1
            block.ref_cnt += 1
        self.peak_used = max(self.peak_used, self.num_used)
        self.peak_shared_refs = max(self.peak_shared_refs, self._num_shared_refs)

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drops one reference on each block, in the given order (pass tail blocks first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"free: block {block.block_id} has ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                self._num_shared_refs -= 1
            elif block.is_cached:
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
        self._num_cached += 1
        return True

    def forget_cached(self) -> int:
        """Drops every cached prefix at once (nothing written back); only while no block is in use. Returns how
        many blocks were cached."""
        if self.num_used:
            raise RuntimeError(f"forget_cached: {self.num_used} blocks in use")
        cached = [block for bucket in self._cache.values() for block in bucket.values()]
        for block in cached:
            block.block_hash = block.token_ids = block.parent = None
            block.generation += 1
        self._cache.clear()
        self._num_cached = 0
        return len(cached)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.on_evict is not None:
            self.on_evict(block)
        bucket = self._cache[block.block_hash]
        del bucket[block.block_id]
        self._num_cached -= 1
        if not bucket:
            del self._cache[block.block_hash]
        block.block_hash = block.token_ids = block.parent = None
        self.num_evictions += 1

    def num_shared_refs(self) -> int:
        """Blocks saved by sharing: every reference beyond the first on a used block."""
        return self._num_shared_refs
