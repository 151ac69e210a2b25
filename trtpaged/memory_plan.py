"""The KV memory plan of an engine: how many sequences fit in the KV budget.

Paging wastes at most one partly-filled block per sequence, so a sequence of
length L holds ceil(L / block_size) blocks. A contiguous (unpaged) cache
reserves max_seq_len tokens per sequence whatever its length; the plan shows
both so the gain is visible.

With tensor parallelism each rank holds only its KV heads: its bytes per token
are the total / N, the budget (memory, fraction) is per rank, and all ranks hold
the same block ids, so N ranks with N times the memory fit N times the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from trtpaged.manifest import Manifest


@dataclass(frozen=True)
class MemoryPlan:
    bytes_per_token: int  # one rank's (the whole model's when tensor_parallel is 1)
    bytes_per_block: int
    block_size: int
    max_seq_len: int
    max_batch_size: int
    budget_rule: str  # how the number of blocks is decided
    num_kv_blocks: Optional[int]  # None when decided at serve time and no memory figure was given
    capped: bool = False  # a fraction budget was capped at max_batch_size sequences of max_seq_len
    kv_cache_dtype: str = ""
    # the same KV memory with other cache dtypes: (kv dtype, bytes per token, bytes per block)
    alternatives: list[tuple[str, int, int]] = field(default_factory=list)
    tensor_parallel: int = 1
    layer_windows: tuple[int, ...] = ()  # the model's sliding window per layer (0: global); (): none

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def window_blocks(self, window: int) -> int:
        """Most blocks a decoding sequence holds when the blocks before its window are returned: the window's
        keys straddle ceil(window / block_size) + 1 blocks, and with prefix caching the last full block is kept
        as its successor's chain parent (KVCacheManager.reclaim)."""
        return -(-window // self.block_size) + 2

    def _window_lines(self, length: int) -> list[str]:
        """Sequences of `length` tokens that fit with and without reclamation (every layer windowed), or the
        saving per-layer-group tables would give and that is not taken (interleaved local / global layers)."""
        windows = self.layer_windows
        if not windows or not any(windows) or self.num_kv_blocks is None:
            return []
        full = self.blocks_for(length)
        if 0 not in windows:
            held = min(full, self.window_blocks(max(windows)))
            return [f"sliding window {max(windows)} on every layer: blocks before a sequence's window return to the "
                    f"pool as it advances;",
                    f"  sequences of {length} tokens that fit: {self.num_kv_blocks // held:,} reclaimed ({held} blocks "
                    f"each) vs {self.num_kv_blocks // full:,} with the full table ({full} blocks each)"]
        local = [w for w in windows if w]
        per_group = sum(min(full, self.window_blocks(w)) for w in local) + full * (len(windows) - len(local))
        share = per_group / (full * len(windows))
        return [f"sliding window on {len(local)} of {len(windows)} layers (the others global): the full table is "
                f"kept (one block holds every layer's K/V);",
                f"  per-layer-group tables would hold {share:.0%} of it at {length} tokens: "
                f"{int(self.num_kv_blocks / (full * share)):,} sequences instead of {self.num_kv_blocks // full:,} "
                "(not taken)"]

    def max_sequences(self, length: int) -> Optional[int]:
        """Sequences of `length` tokens that fit in the KV budget together (paged)."""
        if self.num_kv_blocks is None:
            return None
        return self.num_kv_blocks // self.blocks_for(length)

    def contiguous_sequences(self) -> Optional[int]:
        """Sequences that would fit if each reserved max_seq_len tokens contiguously."""
        if self.num_kv_blocks is None:
            return None
        return self.num_kv_blocks * self.block_size // self.max_seq_len

    def lines(self, avg_len: Optional[int] = None) -> list[str]:
        """The plan as printable lines."""
        n = self.tensor_parallel
        if n == 1:
            out = [f"KV bytes per token:   {self.bytes_per_token:,} (K and V, every layer)",
                   f"KV bytes per block:   {self.bytes_per_block:,} ({self.block_size} tokens)"]
        else:
            out = [f"tensor parallel:      {n} ranks, each with its share of the KV heads and its own pool",
                   f"KV bytes per token:   {self.bytes_per_token * n:,} in all, {self.bytes_per_token:,} per rank "
                   f"(total / {n})",
                   f"KV bytes per block:   {self.bytes_per_block:,} per rank ({self.block_size} tokens)"]
        out.append(f"KV budget:            {self.budget_rule}")
        if self.num_kv_blocks is None:
            out.append("blocks in budget:     decided at serve time (pass --memory SIZE to evaluate)")
            return out
        per_rank = " per rank" if n > 1 else ""
        out.append(f"blocks in budget:     {self.num_kv_blocks:,} "
                   f"({format_bytes(self.num_kv_blocks * self.bytes_per_block)}"
                   f"{per_rank}, {self.num_kv_blocks * self.block_size:,} tokens)")
        fit = self.max_sequences(self.max_seq_len)
        out.append(f"max concurrent sequences at max_seq_len {self.max_seq_len}: {fit:,}{self._cap(fit)}")
        if avg_len is not None:
            fit_avg = self.max_sequences(avg_len)
            out.append(f"max concurrent sequences at average length {avg_len}: {fit_avg:,} "
                       f"({self.blocks_for(avg_len)} blocks each){self._cap(fit_avg)}")
            out.append(f"  (unpaged, reserving max_seq_len per sequence: {self.contiguous_sequences():,})")
        out += self._window_lines(avg_len or self.max_seq_len)
        out += self._dtype_lines(avg_len)
        return out

    def _dtype_lines(self, avg_len: Optional[int]) -> list[str]:
        """The same KV memory with each alternative cache dtype: bytes per token and concurrent sequences."""
        if not self.alternatives or self.num_kv_blocks is None:
            return []
        memory = self.num_kv_blocks * self.bytes_per_block
        length = avg_len or self.max_seq_len
        rows = [(self.kv_cache_dtype, self.bytes_per_token, self.bytes_per_block)] + self.alternatives
        fits = {name: memory // per_block // self.blocks_for(length) for name, _, per_block in rows}
        out = [f"same KV memory ({format_bytes(memory)}) by kv_cache_dtype, sequences of {length} tokens:"]
        for name, per_token, per_block in rows:
            mark = " (this engine)" if name == self.kv_cache_dtype else ""
            ratio = "".join(f", {fits[name] / fits[o]:.2f}x {o}" for o in ("float16", "float32")
                            if o != name and fits.get(o))
            out.append(f"  {name:<9} {per_token:>8,} B/token {memory // per_block:>9,} blocks "
                       f"{fits[name]:>8,} sequences{ratio}{mark}")
        return out

    def _cap(self, fit: int) -> str:
        return f" (a step runs at most max_batch_size {self.max_batch_size})" if fit > self.max_batch_size else ""


def format_bytes(n: int) -> str:
    """1536 -> '1.50 KiB'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def plan_memory(manifest: Manifest, memory_bytes: Optional[int] = None) -> MemoryPlan:
    """The plan of an engine; `memory_bytes` stands for free device memory when the budget is a fraction."""
    from trtpaged.kv_budget import kv_blocks, useful_blocks

    kv, block_bytes = manifest.kv_cache, manifest.kv_bytes_per_block_per_rank
    n = manifest.tensor_parallel
    blocks = kv_blocks(manifest, memory_bytes)  # the runtime's own count
    capped = False
    if kv.num_kv_blocks is not None:
        rule = f"num_kv_blocks {kv.num_kv_blocks}"
    elif kv.memory_bytes is not None:
        rule = f"memory {format_bytes(kv.memory_bytes)}{' per rank' if n > 1 else ''}"
    else:
        rule = f"fraction {kv.fraction} of free device memory{' of each rank' if n > 1 else ''} at serve time"
        if memory_bytes is not None:
            rule += f" (evaluated for {format_bytes(memory_bytes)} free)"
            capped = blocks == useful_blocks(manifest.limits)  # the fraction held at least the cap
            if capped:
                rule += ", capped at max_batch_size x max_seq_len"
    return MemoryPlan(
        bytes_per_token=manifest.kv_bytes_per_token_per_rank,
        bytes_per_block=block_bytes,
        block_size=manifest.limits.block_size,
        max_seq_len=manifest.limits.max_seq_len,
        max_batch_size=manifest.limits.max_batch_size,
        budget_rule=rule,
        num_kv_blocks=blocks,
        capped=capped,
        kv_cache_dtype=manifest.kv_cache_dtype,
        alternatives=[(name, manifest.dims.kv_bytes_per_token(name) // n,
                       manifest.dims.kv_bytes_per_token(name) // n * manifest.limits.block_size)
                      for name in ("float32", "float16", "int8") if name != manifest.kv_cache_dtype],
        tensor_parallel=n,
        layer_windows=tuple(manifest.dims.layer_windows),
    )
