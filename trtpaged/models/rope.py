"""Rotary position embedding frequencies, computed as transformers computes them.

Supported `rope_type`s: default, linear, llama3, yarn, and longrope up to its
original_max_position_embeddings (the short factors; the long factors switch on
with the sequence length, which a paged cache cannot follow). Others are refused
at config time (`SUPPORTED_ROPE_TYPES`). Pure functions of ModelDims: the runtime never
needs transformers to rebuild them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from trtpaged.manifest import as_float32

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# The frequencies are computed on the host whatever device is the default: models are built on the meta device
# (loading.py), where these few element-wise ops would go through torch's Python references, whose first use
# imports torch._dynamo and sympy (about 2 s of every engine load). The module's .to(device) moves them.
_HOST = torch.device("cpu")


def rope_type(rope_scaling: Optional[dict]) -> str:
    """The rope_type of an HF rope_scaling / rope_parameters dict ("default" for None)."""
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def inv_frequencies(head_dim: int, rope_theta: float, rope_scaling: Optional[dict],
                    max_position_embeddings: int = 2048, theta_name: str = "rope_theta") -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim // 2] float32, attention scaling of cos/sin); head_dim here is the
    rotary dims (head_dim * partial_rotary_factor). Raises ValueError for parameters out of the formulas' domain
    (theta_name: the base's field, for the message)."""
    kind = rope_type(rope_scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type: got {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    params = dict(rope_scaling or {})
    what = f"rope_scaling: {params!r:.120}" if kind != "default" else f"{theta_name} {rope_theta!r}"
    try:
        inv_freq = 1.0 / _powers(head_dim, rope_theta)  # the float32 division the C runtime takes too
        if kind == "default":
            scaled = inv_freq, 1.0
        elif kind == "linear":
            scaled = inv_freq / float(params["factor"]), 1.0
        elif kind == "llama3":
            scaled = _llama3(inv_freq, params), 1.0
        elif kind == "longrope":
            scaled = _longrope(head_dim, rope_theta, params, max_position_embeddings)
        else:
            scaled = _yarn(head_dim, rope_theta, params, max_position_embeddings)
    except (ZeroDivisionError, OverflowError, ValueError) as e:
        # an engine dir's values out of the formulas' domain (yarn's log(rope_theta) divisor at theta 1, a
        # denominator mscale of 0, longrope's log(original) at 1): what the C runtime refuses as non-finite
        raise ValueError(f"{what} gives non-finite rotary frequencies ({e})") from None
    # an engine dir's parameters are untrusted: a factor of 0 (or equal llama3 frequency factors, or a base whose
    # powers leave float32) would make every position's angle, and so every logit, NaN; so would a cos/sin scaling
    # past float32 (0 in float32: every q and k 0)
    if not bool(torch.isfinite(scaled[0]).all()):
        raise ValueError(f"{what} gives non-finite rotary frequencies")
    scaling = as_float32(float(scaled[1]))
    if not (math.isfinite(scaling) and 0 < abs(scaling) <= MAX_ROPE_SCALING):
        raise ValueError(f"{what} gives a cos/sin scaling of {scaled[1]:g} (attention_factor, or from factor, mscale "
                         f"and mscale_all_dim), not non-zero and at most {MAX_ROPE_SCALING:g} in magnitude in float32 "
                         "(a real model's is 1 to 2; the attention scores grow as its square)")
    return scaled


# the most a cos/sin scaling may be in magnitude: q and k are both scaled, so the scores grow as its square (at
# 1e20 they pass float32 and every logit is NaN); real models' are 1 to 2
MAX_ROPE_SCALING = 1000.0


def _powers(dim: int, base: float) -> torch.Tensor:
    """base ** (2i / dim) for i < dim / 2: the exponents in float32, the power correctly rounded to float32, as the C
    runtime's libm gives it (torch's float32 pow: 1 ulp off now and then)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=_HOST).to(torch.float) / dim
    return (base ** exponents.double()).float()


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


def _longrope(dim: int, base: float, p: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Phi-3 LongRoPE with its short factors (positions below original_max_position_embeddings)."""
    original = int(p.get("original_max_position_embeddings") or max_position_embeddings)
    factor = float(p.get("factor") or max_position_embeddings / original)
    scaling = p.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = torch.tensor(p["short_factor"], dtype=torch.float32, device=_HOST)
    return 1.0 / (short * _powers(dim, base)), float(scaling)


def _yarn(dim: int, base: float, p: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated long wavelengths, extrapolated short ones, a linear ramp between (as transformers)."""
    factor = float(p["factor"])
    original = int(p.get("original_max_position_embeddings") or max_position_embeddings)
    scaling = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling is None:
        scaling = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                   else get_mscale(factor))
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pos_freqs = _powers(dim, base)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=_HOST) - low) / ((high - low) if high != low else 0.001)
    extrapolation_factor = 1 - ramp.clamp(0, 1)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(scaling)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Applies RoPE in the HF (rotate-half) layout: x [T, heads, D], cos/sin [T, R] with R <= D: the first R
    dims rotate, the rest pass through (partial rotary)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)  # not cos[:, None, :]: a slice node more per use
