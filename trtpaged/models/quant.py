"""Weight-only quantization: the stored format, quantizers, and GGUF blocks carried over exactly.

A quantized weight W [N, K] (N outputs, K inputs) is codes q, a scale s and,
for int4, an offset o per group of G consecutive inputs of one output row:

    W[n, k] = s[n, k // G] * q[n, k] + o[n, k // G]

- int8: q is int8 [N, K], symmetric (no offset); G = K (one scale per output
  channel) or 32/64/128 (GGUF Q8_0 is int8 with G = 32).
- int4: q is 0..15, stored two per byte as ONNX packs int4 (q[n, 2j] in the low
  nibble of byte [n, j], q[n, 2j+1] in the high one), shape [N, K/2] uint8;
  the float offset makes it asymmetric. GGUF Q4_1 (`d*q + m`) is exactly s=d,
  o=m; Q4_0 (`d*(q-8)`) is s=d, o=-8d.

Scales and offsets are float32 tensors whose values are representable in
float16 (the quantizers round them so, and GGUF's are float16), so the kernels
may keep them as float16 without a second rounding. The layout is the engine
dir's (safetensors) and the ONNX graph's; the CPU kernels repack it at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

BITS = {"int8": 8, "int4": 4}
INT8_MAX = 127
INT4_MAX = 15


@dataclass
class QuantizedWeight:
    """Codes, scales and offsets of one weight, in the stored layout (module docstring)."""

    bits: int
    group_size: int  # G: inputs per scale; equals in_features for per-channel int8
    codes: torch.Tensor  # int8 [N, K] (bits 8) or uint8 [N, K/2] (bits 4)
    scales: torch.Tensor  # float32 [N, K/G]
    offsets: Optional[torch.Tensor] = None  # float32 [N, K/G], bits 4 only

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.codes.shape[1]) * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets) if t is not None)

    def int_codes(self) -> torch.Tensor:
        """The codes one per element: int16 [N, K] (int4 unpacked to 0..15)."""
        if self.bits == 8:
            return self.codes.to(torch.int16)
        return unpack_int4(self.codes).to(torch.int16)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in `dtype`, computed in float32 (float64 for float64)."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        q = self.int_codes().to(work)
        n, k = q.shape
        g = self.group_size
        w = q.view(n, k // g, g) * self.scales.to(work)[:, :, None]
        if self.offsets is not None:
            w = w + self.offsets.to(work)[:, :, None]
        return w.view(n, k).to(dtype)

    def rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """The weight's output rows in `index` order (a permutation of rows keeps every group intact)."""
        offsets = self.offsets[index] if self.offsets is not None else None
        return QuantizedWeight(self.bits, self.group_size, self.codes[index], self.scales[index], offsets)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stacks weights with the same inputs, bits and group size along the outputs (fused q/k/v, gate/up)."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.in_features) != (first.bits, first.group_size, first.in_features):
            raise ValueError("concat_rows: parts differ in bits, group_size or in_features")
    offsets = torch.cat([p.offsets for p in parts]) if first.offsets is not None else None
    return QuantizedWeight(first.bits, first.group_size, torch.cat([p.codes for p in parts]),
                           torch.cat([p.scales for p in parts]), offsets)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] from codes 0..15 [N, K] (ONNX order: even k in the low nibble)."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 as uint8 [N, K] from the packed [N, K/2] form."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def fp16_exact(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float16 precision, kept as float32 (values also clamp to float16's finite range)."""
    return x.clamp(-65504.0, 65504.0).to(torch.float16).to(torch.float32)


def quantize(weight: torch.Tensor, bits: int, group_size: Optional[int]) -> QuantizedWeight:
    """Quantizes a float weight [N, K]: int8 symmetric, int4 asymmetric (scale and minimum per group).

    group_size None means one group per output row (per-channel; int8 only).
    """
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    g = k if group_size is None else group_size
    if k % g:
        raise ValueError(f"group_size: {g} does not divide in_features {k}")
    groups = w.view(n, k // g, g)
    if bits == 8:
        absmax = groups.abs().amax(dim=-1)
        scales = fp16_exact(absmax / INT8_MAX)
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(groups / scales[:, :, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return QuantizedWeight(8, g, q.view(n, k).contiguous(), scales.contiguous())
    if bits == 4:
        if group_size is None:
            raise ValueError("group_size: int4 needs a group size (32, 64 or 128)")
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        offsets = fp16_exact(lo)
        scales = fp16_exact((hi - offsets) / INT4_MAX)
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round((groups - offsets[:, :, None]) / scales[:, :, None]).clamp(0, INT4_MAX)
        return QuantizedWeight(4, g, pack_int4(q.view(n, k)), scales.contiguous(), offsets.contiguous())
    raise ValueError(f"bits: got {bits}; supported: 8, 4")


# --- GGUF blocks -----------------------------------------------------------------------------
# Each GGUF row is a sequence of 32-weight blocks:
#   Q8_0: fp16 d, 32 x int8 q                      w = d * q
#   Q4_0: fp16 d, 16 bytes (q[j] low, q[j+16] high)  w = d * (q - 8)
#   Q4_1: fp16 d, fp16 m, 16 bytes (as Q4_0)         w = d * q + m
GGUF_BLOCK = 32
GGUF_EXACT_TYPES = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}


def _gguf_nibbles(qs: np.ndarray) -> np.ndarray:
    """[rows, blocks, 16] bytes -> codes [rows, blocks*32] in weight order."""
    low, high = qs & 0x0F, qs >> 4
    return np.concatenate((low, high), axis=-1).reshape(qs.shape[0], -1)


def from_gguf_blocks(type_name: str, data: np.ndarray, in_features: int) -> QuantizedWeight:
    """A GGUF tensor's raw rows (uint8 [N, bytes per row]) as a QuantizedWeight with group 32, bit-exact."""
    if type_name not in GGUF_EXACT_TYPES:
        raise ValueError(f"GGUF type {type_name} cannot be carried exactly; exact types: {', '.join(GGUF_EXACT_TYPES)}")
    rows = data.shape[0]
    nblocks = in_features // GGUF_BLOCK
    raw = np.ascontiguousarray(data).reshape(rows, nblocks, -1)

    def fp16(col: int) -> torch.Tensor:
        return torch.from_numpy(raw[:, :, col:col + 2].copy().view(np.float16)[:, :, 0].astype(np.float32))

    if type_name == "Q8_0":
        q = raw[:, :, 2:].copy().view(np.int8).reshape(rows, in_features)
        return QuantizedWeight(8, GGUF_BLOCK, torch.from_numpy(q), fp16(0))
    if type_name == "Q4_0":
        d = fp16(0)
        big = float(d.abs().max()) if d.numel() else 0.0
        if not big <= 65504.0 / 8:  # the offset -8d is then past float16's range, which the kernels keep offsets in
            raise ValueError(f"a Q4_0 block's scale d = {big:g} makes its offset -8d past float16's range (65504)")
        codes = torch.from_numpy(_gguf_nibbles(raw[:, :, 2:]))
        return QuantizedWeight(4, GGUF_BLOCK, pack_int4(codes), d, -8.0 * d)
    codes = torch.from_numpy(_gguf_nibbles(raw[:, :, 4:]))  # Q4_1
    return QuantizedWeight(4, GGUF_BLOCK, pack_int4(codes), fp16(0), fp16(2))
