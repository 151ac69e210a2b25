"""One physical KV block: its reference count, its prefix-cache identity and free-queue links."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# (block_id, generation) of the block a cached block follows in its hash chain.
ParentRef = Optional[tuple[int, int]]


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
