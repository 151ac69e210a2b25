"""What one layer's paged-attention call takes beyond its tensors, as one value.

The kernel binding (`kernels.paged_attention`, `kernels.AttentionStep`), the plain torch reference
(`reference.paged_attention_reference`) and the step model's layers (`models/attention_op.py`) take the
same `AttentionOptions`, checked once when it is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionOptions:
    """One layer's attention: the pool layer it reads and writes, the score scale, and its sliding window
    and logit soft-cap (0: none; the C ABI's trtpaged_attention_options).

    sliding_window > 0: a query at position p reads only positions p - sliding_window + 1 .. p;
    logit_softcap > 0: scores become cap * tanh(score / cap) before the softmax.
    Raises ValueError naming a bad value."""

    layer: int
    scale: float
    sliding_window: int = 0
    logit_softcap: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise ValueError(f"layer: got {self.layer!r}; expected an int >= 0")
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale: got {self.scale!r}; expected a finite float > 0")
        window = self.sliding_window
        if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window < 1 << 31:
            raise ValueError(f"sliding_window: got {window!r}; expected an int >= 0 (0: none)")
        if not (isinstance(self.logit_softcap, (int, float)) and 0.0 <= self.logit_softcap < math.inf):
            raise ValueError(f"logit_softcap: got {self.logit_softcap!r}; expected a finite float >= 0 (0: none)")
