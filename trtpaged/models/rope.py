"""Rotary position embedding frequencies, computed as transformers computes them.

Supported `rope_type`s: default, linear, llama3. Others are refused at config
time (`SUPPORTED_ROPE_TYPES`). Pure functions of ModelDims: the runtime never
needs transformers to rebuild them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type(rope_scaling: Optional[dict]) -> str:
    """The rope_type of an HF rope_scaling / rope_parameters dict ("default" for None)."""
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def inv_frequencies(head_dim: int, rope_theta: float, rope_scaling: Optional[dict]) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim // 2] float32, attention scaling of cos/sin)."""
    kind = rope_type(rope_scaling)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if kind == "default":
        return inv_freq, 1.0
    params = dict(rope_scaling or {})
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, params), 1.0
    raise ValueError(f"rope_scaling.rope_type: got {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by factor, a smooth blend in between."""
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Applies RoPE in the HF (rotate-half) layout: x [T, heads, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
