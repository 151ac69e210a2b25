"""Packed probe batches and their HF reference logits (for verification and tests).

The standard probe is two chained steps over three sequences with odd lengths
and scattered physical blocks:

- step 1: prefill of A (all 54 tokens) and the first 20-token chunk of B;
- step 2: the rest of B (continuing chunk), a new 13-token prefill of C, and
  one decode token of A; the pool written by step 1 is fed back.

Every row of the step's packed tokens can be asked for; the reference for a
row is the HF model's own forward over that sequence's whole prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ProbeSequence:
    """A sequence's tokens and the physical KV blocks it owns (logical block i -> blocks[i])."""

    tokens: list[int]
    blocks: list[int]


@dataclass
class ProbeStep:
    """One step's inputs in the engine I/O contract, and which (sequence, position) each logits row is."""

    inputs: dict[str, torch.Tensor]  # input_ids, positions, query_start, context_lens, block_tables, logits_index
    rows: list[tuple[int, int]] = field(default_factory=list)

    def args(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Positional args of LlamaStepModel.forward, in contract order."""
        i = self.inputs
        return (i["input_ids"], i["positions"], i["query_start"], i["context_lens"], i["block_tables"],
                i["logits_index"], kv_cache)




def pack_step(seqs: list[ProbeSequence], chunks: list[tuple[int, int, int]], all_rows: bool = False) -> ProbeStep:
    """Packs chunks (seq index, start, end) into one step; logits rows: each chunk's last token, or every token."""
    ids, pos, starts, ctx, rows, index = [], [], [0], [], [], []
    width = max(len(seqs[s].blocks) for s, _, _ in chunks)
    tables = []
    for s, lo, hi in chunks:
        for p in range(lo, hi):
            if all_rows or p == hi - 1:
                index.append(len(ids))
                rows.append((s, p))
            ids.append(seqs[s].tokens[p])
            pos.append(p)
        starts.append(len(ids))
        ctx.append(hi)
        tables.append(seqs[s].blocks + [0] * (width - len(seqs[s].blocks)))
    i32 = torch.int32
    inputs = {
        "input_ids": torch.tensor(ids, dtype=i32),
        "positions": torch.tensor(pos, dtype=i32),
        "query_start": torch.tensor(starts, dtype=i32),
        "context_lens": torch.tensor(ctx, dtype=i32),
        "block_tables": torch.tensor(tables, dtype=i32),
        "logits_index": torch.tensor(index, dtype=i32),
    }
    return ProbeStep(inputs=inputs, rows=rows)


def standard_probe(
    vocab_size: int, block_size: int, seed: int = 0, all_rows: bool = False
) -> tuple[list[ProbeSequence], list[ProbeStep], int]:
    """(sequences, [step 1, step 2], num_kv_blocks) of the two-step probe described in the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (55, 37, 13)  # A is 54 prompt tokens + 1 decoded
    needed = [-(-n // block_size) for n in lengths]
    num_kv_blocks = sum(needed) + 3
    physical = torch.randperm(num_kv_blocks, generator=gen).tolist()  # scattered, non-contiguous blocks
    seqs, used = [], 0
    for n, nb in zip(lengths, needed):
        tokens = torch.randint(0, vocab_size, (n,), generator=gen).tolist()
        seqs.append(ProbeSequence(tokens=tokens, blocks=physical[used:used + nb]))
        used += nb
    step1 = pack_step(seqs, [(0, 0, 54), (1, 0, 20)], all_rows)
    step2 = pack_step(seqs, [(1, 20, 37), (2, 0, 13), (0, 54, 55)], all_rows)
    return seqs, [step1, step2], num_kv_blocks


@torch.no_grad()
def hf_logits(hf_model: Any, seqs: list[ProbeSequence], rows: list[tuple[int, int]]) -> torch.Tensor:
    """The HF model's float32 logits for each (sequence, position): one causal forward per sequence."""
    per_seq: dict[int, torch.Tensor] = {}
    for s in sorted({s for s, _ in rows}):
        last = max(p for t, p in rows if t == s)
        ids = torch.tensor([seqs[s].tokens[: last + 1]], dtype=torch.long)
        per_seq[s] = hf_model(input_ids=ids).logits[0].float()
    return torch.stack([per_seq[s][p] for s, p in rows])
