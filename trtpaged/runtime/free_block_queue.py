"""A doubly linked queue of free blocks with O(1) pop, push and removal from the middle."""

from __future__ import annotations

from typing import Iterable, Iterator

from trtpaged.runtime.kv_block import KVBlock


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
