"""The engine I/O contract of one step: input names in contract order and their dynamic axes.

Written once and read by the exporter (torch.export dims), the TensorRT compile stage (the
optimization profile), the TensorRT runner (bindings) and the probe batches. See
docs/architecture.md for the meaning of each input.
"""

from __future__ import annotations

# The step inputs in contract order and their dynamic axes, written once: axis -> (dimension, offset).
STEP_INPUT_AXES: dict[str, dict[int, tuple[str, int]]] = {
    "input_ids": {0: ("num_tokens", 0)},
    "positions": {0: ("num_tokens", 0)},
    "query_start": {0: ("num_seqs", 1)},
    "context_lens": {0: ("num_seqs", 0)},
    "block_tables": {0: ("num_seqs", 0), 1: ("max_blocks_per_seq", 0)},
    "logits_index": {0: ("num_outputs", 0)},
    "kv_cache": {0: ("num_kv_blocks", 0)},
}
INPUT_NAMES = tuple(STEP_INPUT_AXES)
MAX_KV_BLOCKS = 2**31 - 1  # block ids are int32 in block_tables (and the kernels' num_kv_blocks)
