"""The model's recommended sampling settings, as vLLM reads them (`--generation-config auto`, its default).

A model's generation_config.json may set temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens.
The build records those it sets, under `sampling_defaults` in the manifest (SamplingParams' names: max_new_tokens is
max_tokens). A server request that leaves such a field unset then samples with the model's value instead of the API's
default (vLLM's rule) and its max_tokens, given or not, is capped at the model's max_new_tokens (the server);
`LLM.generate` given no SamplingParams uses them all (`LLM.get_default_sampling_params`). The values are checked
here (the manifest is untrusted input) against the ranges `SamplingParams` takes.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

# generation_config.json's name -> SamplingParams' name (vLLM's list)
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # fmt: skip
FIELDS = tuple(GENERATION_CONFIG_FIELDS.values())
FLOAT32_MAX = 3.4028234663852886e38  # the largest temperature (a finite float32 scale)
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # logits scaled by <= 100x, then by 1/temperature <= 1e5: finite in fp32
MAX_TOKENS_BOUND = 1 << 24  # far beyond any engine's max_seq_len


class SamplingDefaultError(ValueError):
    """A sampling default no request could take: `field` (a SamplingParams name) and `message` (the rule)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"sampling_defaults.{field}: {message}")
        self.field = field
        self.message = message


def from_generation_config(generation_config: Any) -> dict[str, Any]:
    """The sampling fields a GenerationConfig read from a model's generation_config.json sets to other than
    transformers' own defaults (its diff dict, as vLLM reads it), under SamplingParams' names; {} for None. A
    max_new_tokens past MAX_TOKENS_BOUND is recorded as the bound (it only caps max_tokens, which max_seq_len caps
    far lower)."""
    if generation_config is None:
        return {}
    diff = generation_config.to_diff_dict()
    values = {ours: diff[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items() if diff.get(theirs) is not None}
    cap = values.get("max_tokens")
    if isinstance(cap, int) and not isinstance(cap, bool) and cap > MAX_TOKENS_BOUND:
        values["max_tokens"] = MAX_TOKENS_BOUND
    return values


def check(values: Mapping[str, Any]) -> None:
    """Raises SamplingDefaultError for an unknown field or a value no request could take (SamplingParams'
    ranges)."""
    for name, value in values.items():
        if name not in FIELDS:
            raise SamplingDefaultError(name, f"unknown field; one of {', '.join(FIELDS)}")
        integer = name in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise SamplingDefaultError(name, f"got {value!r:.80}; expected {'an integer' if integer else 'a number'}")
        if isinstance(value, float) and not math.isfinite(value):  # an int compares with floats exactly, however big
            raise SamplingDefaultError(name, f"got {value}; expected a finite number")
        ok, rule = {
            "temperature": (0 <= value <= FLOAT32_MAX, "in [0, 3.4e38]"),
            "top_p": (0 < value <= 1, "in (0, 1]"),
            "top_k": (value >= -1, ">= -1 (0 or -1: off)"),
            "min_p": (0 <= value <= 1, "in [0, 1]"),
            "repetition_penalty": (REPETITION_PENALTY_RANGE[0] <= value <= REPETITION_PENALTY_RANGE[1],
                                   "in [{}, {}]".format(*REPETITION_PENALTY_RANGE)),
            "max_tokens": (1 <= value <= MAX_TOKENS_BOUND, f"in [1, {MAX_TOKENS_BOUND}]"),
        }[name]  # fmt: skip
        if not ok:
            raise SamplingDefaultError(name, f"got {value!r:.80}; expected {rule}")
