"""The speculation cost rule's default `verify_row_cost` for an engine, from how its linears compute.

What one more query row adds to a one-row decode step depends on the engine's arithmetic. Measured on SmolLM2
(a one-sequence step of 6 rows against 1 row at 128 keys of context, 9 interleaved pairs, quiet 2-core EPYC;
per extra row, as a fraction of the one-row step):

| engine | AVX-512 VNNI | AVX2 (forced) |
|---|---|---|
| float32 weights: the weights are streamed once whatever the rows | 0.065 | 0.07-0.09 |
| int4 weights, int8 activations (w4a8): integer dot products per row | 0.17-0.19 | 0.22-0.26 |
| int4 weights, float activations, as float tiles (steps of several sequences) | 0.29-0.32 | 0.29-0.37 |
| the same as limbs (a one-sequence step: StepBatch's `row_invariant`) | 0.32-0.41 | 0.44-0.48 |

A one-sequence verification step of a float-activation engine runs its rows as limbs, so that each row gets
the bits of a one-row step (greedy outputs unchanged by speculation); its default is the limbs' cost. (The
table's AVX2 column, a Zen 4 forced to AVX2, predates plain AVX2's int8 LM head taking the float tiles at every
row count, round 18.)

The cost follows the core more than the instruction set. On a Zen 1-class EPYC (AVX2 only, 256-bit operations
split in two, one vector-multiply pipe: a one-row step is already compute-bound there) the same measurement
(`scripts/step_rows.py ENGINE --rows 1,6 --mode verify`, with round 19's kernels: round 18's float-tile LM head,
and the streamed int8-activation LM head that made w4a8's one-row step faster and so its row ratio higher) gave
w4a8 0.36-0.41 and int4 as limbs 0.64-0.71 per row (as float tiles: 0.45). The defaults stay those of the table:
on such a CPU, `speculative_config.verify_row_cost` 0.4 (w4a8) or 0.7 (int4) keeps the rule from proposing
drafts that cost more than they yield. Round 20's kernels request each next weight tile in decode steps, which
made one-row steps 1.2-1.5x faster and 6-row ones less so: on a 2-vCPU Xeon, per extra row, w4a8 0.22 (forced
AVX2) and 0.13 (AVX-512), int4 as limbs 0.33 and 0.28 (docs/benchmarks.md, round 20), still within the defaults.

A constant (0.3, rounds 5-8) was right for the last kind only: it kept float32 and w4a8 engines from
verifying drafts that pay. Timing the steps at load instead was tried and dropped: with the kernels' two
OpenMP threads sharing the cores with anything else, a step took 20x its time and the ratio came out
anywhere from 0.001 to 0.63, a wrong value kept for the engine's life.
"""

from __future__ import annotations

from typing import Any, Mapping

FLOAT_WEIGHTS_ROW_COST = 0.07
INT8_ACTIVATIONS_ROW_COST = 0.2
FLOAT_ACTIVATIONS_ROW_COST = 0.4


def default_verify_row_cost(quantization: Mapping[str, Any]) -> float:
    """The per-row cost of a verification step for an engine with this manifest `quantization` ({} for
    float weights; "weights" and "activations" otherwise), from the table in this module's docstring."""
    if not quantization or not quantization.get("weights"):
        return FLOAT_WEIGHTS_ROW_COST
    if quantization.get("activations") == "int8":
        return INT8_ACTIVATIONS_ROW_COST
    return FLOAT_ACTIVATIONS_ROW_COST
