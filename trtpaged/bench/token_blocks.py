"""Prompts made of blocks that hash ids name (a Mooncake trace's `hash_ids`): one id, one block, wherever it appears.

A hash id names a block of BLOCK_TOKENS (512) prompt tokens, as Mooncake's FAST'25 traces count them and the tools
that replay them (aiperf, Dynamo's data generator) read them. A prompt of `length` tokens over n ids is their blocks
one after the other, cut to `length`, which must lie in ((n - 1) * 512, n * 512]: each block holds at least one of
the prompt's tokens and only the last may be partial (aiperf's rule). Each id's block is drawn once from
`random.Random` seeded with the seed and the id (a string seed: its SHA-512, the same in every process), so two
prompts with the same leading ids hold the same tokens there, and differ from the first block whose ids differ. Only
the ids' order is read: an id that follows another parent in another request (no chain hash can) is still the same
block, which the engine's prefix cache, keyed on the whole prefix, shares only at the same prefix.
"""

from __future__ import annotations

import random
from typing import Optional, Sequence, TypeVar

BLOCK_TOKENS = 512
MAX_HASH_ID = (1 << 63) - 1  # a signed 64-bit integer: the traces' ids are small counters

T = TypeVar("T")


def check_hash_ids(value: object) -> tuple[int, ...]:
    """`value` (a parsed JSON value) as a tuple of hash ids; ValueError naming `hash_ids` (and the element) and
    what is wrong with it."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"hash_ids: must be a list of integers (one block id per {BLOCK_TOKENS} prompt tokens), "
                         f"got {shown(value)}")  # fmt: skip
    if not value:
        raise ValueError("hash_ids: must name at least one block (a prompt has at least one token), got []")
    for i, hash_id in enumerate(value):
        bounded_integer(f"hash_ids[{i}]", hash_id, 0, MAX_HASH_ID)
    return tuple(value)


def check_cover(length: int, num_blocks: int, name: str) -> None:
    """ValueError naming `name` when a prompt of `length` tokens is not what `num_blocks` blocks make: from
    (num_blocks - 1) * 512 + 1 to num_blocks * 512 tokens."""
    low, high = (num_blocks - 1) * BLOCK_TOKENS + 1, num_blocks * BLOCK_TOKENS
    if not low <= length <= high:
        raise ValueError(f"{name}: {length} tokens over {num_blocks} hash_ids: must be from {low} to {high} (each id "
                         f"names {BLOCK_TOKENS} tokens; every block holds at least one, only the last may be "
                         "partial)")  # fmt: skip


def block(hash_id: int, population: Sequence[T], seed: int = 0) -> list[T]:
    """The BLOCK_TOKENS items (token ids, words) that `hash_id` names under `seed`, drawn from `population`."""
    return random.Random(f"trtpaged-block/{seed}/{hash_id}").choices(population, k=BLOCK_TOKENS)


def block_prompt(hash_ids: Sequence[int], length: int, population: Sequence[T], seed: int = 0,
                 cache: Optional[dict[int, list[T]]] = None) -> list[T]:  # fmt: skip
    """The blocks of `hash_ids` one after the other, cut to `length` items. `cache` (id -> block) keeps the blocks
    drawn for the next prompts of the same population and seed."""
    cache = {} if cache is None else cache
    out: list[T] = []
    for hash_id in hash_ids:
        if len(out) >= length:
            break
        items = cache.get(hash_id)
        if items is None:
            items = cache[hash_id] = block(hash_id, population, seed)
        out += items[: length - len(out)]
    return out


def shown(value: object, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters (a hostile line's value may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bounded_integer(name: str, value: object, low: int, high: int, unit: str = "") -> int:
    """`value` (a parsed JSON value) if it is an integer from `low` to `high`; else ValueError naming `name`, the
    bound (and its `unit`, e.g. " (tokens)") and the value."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer from {low} to {high}{unit}, got {shown(value)}")
    if not low <= value <= high:
        raise ValueError(f"{name}: must be from {low} to {high}{unit}, got {shown(value)}")
    return value
