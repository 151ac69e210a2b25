"""The commands rank 0 broadcasts to the other ranks: a fixed int64 header, then an int32 payload.

    header  [op, payload length, field 0 .. field 5]
    payload int32, only when its length is not 0

| op | fields | payload |
|---|---|---|
| INIT | num_kv_blocks, num_host_blocks, manifest fingerprint (63 bits) | - |
| STEP | num_tokens, num_seqs, max_blocks_per_seq | input_ids, positions, query_start, context_lens, block_tables |
| COPY, SWAP_OUT, SWAP_IN | number of pairs | the (src, dst) pairs |
| READ_BLOCKS | number of blocks | block ids; then rank 1, 2, .. each broadcast their shards' bytes (uint8) |
| WRITE_BLOCKS | number of blocks | block ids; then rank 0 broadcasts every rank's shards (uint8, block-major) |
| STOP | - | - |

READ_BLOCKS and WRITE_BLOCKS carry the KV tiers' blocks (kv_tiers/): a tier entry holds one block of
every rank, rank 0's shard first.

A STEP carries no logits_index: only rank 0 computes logits (the other ranks'
final norm and LM head would only be thrown away).
"""

from __future__ import annotations

import enum
import hashlib
from datetime import timedelta
from typing import Optional, Sequence

import torch

from trtpaged.runtime.runners.base import StepBatch
from trtpaged.runtime.tp.rendezvous import Collectives

HEADER_LEN = 8
# How long a rank waits for rank 0's next command: an engine with no requests sends none, so the collective's
# timeout would end every worker of an idle server (it did, TRTPAGED_TP_TIMEOUT_S after the last request). A rank 0
# that exits closes the connection (reported at once), and a local worker also watches its parent. Ten years,
# not more: gloo adds it to the clock in nanoseconds (100000 days overflowed and aborted the process).
IDLE_TIMEOUT = timedelta(days=3650)
_NUM_FIELDS = HEADER_LEN - 2


class Op(enum.IntEnum):
    INIT = 1
    STEP = 2
    COPY = 3
    SWAP_OUT = 4
    SWAP_IN = 5
    STOP = 6
    READ_BLOCKS = 7
    WRITE_BLOCKS = 8


def send(coll: Collectives, op: Op, fields: Sequence[int] = (), payload: Optional[torch.Tensor] = None,
         timeout: Optional[timedelta] = None) -> None:
    """Rank 0: broadcasts one command; `timeout` replaces the collective timeout for it."""
    length = 0 if payload is None else int(payload.numel())
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = int(op), length
    header[2:2 + len(fields)] = torch.tensor(list(fields), dtype=torch.int64)
    coll.broadcast(header, timeout=timeout)
    if length:
        coll.broadcast(payload.to(torch.int32).contiguous(), timeout=timeout)


def receive(coll: Collectives) -> tuple[Op, list[int], torch.Tensor]:
    """Other ranks: the next command (op, fields, payload), after however long rank 0 stays idle."""
    header = coll.broadcast(torch.empty(HEADER_LEN, dtype=torch.int64), timeout=IDLE_TIMEOUT)
    op, length = Op(int(header[0])), int(header[1])
    payload = torch.empty(length, dtype=torch.int32)
    if length:
        coll.broadcast(payload)
    return op, header[2:].tolist(), payload


def step_message(batch: StepBatch) -> tuple[list[int], torch.Tensor]:
    """(fields, payload) of a STEP."""
    tables = batch.block_tables
    payload = torch.cat([batch.input_ids.flatten(), batch.positions.flatten(), batch.query_start.flatten(),
                         batch.context_lens.flatten(), tables.flatten()]).to(torch.int32)
    width = int(tables.shape[1]) if tables.dim() == 2 else 0
    return [batch.num_tokens, int(batch.context_lens.numel()), width, int(batch.row_invariant)], payload


def step_batch(fields: list[int], payload: torch.Tensor) -> StepBatch:
    """The StepBatch of a received STEP (logits_index empty)."""
    tokens, seqs, width, row_invariant = fields[:4]
    input_ids, positions, query_start, context_lens, tables = payload.split(
        [tokens, tokens, seqs + 1, seqs, seqs * width])
    return StepBatch(input_ids, positions, query_start, context_lens, tables.view(seqs, width),
                     torch.empty(0, dtype=torch.int32), bool(row_invariant))


def pairs_payload(pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor([x for pair in pairs for x in pair], dtype=torch.int32)


def ids_payload(block_ids: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(block_ids), dtype=torch.int32)


def shard_bytes(coll: Collectives, block_ids: Sequence[int], own: list[bytes], block_bytes: int) -> list[bytes]:
    """READ_BLOCKS on every rank: each rank r >= 1 broadcasts its shards in turn; rank 0 gets, per block,
    every rank's shard concatenated in rank order (the other ranks get [])."""
    n = len(block_ids)
    shards = [own]
    for src in range(1, coll.world_size):
        if src == coll.rank:
            coll.broadcast(torch.frombuffer(bytearray(b"".join(own)), dtype=torch.uint8), src=src)
            shards.append(own)
        else:
            buf = coll.broadcast(torch.empty(n * block_bytes, dtype=torch.uint8), src=src).numpy().tobytes()
            shards.append([buf[i * block_bytes:(i + 1) * block_bytes] for i in range(n)])
    return [b"".join(parts) for parts in zip(*shards)] if coll.rank == 0 else []


def own_shards(data: torch.Tensor, block_ids: Sequence[int], rank: int, world_size: int,
               block_bytes: int) -> list[tuple[int, bytes]]:  # fmt: skip
    """WRITE_BLOCKS: this rank's (block id, bytes) out of every rank's shards, block-major, rank order."""
    flat = data.numpy()
    return [(b, flat[(i * world_size + rank) * block_bytes:(i * world_size + rank + 1) * block_bytes].tobytes())
            for i, b in enumerate(block_ids)]


def pairs_of(payload: torch.Tensor) -> list[tuple[int, int]]:
    flat = payload.tolist()
    return list(zip(flat[0::2], flat[1::2]))


def fingerprint(manifest_json: str) -> int:
    """63 bits of the manifest's sha256: ranks on several machines must load the same engine."""
    return int.from_bytes(hashlib.sha256(manifest_json.encode()).digest()[:8], "little") >> 1
